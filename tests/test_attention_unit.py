"""CP attention pieces on one CPU process: LSE merge, kernels, local attention, input checks.

The multi-rank algorithms (p2p, all_gather, a2a, a2a+p2p) are checked in
functional/test_attention.py; here cp_group=None runs the same code path without
communication. fp32 tolerance: atol = rtol = 1e-5 (exact-math kernels, measured ~1e-6);
16-bit inputs vs the fp32 reference of the same inputs: rtol = 2e-2, atol = 2e-2 x max|ref|.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cpkit.attention import attn_bwd, attn_fwd, context_parallel_attention, reference_attention
from cpkit.attention.chunks import a2a_reorder, gathered_to_natural, local_seq
from cpkit.attention.functional import check_a2a_heads, check_comm_type
from cpkit.attention.kernels import kernel_candidates
from cpkit.attention.options import CPAttentionOptions
from cpkit.attention.merge import merge, merge_
from cpkit.errors import CPConfigError
from cpkit.sharding import pad_cu_seqlens, shard_seq, thd_partition, zigzag_indices

FP32 = dict(atol=1e-5, rtol=1e-5)


def _qkv(s=16, b=2, heads=4, kv_heads=2, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, dim, generator=gen).to(dtype)
    k = torch.randn(s, b, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(s, b, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v


def _ref_with_grads(q, k, v, dout, causal):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = reference_attention(*leaves, causal)
    out.backward(dout.float())
    return [out.detach()] + [x.grad for x in leaves]


# --------------------------------------------------------------------------------------------
# merge


def test_lse_merge_of_key_blocks_equals_full_softmax():
    q, k, v = _qkv(s=12)
    scale = 1 / math.sqrt(8)
    full_out, full_lse = attn_fwd(q, k, v, False, scale)
    parts = [attn_fwd(q, k[a:b], v[a:b], False, scale) for a, b in ((0, 5), (5, 6), (6, 12))]
    out, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, reference_attention(q, k, v, False), **FP32)
    torch.testing.assert_close(lse, full_lse, **FP32)
    # the LSE itself is the log of the full softmax denominator
    scores = torch.einsum("sbhd,tbhd->bhst", q, k.repeat_interleave(2, dim=2)) * scale
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **FP32)


def test_merge_keeps_rows_without_keys_finite():
    out = torch.zeros(3, 1, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    block_lse = torch.tensor([[[0.5, float("-inf"), 1.0]] * 2])
    block_out = torch.ones(3, 1, 2, 4)
    merge_(out, lse, block_out, block_lse)
    assert torch.isfinite(out).all()
    assert out[1].abs().sum() == 0 and torch.equal(out[0], block_out[0])
    torch.testing.assert_close(lse, block_lse)




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_merge_rounds_once_like_the_fp32_merge(dtype):
    # A ring of 2 merges straight into the first block's low-precision output: the result must
    # be the fp32 merge rounded once, bit for bit, and the LSE the fp32 one.
    gen = torch.Generator().manual_seed(3)
    out0 = torch.randn(6, 2, 4, 8, generator=gen).to(dtype)
    block = torch.randn(6, 2, 4, 8, generator=gen).to(dtype)
    lse0, block_lse = torch.randn(2, 4, 6, generator=gen), torch.randn(2, 4, 6, generator=gen)
    ref_out, ref_lse = out0.float(), lse0.clone()
    merge_(ref_out, ref_lse, block, block_lse)
    out, lse = out0.clone(), lse0.clone()
    merge_(out, lse, block, block_lse)
    assert out.dtype == dtype
    assert torch.equal(out, ref_out.to(dtype))
    assert torch.equal(lse, ref_lse)
# --------------------------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize("kernel", ["cpu", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_kernels_match_autograd_of_naive_attention(kernel, causal, kv_heads):
    forced = "math" if kernel == "math" else None
    assert kernel_candidates(torch.device("cpu"), torch.float32, forced)[0] == kernel
    q, k, v = _qkv(kv_heads=kv_heads)
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(8)
    out, lse = attn_fwd(q, k, v, causal, scale, kernel=forced)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 16)
    grads = attn_bwd(dout, q, k, v, out, lse, causal, scale, kernel=forced)
    for got, want in zip([out, *grads], _ref_with_grads(q, k, v, dout, causal)):
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_keep_16bit_dtypes(dtype):
    q, k, v = _qkv(dtype=dtype)
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(8)
    out, lse = attn_fwd(q, k, v, True, scale)
    grads = attn_bwd(dout, q, k, v, out, lse, True, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert [g.dtype for g in grads] == [dtype] * 3
    for got, want in zip([out, *grads], _ref_with_grads(q, k, v, dout, True)):
        # 16-bit rounding of the kernel's outputs: tolerance relative to the largest magnitude
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_kernel_matches_per_sequence_attention(causal):
    cu = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(20, 4, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(20, 2, 8, generator=gen) for _ in range(2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    out, lse = attn_fwd(q, k, v, causal, 0.35, **kw)
    assert lse.shape == (4, 20)
    grads = attn_bwd(dout, q, k, v, out, lse, causal, 0.35, **kw)
    for a, b in ((0, 5), (5, 12), (12, 20)):
        sl = [x[a:b].unsqueeze(1) for x in (q, k, v)]
        leaves = [x.clone().requires_grad_() for x in sl]
        ref = reference_attention(*leaves, causal, 0.35)
        ref.backward(dout[a:b].unsqueeze(1))
        torch.testing.assert_close(out[a:b], ref.detach().squeeze(1), **FP32)
        for g, leaf in zip(grads, leaves):
            torch.testing.assert_close(g[a:b], leaf.grad.squeeze(1), **FP32)


def test_kernel_rejects_non_square_causal_and_unknown_kernels():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="square"):
        attn_fwd(q, k[:8], v[:8], True, 0.3)
    with pytest.raises(ValueError, match="cudnn, flash, efficient, math"):
        kernel_candidates(torch.device("cuda"), torch.bfloat16, "triton")
    with pytest.raises(CPConfigError, match="kernel.*'triton'"):
        CPAttentionOptions(kernel="triton")


# --------------------------------------------------------------------------------------------
# local (cp_group=None) attention through the functional entry point


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_functional_without_cp_matches_reference(causal, kv_heads):
    q, k, v = _qkv(s=15, kv_heads=kv_heads)  # any length without CP
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*leaves, cp_group=None, cp_comm_type="p2p", causal=causal)
    out.backward(dout)
    for got, want in zip([out.detach()] + [x.grad for x in leaves], _ref_with_grads(q, k, v, dout, causal)):
        torch.testing.assert_close(got, want, **FP32)


def test_functional_thd_without_cp_matches_per_sequence_reference():
    cu = torch.tensor([0, 3, 3, 10, 16], dtype=torch.int32)  # odd and empty sequences are fine
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(16, 4, 8, generator=gen)
    k, v = (torch.randn(16, 2, 8, generator=gen) for _ in range(2))
    out = context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="a2a", causal=True, cu_seqlens=cu)
    for a, b in ((0, 3), (3, 10), (10, 16)):
        ref = reference_attention(q[a:b, None], k[a:b, None], v[a:b, None], True)
        torch.testing.assert_close(out[a:b], ref.squeeze(1), **FP32)


# --------------------------------------------------------------------------------------------
# token permutations used around the collectives


@pytest.mark.parametrize("cp", [2, 4])
def test_gathered_to_natural_inverts_the_zigzag_layout(cp):
    seq = local_seq(8, cp)
    expected = torch.cat([zigzag_indices(8 * cp, r, cp) for r in range(cp)])
    assert torch.equal(gathered_to_natural(seq), expected)
    cu = pad_cu_seqlens([5, 17, 2], cp).long()
    seq = local_seq(int(cu[-1]) // cp, cp, cu, 32)
    expected = torch.cat([thd_partition(cu, r, cp) for r in range(cp)])
    assert torch.equal(gathered_to_natural(seq), expected)


@pytest.mark.parametrize("a2a,p2p", [(2, 1), (4, 1), (2, 2)])
def test_a2a_reorder_gives_the_next_level_zigzag_layout(a2a, p2p):
    """After the all-to-all, the rows of a2a block `p` reordered must be the p2p-level shard p."""
    cp = a2a * p2p
    s = 8 * cp
    positions = torch.arange(s)
    for p in range(p2p):
        received = torch.cat([shard_seq(positions, p * a2a + a, cp, 0) for a in range(a2a)])
        rows = a2a_reorder(s // cp, a2a, cp)
        assert torch.equal(received[rows], shard_seq(positions, p, p2p, 0))
    cu = pad_cu_seqlens([9, 30], cp).long()
    total = int(cu[-1])
    for p in range(p2p):
        received = torch.cat([thd_partition(cu, p * a2a + a, cp) for a in range(a2a)])
        rows = a2a_reorder(total // cp, a2a, cp, cu)
        assert torch.equal(received[rows], thd_partition(cu, p, p2p))


def test_sbhd_row_orders_are_built_once_per_shape():
    """Rebuilding them cost a host-to-device copy and small kernels per layer and step; THD
    orders depend on the batch's cu_seqlens and are built each time."""
    assert a2a_reorder(16, 2, 4) is a2a_reorder(16, 2, 4)
    assert a2a_reorder(16, 2, 4) is not a2a_reorder(16, 4, 4)
    assert gathered_to_natural(local_seq(16, 4)) is gathered_to_natural(local_seq(16, 4))
    cu = pad_cu_seqlens([9, 30], 4).long()
    assert a2a_reorder(int(cu[-1]) // 4, 2, 4, cu) is not a2a_reorder(int(cu[-1]) // 4, 2, 4, cu)


# --------------------------------------------------------------------------------------------
# bad configuration and input


def test_unknown_comm_type_names_the_fix():
    with pytest.raises(CPConfigError, match='use "all_gather"') as info:
        check_comm_type("allgather")
    assert isinstance(info.value, ValueError) and info.value.field == "cp_comm_type"
    with pytest.raises(CPConfigError, match="must be one of"):
        q, k, v = _qkv()
        context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="bogus", causal=True)


