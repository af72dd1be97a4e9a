"""CP attention features of the models trained with CP, against a single-rank reference, on 2 and
4 ranks (gloo; NCCL with the gpu2/gpu4 markers):

- MLA: q/k head dim 16, v head dim 8 (MCore k_channels != v_channels);
- attention sinks: softmax_type "off-by-one" (zero logits) and "learnable" (a logit per head,
  whose gradient, summed over the CP ranks, must equal the reference's);
- sliding window: causal (left, 0) and two-sided (left, right), sbhd and THD;
- odd-length THD sequences: refused with a CPConfigError naming the sequence (TE #1930's case).

Every case runs under p2p, all_gather, a2a and a2a+p2p ([2,1] and [1,2] on 2 ranks, [2,2] on 4).
One scenario (`_scenario`) serves every backend: each rank builds the same full inputs from the
case's id, computes `masked_sink_reference` (plain float32 attention with the mask, the window and
the sink column spelled out, through autograd), shards inputs and reference with
`cpkit.sharding`, runs `context_parallel_attention` and its backward and asserts output, dq, dk,
dv and the sink gradient. The attention skill's feature table is rendered from `FEATURE_MATRIX`
(`feature_table_markdown`) and checked by tests/test_attention_features.py.

Sizes and tolerances: gloo fp32, sbhd s = 48, b = 2; THD 4 sequences of 5..21 tokens padded to
2*cp (sliding window: 5 of 0..61 tokens, so that p2p skips THD blocks at cp=4); 8 heads, 4 kv
heads; rtol = atol = 1e-5 (measured max errors ~1e-6). nccl: bf16, s = 4096, b = 1, head dims
128 / 64; rtol = 2e-2 and atol = 2e-2 x the reference's largest magnitude.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from cpkit.attention import context_parallel_attention
from cpkit.errors import CPConfigError
from cpkit.sharding import pad_cu_seqlens, shard_seq, shard_thd
from cpkit.testing import device, grid_params, grid_result
from cpkit.testing.groups import new_hierarchical_groups
from cpkit.testing.reference import masked_sink_reference, reference_shard

COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")
# feature -> (the layouts the grid runs it in, under every comm type of COMMS). The attention
# skill's feature table is rendered from this and FEATURE_TABLE (feature_table_markdown).
FEATURE_MATRIX = {
    "mla": ("sbhd", "thd"),
    "sink-off-by-one": ("sbhd", "thd"),
    "sink-learnable": ("sbhd", "thd"),
    "window-causal": ("sbhd", "thd"),
    "window-two-sided": ("sbhd", "thd"),
    "odd-thd-refused": ("thd",),
}
# Transformer Engine's cells, read from TE 2.20.2 (not run by this grid), in
# transformer_engine/pytorch/attention/dot_product_attention/: context_parallel.py::
# attn_forward_func_with_cp asserts a sliding window only with a2a/all_gather and a softmax_type
# other than vanilla only with a2a (THD: cuDNN >= 9.18); utils.py::get_attention_backend filters
# the same and has no head-dim limit under CP; THD offsets are floor-divided by cp and 2*cp
# unchecked (context_parallel.py::cp_p2p_fwd_prepare_qkv, AttnFuncWithCPAndKVAllGather.forward,
# flash_attn_a2a_communicate).
_TE_EVERY = "p2p, all_gather, a2a, a2a+p2p"
_TE_SINK = "a2a; p2p, all_gather, a2a+p2p refused (softmax_type needs a2a)"
_TE_SINK_THD = "a2a with cuDNN >= 9.18; p2p, all_gather, a2a+p2p refused (softmax_type needs a2a)"
_TE_WINDOW = "all_gather, a2a; p2p, a2a+p2p refused (no sliding window)"
# feature -> (row label, cpkit's cell for every comm type, {layout: Transformer Engine's cell}).
FEATURE_TABLE = {
    "mla": ("MLA: q/k head dim != v head dim", "tested here", {"sbhd": _TE_EVERY, "thd": _TE_EVERY}),
    "sink-off-by-one": ('softmax_type "off-by-one"', "tested here", {"sbhd": _TE_SINK, "thd": _TE_SINK_THD}),
    "sink-learnable": ('softmax_type "learnable" (sink gradient)', "tested here",
                       {"sbhd": _TE_SINK, "thd": _TE_SINK_THD}),
    "window-causal": ("sliding window, causal (left, 0)", "tested here", {"sbhd": _TE_WINDOW, "thd": _TE_WINDOW}),
    "window-two-sided": ("sliding window, two-sided (left, right)", "tested here",
                         {"sbhd": _TE_WINDOW, "thd": _TE_WINDOW}),
    "odd-thd-refused": ("THD length not a multiple of 2*cp", "refused with CPConfigError",
                        {"thd": "accepted unchecked and rounded down, every comm type (TE issue 1930)"}),
}


# feature -> {layout: the CUDA kernel that runs it, with the cuDNN frontend installed (extra
# cpkit[kernels]) and without}: src/cpkit/attention/kernels.py's selection rule, tested on one GPU
# by functional/test_kernels_gpu.py.
_FE_BAND = "cuDNN frontend (band rectangles), every comm type; without it FlexAttention"
_FE_BAND_THD = ("cuDNN frontend for a2a and no CP; FlexAttention for p2p, all_gather, a2a+p2p "
                "(per-sequence offsets); without it FlexAttention")
_FE_SINK = ("folded into the cuDNN frontend's forward for a2a and no CP; elsewhere applied after "
            "the last merge; the sink gradient from the LSE")
KERNEL_TABLE = {
    "mla": dict.fromkeys(("sbhd", "thd"), "cuDNN frontend, v as it is, for p2p, a2a, a2a+p2p and no CP; "
                         "all_gather pads v (one gathered KV tensor); without it padded copies"),
    "sink-off-by-one": dict.fromkeys(("sbhd", "thd"), _FE_SINK),
    "sink-learnable": dict.fromkeys(("sbhd", "thd"), _FE_SINK),
    "window-causal": {"sbhd": _FE_BAND, "thd": _FE_BAND_THD},
    "window-two-sided": {"sbhd": _FE_BAND, "thd": _FE_BAND_THD},
    "odd-thd-refused": {"thd": "-"},
}


def feature_table_markdown() -> str:
    """The feature x layout x comm type table of the attention skill, from the grid's matrix."""
    lines = ["| feature | layout | " + " | ".join(COMMS) + " | kernel (CUDA) | TE |", "|" + "---|" * (len(COMMS) + 4)]
    for feature, layouts in FEATURE_MATRIX.items():
        label, cell, te = FEATURE_TABLE[feature]
        for fmt in layouts:
            lines.append(f"| {label} | {fmt} | " + " | ".join([cell] * len(COMMS))
                         + f" | {KERNEL_TABLE[feature][fmt]} | {te[fmt]} |")
    return "\n".join(lines)

