"""The p2p ring (`cpkit.attention.p2p.ring_forward` / `ring_backward`) at ring sizes 2, 3 and 4 in
one process: the ranks are threads of a `cpkit.testing.thread_ring.ThreadRing`, the ring's code
runs unchanged over an in-memory transport as strict as NCCL's.

Each rank shards the same full inputs with `cpkit.sharding` and runs the ring's forward and
backward; output, dq, dk and dv are compared with the sharded single-rank reference
(`masked_sink_reference`, float32 through autograd). The dist grids (functional/) run the same
through gloo at 2 and 4 ranks; here a ring of 3 and the exact arithmetic of a 16-bit ring are
checked too, along with what the ring sends at each step.

Sizes: sbhd s = 48, b = 2; THD 4 sequences of 5..21 tokens padded to 2*n; 8 heads, 4 kv heads,
head dim 16. Tolerance fp32 rtol = atol = 1e-5 (as the dist grids; measured max errors ~1e-6).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from cpkit.attention.band import Band, check_window
from cpkit.attention.chunks import local_seq
from cpkit.attention.kernels import attn_fwd
from cpkit.attention.merge import merge
from cpkit.attention.p2p import RingKV, ring_backward, ring_forward
from cpkit.sharding import pad_cu_seqlens, shard_seq, shard_thd
from cpkit.testing.reference import masked_sink_reference, reference_shard
from cpkit.testing.thread_ring import ThreadRing

HEADS, KV_HEADS, DIM = 8, 4, 16
FP32 = dict(rtol=1e-5, atol=1e-5)
# variant -> (causal, window_size as MCore gives it, learnable sink)
VARIANTS = {
    "causal": (True, None, False),
    "nomask": (False, None, False),
    "window-causal": (True, (5, 0), False),  # sbhd at n = 4: blocks wholly outside are skipped
    "window-two-sided": (False, (4, 3), False),
    "sink": (True, None, True),
}


def _inputs(case_id: str, fmt: str, n: int, dtype=torch.float32, v_dim=DIM):
    gen = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    cu = None
    if fmt == "sbhd":
        lead = (48, 2)
    else:
        cu = pad_cu_seqlens([13, 5, 21, 9], n)
        lead = (int(cu[-1]),)
    q, dout = torch.randn(*lead, HEADS, DIM, generator=gen), torch.randn(*lead, HEADS, v_dim, generator=gen)
    k, v = torch.randn(*lead, KV_HEADS, DIM, generator=gen), torch.randn(*lead, KV_HEADS, v_dim, generator=gen)
    sink = torch.randn(HEADS, generator=gen)
    return [x.to(dtype) for x in (q, k, v, dout)], sink, cu


def _shard(x, rank, n, cu):
    return shard_seq(x, rank, n, seq_dim=0) if cu is None else shard_thd(x, cu, rank, n)


def _seq(tokens, n, cu):
    if cu is None:
        return local_seq(tokens, n)
    return local_seq(tokens, n, cu, int((cu[1:] - cu[:-1]).max()))


@pytest.mark.parametrize("variant", list(VARIANTS) + ["mla"])
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_matches_the_reference(n, fmt, variant):
    """"mla": v of its own head dim (8 against q/k's 16), carried in the ring's flat KV buffer
    as it is, not padded."""
    causal, window_size, with_sink = VARIANTS.get(variant, VARIANTS["causal"])
    v_dim = DIM // 2 if variant == "mla" else DIM
    (q, k, v, dout), sink, cu = _inputs(f"{n}-{fmt}-{variant}", fmt, n, v_dim=v_dim)
    sink = sink if with_sink else None
    scale = DIM ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = masked_sink_reference(*leaves, causal=causal, scale=scale, window=window_size, sink=sink, cu=cu)
    ref.backward(dout)
    wants = [ref.detach()] + [x.grad for x in leaves]
    window = check_window(window_size, causal)

    def rank_fn(comm):
        q_l, k_l, v_l, dout_l = (_shard(x, comm.rank, n, cu) for x in (q, k, v, dout))
        seq = _seq(q_l.shape[0], n, cu)
        band = None if window is None else Band(window, causal, seq, comm.rank, q.device)
        out, lse, kv = ring_forward(q_l, k_l, v_l, comm, causal, scale, seq, band=band, sink=sink)
        return (out, *ring_backward(dout_l, q_l, kv, out, lse, comm, causal, scale, seq, band=band))

    for rank, gots in enumerate(ThreadRing(n).run(rank_fn)):
        for name, got, want in zip(("out", "dq", "dk", "dv"), gots, wants):
            torch.testing.assert_close(got, reference_shard(want, rank, n, cu), **FP32,
                                       msg=lambda m, r=rank, nm=name: f"rank {r} of {n}, {nm}: {m}")


def _half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a unit in the last place of `dtype` at the magnitude of float32 `x` (normal numbers)."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    _, exponent = torch.frexp(x)  # |x| in [2^(e-1), 2^e)
    smallest_normal = torch.frexp(torch.tensor(torch.finfo(dtype).tiny)).exponent
    exponent = exponent.clamp(min=int(smallest_normal))  # subnormals have the smallest normal's ulp
    return torch.ldexp(torch.ones_like(x), exponent - 2 - mantissa_bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_16bit_ring_output_is_the_fp32_merge_of_its_blocks_rounded_once(n, dtype):
    """The running output is merged in fp32 and rounded to the input dtype once, at the end:
    every element lies within half a unit in the last place of the fp32 LSE merge
    (`merge.merge`) of the blocks' own 16-bit outputs in ring order (the own KV first, then
    ranks r-1, r-2, ...). Rounding after every merge instead adds cp - 1 roundings, which the
    dist grids' 16-bit tolerance does not see. No mask, so every block is the whole local
    sequence against one rank's KV. The LSEs agree to float32 rounding (1e-6)."""
    (q, k, v, _), _, _ = _inputs(f"{n}-16bit", "sbhd", n, dtype)
    scale = DIM ** -0.5
    shards = [[shard_seq(x, r, n, seq_dim=0) for x in (q, k, v)] for r in range(n)]

    def rank_fn(comm):
        q_l, k_l, v_l = shards[comm.rank]
        return ring_forward(q_l, k_l, v_l, comm, False, scale, local_seq(q_l.shape[0], n))[:2]

    for rank, (out, lse) in enumerate(ThreadRing(n).run(rank_fn)):
        # Each block's KV as the ring holds it (k and v flat in one buffer): the kernel then
        # sees the ring's memory layout and gives the ring's block output bit for bit.
        kvs = [RingKV.pack(*shards[(rank - i) % n][1:]) for i in range(n)]
        blocks = [attn_fwd(shards[rank][0], kv[0], kv[1], False, scale) for kv in kvs]
        want_out, want_lse = merge([o for o, _ in blocks], [l for _, l in blocks])
        assert out.dtype == dtype
        error = (out.float() - want_out).abs()
        # Slack for the float32 rounding of the merge's terms (the blocks' outputs, up to the
        # largest output in size), which can tip a near-tie the other way.
        bound = _half_ulp(want_out, dtype) + 1e-5 * want_out.abs().max()
        assert (error <= bound).all(), (
            f"rank {rank} of {n}: {int((error > bound).sum())} of {error.numel()} elements further than half "
            f"a {dtype} ulp from the fp32 merge (max error {error.max().item():.3g})")
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("v_dim", [DIM, DIM // 2], ids=["one-head-dim", "mla"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_sends_only_what_the_next_step_needs(n, v_dim):
    """Forward: [k, v] at every step but the last. Backward: [k, v] at the first step (no dKV
    yet), [k, v, dk, dv] in between, [dk, dv] at the last (no KV is needed after it); each
    exchange's send and receive of one shape, flat, with v at its own head dim (no padding)."""
    (q, k, v, dout), _, _ = _inputs(f"{n}-sends", "sbhd", n, v_dim=v_dim)
    scale = DIM ** -0.5
    ring = ThreadRing(n)

    def rank_fn(comm):
        q_l, k_l, v_l, dout_l = (shard_seq(x, comm.rank, n, seq_dim=0) for x in (q, k, v, dout))
        seq = local_seq(q_l.shape[0], n)
        out, lse, kv = ring_forward(q_l, k_l, v_l, comm, True, scale, seq)
        ring_backward(dout_l, q_l, kv, out, lse, comm, True, scale, seq)

    ring.run(rank_fn)
    kv = shard_seq(k, 0, n, seq_dim=0).numel() + shard_seq(v, 0, n, seq_dim=0).numel()
    forward = [((kv,), False)] * (n - 1)
    backward = [((kv,), True)] + [((2 * kv,), True)] * (n - 2) + [((kv,), True)]
    for rank in range(n):
        assert ring.sent[rank] == forward + backward, f"rank {rank}"


def test_thread_ring_stops_every_rank_when_one_fails_and_names_it():
    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("injected")
        buf = torch.zeros(3)
        comm.exchange(torch.ones(3), buf).wait()  # rank 1 never sends: its peers must not hang
        return buf

    with pytest.raises(RuntimeError, match="rank 1 of 3: KeyError") as info:
        ThreadRing(3, timeout=30).run(rank_fn)
    assert isinstance(info.value.__cause__, KeyError)


def test_thread_ring_refuses_a_receive_of_another_shape_and_times_out_naming_the_peer():
    with pytest.raises(RuntimeError, match=r"rank 0 of 2: ValueError.*send \(2,\).*receive \(3,\)"):
        ThreadRing(2).run(lambda comm: comm.exchange(torch.ones(2), torch.zeros(3)).wait())

    def only_rank_0_sends(comm):
        buf = torch.zeros(2)
        if comm.rank == 0:
            comm.exchange(torch.ones(2), buf).wait()

    with pytest.raises(RuntimeError, match="rank 0 of 2: TimeoutError.*waited 0.2 s for rank 1"):
        ThreadRing(2, timeout=0.2).run(only_rank_0_sends)