def test_heads_not_divisible_for_a2a():
    with pytest.raises(CPConfigError, match=r"heads \(q.shape\[-2\]\)=6.*divisible by 4"):
        check_a2a_heads(6, 6, 4)
    with pytest.raises(CPConfigError, match=r"kv heads \(k.shape\[-2\]\)=2.*divisible by 4"):
        check_a2a_heads(8, 2, 4, "a2a+p2p")
    check_a2a_heads(8, 4, 4)


@pytest.mark.parametrize("cp_group", [object(), [object()], [None, None], (object(), object(), object())])
def test_a2a_p2p_needs_a_two_level_group_list(cp_group):
    q, k, v = _qkv()
    with pytest.raises(CPConfigError, match=r"two-level list \[a2a_group, p2p_group\]"):
        context_parallel_attention(q, k, v, cp_group=cp_group, cp_comm_type="a2a+p2p", causal=True)


def test_single_level_comm_types_reject_a_group_list():
    q, k, v = _qkv()
    with pytest.raises(CPConfigError, match="a2a\\+p2p"):
        context_parallel_attention(q, k, v, cp_group=[object(), object()], cp_comm_type="p2p", causal=True)


def test_bad_shapes_and_thd_offsets():
    q, k, v = _qkv()
    with pytest.raises(CPConfigError, match="kv heads"):
        k3 = torch.zeros(16, 2, 3, 8)  # 3 kv heads for 4 query heads
        context_parallel_attention(q, k3, k3, cp_group=None, cp_comm_type="p2p", causal=True)
    with pytest.raises(CPConfigError, match="k.shape/v.shape"):
        context_parallel_attention(q, k[:8], v[:8], cp_group=None, cp_comm_type="p2p", causal=True)
    with pytest.raises(CPConfigError, match="needs cu_seqlens"):
        context_parallel_attention(q[:, 0], k[:, 0], v[:, 0], cp_group=None, cp_comm_type="p2p", causal=True)
    with pytest.raises(CPConfigError, match="only for THD"):
        context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="p2p", causal=True,
                                   cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(CPConfigError, match=r"cu_seqlens\[-1\]"):
        context_parallel_attention(q[:, 0], k[:, 0], v[:, 0], cp_group=None, cp_comm_type="p2p", causal=True,
                                   cu_seqlens=torch.tensor([0, 12], dtype=torch.int32))
    with pytest.raises(CPConfigError, match="dtype"):
        context_parallel_attention(q, k.double(), v, cp_group=None, cp_comm_type="p2p", causal=True)