HEADS, KV_HEADS = 8, 4
THD_LENS = [13, 5, 21, 9]
# Sliding window, THD: long sequences (padded chunks of 6 and 8 at cp=4) and an empty one, where
# p2p skips the blocks of ranks 0 and 3 against each other, and shorter ones (chunks of 4 and 3)
# that alone keep ranks 0-2 and 1-3 live under both grid windows (tests/test_band.py).
THD_WINDOW_LENS = [45, 27, 61, 0, 21]


def _comms(world_size: int):
    hier = [("a2a+p2p", 2), ("a2a+p2p", 1)] if world_size == 2 else [("a2a+p2p", 2)]
    return [("p2p", None), ("all_gather", None), ("a2a", None), *hier]


def _feature_cases(feature: str, fmt: str) -> list[dict]:
    """The variants of one feature in one layout (dict fields read by `_scenario`)."""
    base = dict(causal=True, window=None, sink=None, dv=None)
    if feature == "mla":
        return [dict(base, dv="half")]
    if feature == "sink-off-by-one":
        return [dict(base, sink="zeros")]
    if feature == "sink-learnable":  # no mask for THD: the sink alone bounds every row
        return [dict(base, sink="learnable", causal=fmt == "sbhd")]
    if feature == "window-causal":  # with a learnable sink, as gpt-oss's layers use them
        return [dict(base, window=(5, 0), sink="learnable" if fmt == "sbhd" else None)]
    if feature == "window-two-sided":
        return [dict(base, window=(4, 3), causal=False)]  # THD: within each sequence
    if feature == "odd-thd-refused":
        return [dict(base, expect_error=True)]
    raise KeyError(feature)


def _cases(backend: str, world_size: int) -> list[dict]:
    gpu = backend == "nccl"
    cases = []
    for comm, a2a in _comms(world_size):
        name = comm if a2a is None else f"{comm}[{a2a},{world_size // a2a}]"
        for feature, fmts in FEATURE_MATRIX.items():
            for fmt in fmts:
                for case in _feature_cases(feature, fmt):
                    cases.append(dict(case, id=f"{name}-{feature}-{fmt}", comm=comm, a2a=a2a, fmt=fmt,
                                      feature=feature, gpu=gpu))
    return cases


def _cp_group(case):
    if case["comm"] != "a2a+p2p":
        return dist.group.WORLD
    a2a = case["a2a"]
    # Built over WORLD in order (CP position = global rank); a rank pool hands the groups of an
    # earlier case out again (cpkit.harness.pool_groups), so asking each case costs no new groups.
    return list(new_hierarchical_groups(list(range(dist.get_world_size())), a2a))


