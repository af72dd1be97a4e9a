"""ContextParallelAttention (the MCore core-attention module) at cp = 2 and 4 against a single-rank
reference: outputs and dq, dk, dv, for every comm type x sbhd/THD x causal/no-mask x MHA/GQA.

Every rank builds the same full q, k, v, dout (same seed), computes full attention on its own
(the reference), shards the inputs with `cpkit.sharding` (the function MCore's data path mirrors),
runs the module on its shard and compares it with its slice of the reference, cut by
`cpkit.testing.reference.reference_shard` (plain chunking: the reference shares no sharding code).

Tolerances (assert_close): fp32 on CPU rtol=atol=1e-5 (the same math; only the order of the
reductions and the LSE merge across ranks differ); fp32 on CUDA rtol=atol=1e-4 (fused kernels,
TF32 off); bf16 on CUDA rtol=atol=3e-2 (inputs rounded to bf16; the reference in fp32 from the
same rounded inputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.harness.grid import GridSpec, default_pools
from cpkit.testing import device, dist_params
from cpkit.testing.reference import attention_inputs, reference_shard, sdpa_reference

HEADS, HEAD_DIM, BATCH, SEQ = 8, 16, 2, 32
THD_LENS = [5, 16, 9]  # real lengths; padded to multiples of 2*cp

TOLERANCES = {
    ("cpu", torch.float32): dict(rtol=1e-5, atol=1e-5),
    ("cuda", torch.float32): dict(rtol=1e-4, atol=1e-4),
    ("cuda", torch.bfloat16): dict(rtol=3e-2, atol=3e-2),
}

def _pg_collection(world: int, comm: str):
    from cpkit.parallel.groups import build_pg_collection
    from cpkit.parallel.layout import CPLayout

    # A rank pool hands the groups of an earlier case out again (cpkit.harness.pool_groups).
    hier = [2, world // 2] if comm == "a2a+p2p" else None
    layout = CPLayout(world_size=world, cp=world, cp_comm_type=comm, hierarchical_context_parallel_sizes=hier)
    return build_pg_collection(layout)


def _config(world: int, comm: str, kv_heads: int, dtype, cp_size=None, heads=HEADS, head_dim=HEAD_DIM):
    """A one-layer TransformerConfig for core attention at CP `cp_size` (default: world) with `comm`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cp_size = world if cp_size is None else cp_size
    return TransformerConfig(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
        num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0,
        context_parallel_size=cp_size, cp_comm_type=comm if cp_size > 1 else None,
        hierarchical_context_parallel_sizes=[2, world // 2] if comm == "a2a+p2p" and cp_size > 1 else None,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
    )


def _full_reference(q, k, v, dout, causal, cu=None):
    """The single-rank reference on the full sequence, in fp32: (output, (dq, dk, dv))."""
    full = [t.float().requires_grad_() for t in (q, k, v)]
    ref = sdpa_reference(*full, causal, cu)
    return ref, torch.autograd.grad(ref, full, dout.float())


def _sharder(cu, rank: int, world: int):
    """t -> this rank's CP shard of t: THD by the padded offsets `cu`, else sbhd along dim 0."""
    from cpkit.sharding import shard_seq, shard_thd

    def shard(t):
        return shard_thd(t, cu, rank, world) if cu is not None else shard_seq(t, rank, world, seq_dim=0)

    return shard


def _thd_params(cu_padded, lens, dev):
    """PackedSeqParams as MCore hands THD core attention: global real (`lens`) and padded offsets."""
    from megatron.core.packed_seq_params import PackedSeqParams

    real = torch.tensor([0] + list(lens), device=dev).cumsum(0).to(torch.int32)
    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _inputs(kv_heads, dtype, dev, thd, cp):
    from cpkit.sharding import pad_cu_seqlens

    cu = pad_cu_seqlens(THD_LENS, cp) if thd else None
    lead = (int(cu[-1]),) if thd else (SEQ, BATCH)
    # Round to the test dtype first so the reference sees the same inputs.
    tensors = [t.to(dtype).to(dev) for t in attention_inputs(lead, HEADS, kv_heads, HEAD_DIM)]
    return tensors, (cu.to(dev) if cu is not None else None)


def _check_module_case(case):
    from megatron.core.transformer.enums import AttnMaskType

    from cpkit.attention.module import ContextParallelAttention

    dev = device()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = case["dtype"]
    tol = TOLERANCES[(dev.type, dtype)]
    thd, causal = case["fmt"] == "thd", case["causal"]
    (q, k, v, dout), cu = _inputs(case["kv_heads"], dtype, dev, thd, world)

    ref, ref_grads = _full_reference(q, k, v, dout, causal, cu)
    shard = _sharder(cu, rank, world)
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
        psp = _thd_params(cu, THD_LENS, dev)
        if not causal:  # padded THD is only exact with a causal mask: use unpadded offsets
            psp.cu_seqlens_q = psp.cu_seqlens_kv = cu
    out = attn(*local, None, attn_mask_type=mask, packed_seq_params=psp)
    want_shape = (local[0].shape[0], HEADS * HEAD_DIM) if thd else (local[0].shape[0], BATCH, HEADS * HEAD_DIM)
    assert tuple(out.shape) == want_shape, (tuple(out.shape), want_shape)
    grads = torch.autograd.grad(out, local, shard(dout).reshape(out.shape))

    expected = lambda t: reference_shard(t, rank, world, cu)  # noqa: E731  (not cpkit.sharding)
    torch.testing.assert_close(out.float(), expected(ref).reshape(out.shape).detach(), **tol,
                               msg=lambda m: f"rank {rank} output: {m}")
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got.float(), expected(want), **tol,
                                   msg=lambda m, n=name: f"rank {rank} d{n}: {m}")
    return float((out.float() - expected(ref).reshape(out.shape)).abs().max())


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


def _grid_cases(backend: str, world: int) -> list:
    return _module_cases(world, backend) + (GROUP_CASES if world == 4 else [])


def _results(backend: str, world: int) -> dict:
    """One rank-pool run serves both tests below."""
    return default_pools().result(GridSpec(_run_case, tuple(_grid_cases(backend, world)), backend, world, 600.0))


@pytest.mark.cpkit_grid(scenario=_run_case, cases_for=_grid_cases, timeout=600.0)
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
        ref = sdpa_reference(*full, True)
        ref_grads = torch.autograd.grad(ref, full, dout)
        local = [shard_seq(t, rank, world, 0).requires_grad_() for t in (q, k, v)]
        out = attn(*local, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cp_group=pgc.cp))
        assert attn.cp_group is None and attn.cp_size == 1
        grads = torch.autograd.grad(out, local, shard_seq(dout, rank, world, 0).reshape(out.shape))
        tol = TOLERANCES[(dev.type, torch.float32)]
        torch.testing.assert_close(out, reference_shard(ref, rank, world).reshape(out.shape).detach(), **tol)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, reference_shard(want, rank, world), **tol)
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


@pytest.mark.cpkit_grid(scenario=_run_case, cases_for=_grid_cases, timeout=600.0)
@pytest.mark.parametrize("backend,world_size", dist_params((4,)))
def test_module_group_binding(backend, world_size):
    results = _results(backend, world_size)
    for case in GROUP_CASES:
        assert results[case["id"]].check().values == {r: "ok" for r in range(world_size)}