def test_options_read_the_environment_once_as_their_default(monkeypatch):
    from cpkit.attention import options as opts

    env = {}
    assert CPAttentionOptions.from_env(env) == CPAttentionOptions(p2p_batched=None, a2a_chunks=2, kernel=None)
    # auto: batched for a ring of 2, separate calls for longer rings (TE's choice, measured faster)
    auto = CPAttentionOptions.from_env({"CPKIT_P2P_BATCHED": "auto"})
    assert (auto.ring_batched(2), auto.ring_batched(4), auto.ring_batched(8)) == (True, False, False)
    off = CPAttentionOptions.from_env({"CPKIT_P2P_BATCHED": "0"})
    assert (off.ring_batched(2), off.ring_batched(4)) == (False, False)
    on = CPAttentionOptions.from_env({"CPKIT_P2P_BATCHED": "1"})
    assert (on.ring_batched(2), on.ring_batched(4)) == (True, True)
    with pytest.raises(ValueError, match="CPKIT_P2P_BATCHED='yes': must be auto .*, 1 .* or 0"):
        CPAttentionOptions.from_env({"CPKIT_P2P_BATCHED": "yes"})
    assert CPAttentionOptions.from_env({"CPKIT_ATTN_KERNEL": " Flash "}).kernel == "flash"
    with pytest.raises(ValueError, match="CPKIT_ATTN_KERNEL='triton'"):
        CPAttentionOptions.from_env({"CPKIT_ATTN_KERNEL": "triton"})
    # read once: a later change of the environment does not reach the cached default
    opts.default_options.cache_clear()
    monkeypatch.setenv("CPKIT_A2A_CHUNKS", "3")
    assert opts.default_options().a2a_chunks == 3
    monkeypatch.setenv("CPKIT_A2A_CHUNKS", "5")
    assert opts.default_options().a2a_chunks == 3
    opts.default_options.cache_clear()
    monkeypatch.delenv("CPKIT_A2A_CHUNKS")
    assert opts.default_options().a2a_chunks == 2