def _inputs(case, cp: int, dev):
    gen = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    gpu = case["gpu"]
    dqk = 128 if gpu else 16
    dv = dqk // 2 if case["dv"] == "half" else dqk
    dtype = torch.bfloat16 if gpu else torch.float32
    cu = None
    if case["fmt"] == "sbhd":
        shape = (4096, 1) if gpu else (48, 2)
    else:
        lens = [1500, 333, 2100, 77] if gpu else THD_WINDOW_LENS if case["window"] else THD_LENS
        if "expect_error" in case:
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        else:
            cu = pad_cu_seqlens(lens, cp)
        shape = (int(cu[-1]),)
    q = torch.randn(*shape, HEADS, dqk, generator=gen)
    k = torch.randn(*shape, KV_HEADS, dqk, generator=gen)
    v = torch.randn(*shape, KV_HEADS, dv, generator=gen)
    dout = torch.randn(*shape, HEADS, dv, generator=gen)
    sink = None
    if case["sink"] == "zeros":
        sink = torch.zeros(HEADS)
    elif case["sink"] == "learnable":
        sink = torch.randn(HEADS, generator=gen)
    q, k, v, dout = (x.to(dtype).to(dev) for x in (q, k, v, dout))
    return q, k, v, dout, (None if sink is None else sink.to(dev)), cu


def _first_unpadded(lens, cp: int) -> str:
    """The error text that names the first sequence whose length is not a multiple of 2*cp:
    the offsets are checked in order, so that is the one reported, on every backend (the GPU
    lengths start with 1500, a multiple of 4 and 8: there it is sequence 1, of 333 tokens)."""
    i, n = next((i, n) for i, n in enumerate(lens) if n % (2 * cp))
    return rf"cu_seqlens \(sequence {i}\)={n}: .*pad it by {-n % (2 * cp)} token\(s\); .*pad_cu_seqlens"


def _scenario(case: dict) -> dict:
    dev = device()
    cp_group = _cp_group(case)
    cp, cp_rank = dist.get_world_size(), dist.get_rank()
    q, k, v, dout, sink, cu = _inputs(case, cp, dev)
    if cu is None:
        shard = lambda x: shard_seq(x, cp_rank, cp, seq_dim=0)  # noqa: E731
    else:
        shard = lambda x: shard_thd(x, cu, cp_rank, cp)  # noqa: E731
    kwargs = dict(cp_group=cp_group, cp_comm_type=case["comm"], causal=case["causal"],
                  window_size=case["window"], cu_seqlens=None if cu is None else cu.to(dev))
    if "expect_error" in case:
        # TE #1930: lengths that are not multiples of 2*cp were rounded down there. Here the
        # offsets are refused, naming the sequence and the fix (pad with pad_cu_seqlens).
        lens = torch.diff(cu).tolist()
        with pytest.raises(CPConfigError, match=_first_unpadded(lens, cp)):
            n = q.shape[0] // cp
            context_parallel_attention(q[:n], k[:n], v[:n], **kwargs)
        return {}

    scale = q.shape[-1] ** -0.5
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_sink = None if sink is None else sink.detach().float().requires_grad_(case["sink"] == "learnable")
    ref = masked_sink_reference(*leaves, causal=case["causal"], scale=scale, window=case["window"],
                                sink=ref_sink, cu=cu)
    ref.backward(dout.float())
    wants = {"out": ref.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}

    q_l, k_l, v_l = (shard(x).detach().requires_grad_() for x in (q, k, v))
    sink_l = None if sink is None else sink.detach().clone().requires_grad_(case["sink"] == "learnable")
    out = context_parallel_attention(q_l, k_l, v_l, softmax_offset=sink_l, **kwargs)
    out.backward(shard(dout))
    gots = {"out": out, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}
    errors = {}
    for name, got in gots.items():
        errors[name] = _assert_close(case, name, got, reference_shard(wants[name], cp_rank, cp, cu))
    if case["sink"] == "learnable":
        dsink = sink_l.grad.detach().clone().float()
        dist.all_reduce(dsink, group=dist.group.WORLD)  # MCore reduces parameter grads over CP
        errors["dsink"] = _assert_close(case, "dsink", dsink, ref_sink.grad)
    return errors


def _assert_close(case, name, got, want) -> float:
    if case["gpu"]:
        rtol, atol = 2e-2, 2e-2 * want.abs().max().item()
    else:
        rtol = atol = 1e-5
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    return (got.float() - want).abs().max().item()


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(_cases, scenario=_scenario, timeout=600))
def test_cp_attention_feature_matches_reference(backend, world_size, case_id):
    grid_result(_scenario, _cases, backend, world_size, case_id, timeout=600).check()
