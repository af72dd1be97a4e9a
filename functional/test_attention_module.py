"""ContextParallelAttention (the MCore core-attention module) at cp = 2 and 4 against a single-rank
reference: outputs and dq, dk, dv, for every comm type x sbhd/THD x causal/no-mask x MHA/GQA.

Every rank builds the same full q, k, v, dout (same seed), computes full attention on its own
(the reference), shards everything with `cpkit.sharding` (the function MCore's data path mirrors),
runs the module on its shard and compares its shard of the result.

Tolerances (assert_close): fp32 on CPU rtol=atol=1e-5 (the same math; only the order of the
reductions and the LSE merge across ranks differ); fp32 on CUDA rtol=atol=1e-4 (fused kernels,
TF32 off); bf16 on CUDA rtol=atol=3e-2 (inputs rounded to bf16; the reference in fp32 from the
same rounded inputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpkit.testing import device, dist_params, run_cases

HEADS, HEAD_DIM, BATCH, SEQ = 8, 16, 2, 32
THD_LENS = [5, 16, 9]  # real lengths; padded to multiples of 2*cp

TOLERANCES = {
    ("cpu", torch.float32): dict(rtol=1e-5, atol=1e-5),
    ("cuda", torch.float32): dict(rtol=1e-4, atol=1e-4),
    ("cuda", torch.bfloat16): dict(rtol=3e-2, atol=3e-2),
}

_PG_CACHE: dict = {}  # per rank process: one collection per (world, comm type), built once


def _pg_collection(world: int, comm: str):
    from cpkit.groups import build_pg_collection
    from cpkit.layout import CPLayout

    key = (world, comm)
    if key not in _PG_CACHE:
        hier = [2, world // 2] if comm == "a2a+p2p" else None
        layout = CPLayout(world_size=world, cp=world, cp_comm_type=comm,
                          hierarchical_context_parallel_sizes=hier)
        _PG_CACHE[key] = build_pg_collection(layout)
    return _PG_CACHE[key]


def _config(world: int, comm: str, kv_heads: int, dtype, cp_size=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cp_size = world if cp_size is None else cp_size
    return TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
        num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0,
        context_parallel_size=cp_size, cp_comm_type=comm if cp_size > 1 else None,
        hierarchical_context_parallel_sizes=[2, world // 2] if comm == "a2a+p2p" and cp_size > 1 else None,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
    )


def _reference(q, k, v, causal, cu=None):
    """Full attention in fp32, [s, b, h, d] (or THD [t, h, d] per sequence of `cu`)."""
    rep = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)
    if cu is None:  # sbhd -> [b, h, s, d]
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal)
        return out.permute(2, 0, 1, 3)
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    return torch.cat(outs)


def _inputs(kv_heads, dtype, dev, thd, cp):
    from cpkit.sharding import pad_cu_seqlens

    gen = torch.Generator().manual_seed(1234)
    cu = pad_cu_seqlens(THD_LENS, cp) if thd else None
    lead = (int(cu[-1]),) if thd else (SEQ, BATCH)
    q = torch.randn(*lead, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(*lead, kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(*lead, kv_heads, HEAD_DIM, generator=gen)
    dout = torch.randn(*lead, HEADS, HEAD_DIM, generator=gen)
    # Round to the test dtype first so the reference sees the same inputs.
    return [t.to(dtype).to(dev) for t in (q, k, v, dout)], (cu.to(dev) if cu is not None else None)


def _check_module_case(case):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from cpkit.attention.module import ContextParallelAttention
    from cpkit.sharding import shard_seq, shard_thd

    dev = device()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = case["dtype"]
    tol = TOLERANCES[(dev.type, dtype)]
    thd, causal = case["fmt"] == "thd", case["causal"]
    (q, k, v, dout), cu = _inputs(case["kv_heads"], dtype, dev, thd, world)

    # Single-rank reference on the full sequence, fp32.
    full = [t.float().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, causal, cu)
    ref_grads = torch.autograd.grad(ref, full, dout.float())

    def shard(t):
        return shard_thd(t, cu, rank, world) if thd else shard_seq(t, rank, world, seq_dim=0)

    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    pgc = _pg_collection(world, case["comm"])
    attn = ContextParallelAttention(
        _config(world, case["comm"], case["kv_heads"], dtype), 1, mask, "self",
        cp_comm_type=case["comm"], pg_collection=pgc,
    )
    assert attn.cp_size == world
    local = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    psp = None
    if thd:
        # MCore hands THD core attention the global cu_seqlens (real and padded).
        real = torch.tensor([0] + THD_LENS, device=dev).cumsum(0).to(torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                              cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                              max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
                              max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
        if not causal:  # padded THD is only exact with a causal mask: use unpadded offsets
            psp.cu_seqlens_q = psp.cu_seqlens_kv = cu
    out = attn(*local, None, attn_mask_type=mask, packed_seq_params=psp)
    want_shape = (local[0].shape[0], HEADS * HEAD_DIM) if thd else (local[0].shape[0], BATCH, HEADS * HEAD_DIM)
    assert tuple(out.shape) == want_shape, (tuple(out.shape), want_shape)
    grads = torch.autograd.grad(out, local, shard(dout).reshape(out.shape))

    torch.testing.assert_close(out.float(), shard(ref).reshape(out.shape).detach(), **tol,
                               msg=lambda m: f"rank {rank} output: {m}")
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got.float(), shard(want), **tol,
                                   msg=lambda m, n=name: f"rank {rank} d{n}: {m}")
    return float((out.float() - shard(ref).reshape(out.shape)).abs().max())


def _module_cases(world: int, backend: str) -> list[dict]:
    dtypes = [torch.float32] + ([torch.bfloat16] if backend == "nccl" else [])
    comms = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if world == 4 else [])
    cases = []
    for comm in comms:
        for fmt in ("sbhd", "thd"):
            for causal in (True, False):
                for kv_heads in (HEADS, HEADS // 2):
                    for dtype in dtypes:
                        cases.append(dict(kind="module",
                            id=f"{comm}-{fmt}-{'causal' if causal else 'nomask'}-"
                               f"{'mha' if kv_heads == HEADS else 'gqa'}-{str(dtype)[6:]}",
                            comm=comm, fmt=fmt, causal=causal, kv_heads=kv_heads, dtype=dtype))
    return cases


def _run_case(case):
    return _check_group_case(case) if case["kind"] == "group" else _check_module_case(case)


_RESULTS: dict = {}  # (backend, world) -> run_cases result: one launch serves both tests below


def _results(backend: str, world: int) -> dict:
    if (backend, world) not in _RESULTS:
        cases = _module_cases(world, backend) + (GROUP_CASES if world == 4 else [])
        _RESULTS[(backend, world)] = run_cases(_run_case, cases, world, backend=backend, timeout=600)
    return _RESULTS[(backend, world)]


@pytest.mark.parametrize("backend,world_size", dist_params((2, 4)))
def test_module_matches_single_rank_attention(backend, world_size):
    results = _results(backend, world_size)
    module_ids = [c["id"] for c in _module_cases(world_size, backend)]
    for cid in module_ids:
        results[cid].check()  # raises with every failing rank's traceback
    # Every case really compared something: the max error is a finite number on every rank.
    assert all(len(results[cid].values) == world_size for cid in module_ids)


# --------------------------------------------------------------- groups: override and gates


def _check_group_case(case):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from cpkit.attention.module import ContextParallelAttention
    from cpkit.attention.te import bind_te_attention_groups
    from cpkit.compat import new_pg_collection
    from cpkit.errors import CPConfigError
    from cpkit.sharding import shard_seq

    dev, world, rank = device(), dist.get_world_size(), dist.get_rank()
    if case["id"] == "micro-batch-cp-group":
        # A module built without CP runs one forward over packed_seq_params.cp_group, restores
        # its binding, and the backward (after the restore) still talks over that group.
        pgc = _pg_collection(world, "p2p")
        attn = ContextParallelAttention(_config(world, "p2p", HEADS, torch.float32, cp_size=1), 1,
                                        AttnMaskType.causal, "self", pg_collection=pgc)
        assert attn.cp_group is None
        (q, k, v, dout), _ = _inputs(HEADS, torch.float32, dev, False, world)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _reference(*full, True)
        ref_grads = torch.autograd.grad(ref, full, dout)
        local = [shard_seq(t, rank, world, 0).requires_grad_() for t in (q, k, v)]
        out = attn(*local, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cp_group=pgc.cp))
        assert attn.cp_group is None and attn.cp_size == 1
        grads = torch.autograd.grad(out, local, shard_seq(dout, rank, world, 0).reshape(out.shape))
        tol = TOLERANCES[(dev.type, torch.float32)]
        torch.testing.assert_close(out, shard_seq(ref, rank, world, 0).reshape(out.shape).detach(), **tol)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, shard_seq(want, rank, world, 0), **tol)
        return "ok"
    if case["id"] == "a2a+p2p-without-hcp-fails-at-build":
        pgc = _pg_collection(world, "p2p")  # no hcp: MCore's decentralized path leaves it unset
        with pytest.raises(CPConfigError) as err:
            ContextParallelAttention(_config(world, "a2a+p2p", HEADS, torch.float32), 1,
                                     AttnMaskType.causal, "self", cp_comm_type="a2a+p2p",
                                     pg_collection=pgc)
        assert err.value.field == "pg_collection.hcp"
        return "ok"
    if case["id"] == "bind-te-groups-hcp":
        pgc = _pg_collection(world, "a2a+p2p")

        class FakeTE(torch.nn.Module):
            def __init__(self, comm):
                super().__init__()
                self.cp_comm_type, self.bound = comm, None

            def set_context_parallel_group(self, group, ranks, stream, comm="p2p"):
                self.bound = (group, ranks, comm)

        model = torch.nn.ModuleList([FakeTE("a2a+p2p"), FakeTE("p2p")])
        assert bind_te_attention_groups(model, pgc, attention_type=FakeTE) == 2
        assert model[0].bound == (list(pgc.hcp), list(range(world)), "a2a+p2p")
        assert model[1].bound == (pgc.cp, list(range(world)), "p2p")
        with pytest.raises(CPConfigError):  # a2a+p2p without hcp: refused, not silently local
            bind_te_attention_groups(model, new_pg_collection(cp=pgc.cp), attention_type=FakeTE)
        return "ok"
    raise AssertionError(f"unknown case {case}")


GROUP_CASES = [{"kind": "group", "id": "micro-batch-cp-group"},
               {"kind": "group", "id": "a2a+p2p-without-hcp-fails-at-build"},
               {"kind": "group", "id": "bind-te-groups-hcp"}]


@pytest.mark.parametrize("backend,world_size", dist_params((4,)))
def test_module_group_binding(backend, world_size):
    results = _results(backend, world_size)
    for case in GROUP_CASES:
        assert results[case["id"]].check().values == {r: "ok" for r in range(world_size)}