def test_options_a2a_chunk_count():
    default = CPAttentionOptions()
    assert [default.chunk_count(n) for n in (1, 2, 3, 4, 16)] == [1, 2, 1, 2, 2]  # 2, if it divides
    four = CPAttentionOptions.from_env({"CPKIT_A2A_CHUNKS": "4"})
    assert [four.chunk_count(n) for n in (1, 2, 6, 8)] == [1, 2, 3, 4]  # the largest divisor <= 4
    assert CPAttentionOptions(a2a_chunks=1).chunk_count(8) == 1
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=f"CPKIT_A2A_CHUNKS='{bad}': must be a positive integer"):
            CPAttentionOptions.from_env({"CPKIT_A2A_CHUNKS": bad})
    for field, bad in (("a2a_chunks", 0), ("a2a_chunks", True), ("p2p_batched", "yes")):
        with pytest.raises(CPConfigError, match=field):
            CPAttentionOptions(**{field: bad})
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.a2a_chunks = 4


def test_options_reach_the_module_and_the_functional_entry(monkeypatch):
    """The options an entry point is given are the ones the comm types see: a forced kernel
    outside CUDA_KERNELS cannot be built, and a non-options object is refused."""
    q, k, v = _qkv()
    with pytest.raises(CPConfigError, match="options"):
        context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="p2p", causal=True, options={"kernel": "math"})
    seen = []
    from cpkit.attention import kernels

    real = kernels.kernel_candidates
    monkeypatch.setattr(kernels, "kernel_candidates", lambda d, t, forced=None, **kw: seen.append(forced) or real(d, t, forced, **kw))
    context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="p2p", causal=True,
                               options=CPAttentionOptions(kernel="math"))
    assert seen and set(seen) == {"math"}


