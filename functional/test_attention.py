"""CP attention against single-rank full attention, on 2 and 4 ranks (gloo and NCCL).

One scenario (`cpkit.testing.scenarios.attention.attention_case`) serves every backend: each rank builds the same full q, k, v and
output gradient from the case's seed, computes a full-sequence reference on its own, shards
everything with `cpkit.sharding` (the layout the CP attention expects), runs
`context_parallel_attention` and its backward, and asserts output, dq, dk, dv against the
sharded reference with `torch.testing.assert_close`.

Grid: every comm type (a2a+p2p as [2,1] and [1,2] on 2 ranks, [2,2] on 4) x causal/no mask x
sbhd/THD x GQA/MHA, in fp32; plus every comm type in bf16 and fp16 (causal, GQA) on gloo; plus
a2a on 4 ranks rejecting 6 heads and 2 kv heads with a CPConfigError on every rank; plus the
forced ring modes and a2a head chunks that differ from the defaults (`_variant_cases`). One
launch per backend and world size runs all of it (NCCL start-up is paid once per grid).

Sizes and tolerances (documented, per dtype):
- gloo: s = 64 (sbhd, b = 2) and 5 packed sequences of 3..40 tokens padded to 2*cp (THD),
  8 heads (4 kv heads for GQA), head dim 16. The reference is plain float32 PyTorch
  (`reference_attention`: einsum + softmax through autograd), independent of the kernels.
  fp32: atol = rtol = 2e-5 (measured max errors are ~1e-6; the CP result merges partial
  softmaxes, so it is not bit-identical). bf16/fp16 inputs are compared with the fp32
  reference of the same (rounded) inputs: rtol = 2e-2 (bf16) / 5e-3 (fp16), atol = the same
  factor times the reference's largest magnitude (rounding of each block's output and grads
  to the input dtype).
- nccl: bf16, sbhd s = 8K (b = 2) and, causal GQA only, 32K (b = 1), THD 4 sequences totalling ~24K, 8 heads,
  head dim 64. Reference: float32 memory-efficient SDPA on one GPU (no O(s^2) memory) of the
  same rounded inputs, KV heads expanded. Tolerance as bf16 above.
"""

from __future__ import annotations

import torch
import pytest

from cpkit.attention.options import CPAttentionOptions
from cpkit.harness.grid import GridSpec, default_pools
from cpkit.testing import dist_params
from cpkit.testing.scenarios.attention import HEADS, attention_case as _scenario, cases as _cases




def _ring_size(case, world_size: int) -> int:
    return world_size if case["comm"] == "p2p" else world_size // case["a2a"]


def _local_kv_heads(case, world_size: int) -> int:
    kv = case.get("kv_heads", HEADS // 2 if case["gqa"] else HEADS)
    return kv // (world_size if case["comm"] == "a2a" else case["a2a"])


def _variant_cases(backend: str, world_size: int) -> list[dict]:
    """The speed settings forced through CPAttentionOptions, as cases of the same launch: the
    ring as separate isend/irecv calls or one batched call per step (p2p, a2a+p2p), and the
    all-to-alls unpipelined or in up to 4 head chunks (a2a, a2a+p2p). Only settings that change
    what runs: the forced ring mode that is not the default for the ring's size (a ring of 1
    exchanges nothing), and a chunk count that, lowered to what the local KV heads divide,
    differs from the default's. The ring: GQA, causal (blocks skipped) and no mask, sbhd and
    THD; the chunks: GQA and MHA (different local KV heads), sbhd and THD, causal only (the mask
    does not split heads). Not the 32K sbhd cases (neither depends on the length)."""
    default = CPAttentionOptions()
    out = []
    for case in _cases(backend, world_size):
        if "rejects" in case["id"] or case["dtype"] not in ("fp32", "bf16") or case["s"] > 8192:
            continue
        if case["comm"] in ("p2p", "a2a+p2p") and case["gqa"] and _ring_size(case, world_size) > 1:
            batched = not default.ring_batched(_ring_size(case, world_size))
            out.append(dict(case, id=f"{case['id']}-ring-{'batched' if batched else 'separate'}",
                            options=dict(p2p_batched=batched)))
        if case["comm"] in ("a2a", "a2a+p2p") and case["causal"]:  # the mask does not split heads
            local = _local_kv_heads(case, world_size)
            for chunks in (1, 4):
                if CPAttentionOptions(a2a_chunks=chunks).chunk_count(local) != default.chunk_count(local):
                    out.append(dict(case, id=f"{case['id']}-chunks{chunks}", options=dict(a2a_chunks=chunks)))
    return out


def _all_cases(backend: str, world_size: int):
    return _cases(backend, world_size) + _variant_cases(backend, world_size)


def _timeout(backend: str) -> float:
    return 1200.0 if backend == "nccl" else 300.0


def _grid(backend: str, world_size: int):
    """The whole grid's results (one rank pool run; a pytest run on GPUs starts it in the background)."""
    spec = GridSpec(_scenario, tuple(_all_cases(backend, world_size)), backend, world_size, _timeout(backend))
    return default_pools().result(spec)


def _params(cases_for, keep=lambda case: True):
    params = []
    for p in dist_params((2, 4)):
        backend, world_size = p.values
        for case in cases_for(backend, world_size):
            if keep(case):
                grid = pytest.mark.cpkit_grid(scenario=_scenario, cases_for=_all_cases, timeout=_timeout(backend))
                params.append(pytest.param(backend, world_size, case["id"], marks=[*p.marks, grid],
                                           id=f"{p.id}-{case['id']}"))
    return params


@pytest.mark.parametrize("backend,world_size,case_id", _params(_cases))
def test_cp_attention_matches_full_attention(backend, world_size, case_id):
    _grid(backend, world_size)[case_id].check()


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_grid_has_ring_mode_and_head_chunk_variants(world_size):
    """The variant tests below are parametrized from `_variant_cases`; a change that empties it
    would leave them with no cases at all, silently."""
    for backend in ("gloo", "nccl"):
        options = [c["options"] for c in _variant_cases(backend, world_size)]
        assert sum("p2p_batched" in o for o in options) >= 2, (backend, world_size, options)
        assert sum("a2a_chunks" in o for o in options) >= 2, (backend, world_size, options)


@pytest.mark.parametrize("backend,world_size,case_id", _params(_variant_cases, lambda c: "p2p_batched" in c["options"]))
def test_forced_ring_mode_matches_full_attention(backend, world_size, case_id):
    """The ring forced to separate isend/irecv calls (even ranks sending first) or to one
    batched call per step, where that is not the default for the ring's size (auto: batched
    for a ring of 2, separate for more), against the same single-rank reference."""
    _grid(backend, world_size)[case_id].check()


@pytest.mark.parametrize("backend,world_size,case_id", _params(_variant_cases, lambda c: "a2a_chunks" in c["options"]))
def test_a2a_head_chunks_match_full_attention(backend, world_size, case_id):
    """a2a and a2a+p2p with the all-to-alls unpipelined (1 chunk) or cut into up to 4 head
    chunks (lowered to what the local KV heads divide), where that differs from the default
    (2), against the same single-rank reference."""
    _grid(backend, world_size)[case_id].check()


# ---------------------------------------------------------------------------------------------
# Each CUDA kernel on its own (one GPU): forced through the kernel argument, so none falls back.
# bf16 vs the float32 math kernel of the same inputs; tolerance as bf16 above.


@pytest.mark.gpu1
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_cuda_kernel_matches_math(kernel, causal, kv_heads):
    from cpkit.attention.kernels import attn_bwd, attn_fwd

    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(1024, 2, 8, 64, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1024, 2, kv_heads, 64, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    scale = 0.125
    want_out, want_lse = attn_fwd(*(x.float() for x in (q, k, v)), causal, scale, kernel="math")
    want = attn_bwd(*(x.float() for x in (dout, q, k, v)), want_out, want_lse, causal, scale, kernel="math")
    out, lse = attn_fwd(q, k, v, causal, scale, kernel=kernel)
    grads = attn_bwd(dout, q, k, v, out, lse, causal, scale, kernel=kernel)
    torch.testing.assert_close(lse, want_lse, rtol=2e-2, atol=2e-2)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want)):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape, name
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item(),
                                   msg=lambda m, n=name: f"{kernel} {n}: {m}")


@pytest.mark.gpu1
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_varlen_kernel_matches_dense_per_sequence(causal):
    from cpkit.attention.kernels import attn_bwd, attn_fwd

    dev = torch.device("cuda", 0)
    cu = torch.tensor([0, 300, 300, 1324, 2048], dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(8)
    q, dout = (torch.randn(2048, 8, 64, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2048, 2, 64, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024)
    out, lse = attn_fwd(q, k, v, causal, 0.125, **kw)
    grads = attn_bwd(dout, q, k, v, out, lse, causal, 0.125, **kw)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        sl = [x[a:b].unsqueeze(1).float() for x in (dout, q, k, v)]
        o, l = attn_fwd(*sl[1:], causal, 0.125)
        ref = attn_bwd(*sl, o, l, causal, 0.125)
        for got, want in zip((out[a:b], *(g[a:b] for g in grads)), (o, *ref)):
            torch.testing.assert_close(got.float(), want.squeeze(1), rtol=2e-2,
                                       atol=2e-2 * want.abs().max().item())