def test_ring_kv_packs_k_and_v_of_their_own_head_dims_in_one_flat_buffer():
    """The ring's exchange buffer (`RingKV`): k then v (then dk, dv), each read back as a view
    of its own shape, so MLA's k and v travel without padding."""
    from cpkit.attention.p2p import RingKV, kv_from_saved, kv_to_save

    k, v = torch.randn(8, 1, 2, 16), torch.randn(8, 1, 2, 8)
    kv = RingKV.pack(k, v)
    assert kv.buf.shape == (k.numel() + v.numel(),)
    assert torch.equal(kv[0], k) and torch.equal(kv[1], v)
    grads = kv.empty(with_grads=True)
    assert grads.buf.numel() == 2 * kv.buf.numel() and grads[3].shape == v.shape
    grads[2].fill_(1.0)
    grads[3].fill_(2.0)
    assert torch.equal(grads.segments(2, 4), torch.cat((torch.ones(k.numel()), torch.full((v.numel(),), 2.0))))
    tensors, layout = kv_to_save(kv)
    again = kv_from_saved(tensors, layout)
    assert torch.equal(again[1], v) and kv_from_saved(*kv_to_save((k, v))) == (k, v)


def test_merge_rejects_lists_of_different_lengths():
    from cpkit.attention.merge import merge

    out, lse = torch.zeros(4, 1, 2, 8), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="2 outputs, 1 LSEs"):
        merge([out, out], [lse])
    with pytest.raises(ValueError, match="1 outputs, 2 LSEs"):
        merge([out], [lse, lse])
    with pytest.raises(ValueError, match="0 outputs"):
        merge([], [])


def test_ring_exchange_refuses_a_receive_buffer_unlike_the_send(world1):
    """Every ring rank posts the same exchange, so a receive of another shape or dtype than the
    send is a bug in the ring: refused before anything is posted (NCCL needs matching sizes;
    gloo would take the shorter message silently)."""
    from cpkit.attention.comm import RingComm
    from cpkit.testing.fakes import fake_group

    comm = RingComm(fake_group([0, 1], rank=0))
    with pytest.raises(ValueError, match=r"send \(2, 4\) torch.float32 and receive \(3, 4\) torch.float32"):
        comm.exchange(torch.zeros(2, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"receive \(2, 4\) torch.bfloat16 must match"):
        comm.exchange(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16), reverse=True)


def test_the_kernel_tests_block_reference_agrees_with_the_cp_reference():
    """`masked_block_reference` (the gpu1 kernel tests' reference, a boolean mask written by the
    caller) against `masked_sink_reference` (the CP grids' reference) on a causal block with a
    sink and GQA, on CPU: two independent spellings of the same attention."""
    from cpkit.testing.reference import masked_block_reference, masked_sink_reference

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 1, 4, 8, generator=gen)
    k, v = (torch.randn(12, 1, 2, 8, generator=gen) for _ in range(2))
    sink = torch.randn(4, generator=gen)
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    bhsd = [x.permute(1, 2, 0, 3) for x in (q, k, v, torch.zeros_like(q))]
    out = masked_block_reference(*bhsd, sink, allowed, scale=0.3)[0]
    want = masked_sink_reference(q, k, v, causal=True, scale=0.3, sink=sink)
    torch.testing.assert_close(out.permute(2, 0, 1, 3), want, rtol=1e-5, atol=1e-5)
