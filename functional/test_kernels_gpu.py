"""The cuDNN-frontend kernel family (`src/cpkit/attention/cudnn_fe.py`) on one GPU (marker gpu1).

Skipped with the reason where no CUDA device is visible or `nvidia-cudnn-frontend` does not
import (README "Kernels": `pip install 'cpkit[kernels]'`, or the wheel offline).

Every feature (causal, no mask, causal window, two-sided window, off-by-one and learnable sinks,
MLA head dims 192/128, GQA throughout) x layout (sbhd, THD) x dtype (bf16, fp16) against exact
float32 math of the same rounded inputs: output, LSE, dq, dk, dv and d sink. The reference is
written here from positions and sequence ids (no cpkit helper): scores, the band and sequence
mask, the sink as an extra logit, softmax through autograd. Also the ring's blocks of a window
(zigzag chunks of 4 ranks: non-square rectangles with their own diagonals), the end-to-end path
at cp=1 (`context_parallel_attention`, default kernel choice, sink gradient through autograd),
the selection rule (band blocks reach the library), the fallback without the library, and
packed batches of new lengths sharing the library's compiled graphs.

Tolerances, per dtype (one rounding of each output and gradient to the input dtype, the
library reducing in its own order): bf16 rtol = 2e-2, atol = 2e-2 x the reference's largest
magnitude; fp16 rtol = 5e-3, atol = 5e-3 x the largest magnitude; the float32 LSE atol = rtol =
2e-2 (bf16) / 5e-3 (fp16); d sink (a sum over every row of a head) rtol = 2e-2, atol = 2e-2 x
the largest |d sink|.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cpkit.attention import cudnn_fe
from cpkit.attention.band import Band, Window, band_bwd, band_fwd
from cpkit.attention.chunks import local_seq
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.attention.sink import sink_grad
from cpkit.testing.reference import masked_block_reference

pytestmark = [
    pytest.mark.gpu1,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not cudnn_fe.available(), reason="nvidia-cudnn-frontend is not importable: "
                       "pip install 'cpkit[kernels]' (README 'Kernels')"),
]

DTYPES = {"bf16": (torch.bfloat16, 2e-2), "fp16": (torch.float16, 5e-3)}
SCALE = 0.125
HEADS, KV_HEADS = 8, 2
LENGTHS = [300, 1, 724, 512, 511]  # THD: packed sequences (one of a single token)
FEATURES = {
    # name: (causal, (lo, hi) query-minus-key distances or None, sink kind, (d_qk, d_v))
    "causal": (True, None, None, (64, 64)),
    "no-mask": (False, None, None, (64, 64)),
    "causal-window": (True, (0, 99), None, (64, 64)),
    "two-sided-window": (False, (-30, 50), None, (64, 64)),
    "off-by-one-sink": (True, None, "off-by-one", (64, 64)),
    "learnable-sink-window": (True, (0, 99), "learnable", (64, 64)),
    "mla": (True, None, None, (192, 128)),
    "mla-window-sink": (True, (0, 99), "learnable", (192, 128)),
}


def _close(got, want, tol, what):
    want = want.float()
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def _positions(layout: str, tokens: int):
    """(position in its sequence, sequence id) of every token: sbhd one sequence; THD LENGTHS."""
    if layout == "sbhd":
        return torch.arange(tokens), torch.zeros(tokens, dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    return pos, seg


def _reference(q, k, v, dout, sink, allowed):
    return masked_block_reference(q, k, v, dout, sink, allowed, scale=SCALE)


def _to_bhsd(x, layout):
    return x.permute(1, 2, 0, 3) if layout == "sbhd" else x.permute(1, 0, 2).unsqueeze(0)


def _from_bhsd(x, layout):
    return x.permute(2, 0, 1, 3) if layout == "sbhd" else x[0].permute(1, 0, 2)


def _inputs(layout, dims, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(LENGTHS) if layout == "thd" else 1024
    lead = (tokens,) if layout == "thd" else (tokens, 2)
    d_qk, d_v = dims

    def rand(h, d):
        return torch.randn(*lead, h, d, generator=gen).to("cuda", dtype)
    return tokens, rand(HEADS, d_qk), rand(KV_HEADS, d_qk), rand(KV_HEADS, d_v), rand(HEADS, d_v)


def _sink(kind, dtype):
    if kind is None:
        return None
    if kind == "off-by-one":
        return torch.zeros(HEADS, device="cuda", dtype=dtype)
    return torch.linspace(-2.0, 2.0, HEADS, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_kernel_matches_exact_math(feature, layout, dtype_name):
    """One block that is the whole attention, through the library (forced, so nothing falls
    back): forward with LSE (the sink folded in), backward from that output and LSE, the sink's
    gradient from the LSE (`sink.sink_grad`)."""
    causal, distances, sink_kind, dims = FEATURES[feature]
    dtype, tol = DTYPES[dtype_name]
    tokens, q, k, v, dout = _inputs(layout, dims, dtype, seed=list(FEATURES).index(feature))
    sink = _sink(sink_kind, dtype)
    pos, seg = _positions(layout, tokens)
    diff = pos.view(-1, 1) - pos.view(1, -1)
    allowed = seg.view(-1, 1) == seg.view(1, -1)
    if causal:
        allowed &= diff >= 0
    if distances is not None:
        allowed &= (diff >= distances[0]) & (diff <= distances[1])
    want = _reference(*(_to_bhsd(x, layout) for x in (q, k, v, dout)), sink, allowed)

    kw = {}
    if layout == "thd":
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENGTHS), max_seqlen_k=max(LENGTHS))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cuDNN frontend refused.*")
        if distances is None:
            out, lse = attn_fwd(q, k, v, causal, SCALE, kernel="cudnn_fe", sink=sink, **kw)
            grads = attn_bwd(dout, q, k, v, out, lse, causal, SCALE, kernel="cudnn_fe", **kw)
        else:
            left = distances[1]
            right = None if causal else -distances[0]
            cu_global = kw.get("cu_seqlens_q")
            seq = local_seq(tokens, 1, None if cu_global is None else cu_global.long(), max(LENGTHS))
            mask = Band(Window(left, right), causal, seq, 0, "cuda").block(0)
            assert cudnn_fe.expressible(mask)
            out, lse = band_fwd(q, k, v, mask, SCALE, "cudnn_fe", sink=sink)
            grads = band_bwd(dout, q, k, v, out, lse, mask, SCALE, "cudnn_fe")
    assert out.dtype == dtype and out.shape[-1] == dims[1]
    _close(out, _from_bhsd(want[0], layout), tol, "out")
    torch.testing.assert_close(lse, want[1] if layout == "sbhd" else want[1][0], rtol=tol, atol=tol, msg=lambda m: f"lse: {m}")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:5]):
        assert got.dtype == dtype and got.shape[-1] == ref.shape[-1], name
        _close(got, _from_bhsd(ref, layout), tol, name)
    if sink is not None:
        _close(sink_grad(dout, out, lse, sink), want[5], 2e-2, "dsink")


@pytest.mark.parametrize("window", ["causal", "two-sided"])
def test_ring_blocks_of_a_window_match_exact_math(window):
    """Every (rank, src) block of a 4-rank ring over a window: rank r holds chunks r and 7-r of
    8; the block is cut into rectangles with their own diagonals. Output, LSE and gradients
    (from the block's own output and LSE) against the exact math on those positions."""
    causal, win, lo, hi = ((True, Window(700, None), 0, 700) if window == "causal"
                           else (False, Window(300, 200), -200, 300))
    cp, chunk, dtype, tol = 4, 512, torch.bfloat16, 2e-2
    gen = torch.Generator().manual_seed(5)
    seq = local_seq(2 * chunk, cp)

    def held(r):
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (r, 2 * cp - 1 - r)])
    checked = 0
    for rank in range(cp):
        band = Band(win, causal, seq, rank, "cuda")
        for src in range(cp):
            mask = band.block(src)
            if mask is None:
                continue
            q, dout = (torch.randn(2 * chunk, 1, HEADS, 64, generator=gen).to("cuda", dtype) for _ in range(2))
            k, v = (torch.randn(2 * chunk, 1, KV_HEADS, 64, generator=gen).to("cuda", dtype) for _ in range(2))
            diff = held(rank).view(-1, 1) - held(src).view(1, -1)
            allowed = (diff >= lo) & (diff <= hi)
            want = _reference(*(x.permute(1, 2, 0, 3) for x in (q, k, v, dout)), None, allowed)
            rows = allowed.any(1)  # rows that see no key of this block: zero output, LSE -inf
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*cuDNN frontend refused.*")
                out, lse = band_fwd(q, k, v, mask, SCALE, "cudnn_fe")
                grads = band_bwd(dout, q, k, v, out, lse, mask, SCALE, "cudnn_fe")
            what = f"rank {rank} src {src}"
            _close(out, want[0].permute(2, 0, 1, 3), tol, f"{what} out")
            assert torch.isneginf(lse[..., ~rows.cuda()]).all(), what
            torch.testing.assert_close(lse[..., rows.cuda()], want[1][..., rows.cuda()], rtol=tol, atol=tol)
            for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:5]):
                _close(got, ref.permute(2, 0, 1, 3), tol, f"{what} {name}")
            checked += 1
    assert checked >= cp


@pytest.mark.parametrize("window", ["causal", "two-sided"])
def test_all_gather_blocks_of_a_window_match_exact_math(window):
    """all_gather's block of every rank of 4: its chunks r and 7-r against all 8 chunks in
    natural order; a chunk against the keys before it is causal about the rectangle's
    bottom-right diagonal. Output, LSE and gradients against the exact math."""
    causal, win, lo, hi = ((True, Window(700, None), 0, 700) if window == "causal"
                           else (False, Window(300, 200), -200, 300))
    cp, chunk, dtype, tol = 4, 512, torch.bfloat16, 2e-2
    gen = torch.Generator().manual_seed(6)
    seq = local_seq(2 * chunk, cp)
    for rank in range(cp):
        mask = Band(win, causal, seq, rank, "cuda", ring=False).natural_mask(2 * cp * chunk)
        q, dout = (torch.randn(2 * chunk, 1, HEADS, 64, generator=gen).to("cuda", dtype) for _ in range(2))
        k, v = (torch.randn(2 * cp * chunk, 1, KV_HEADS, 64, generator=gen).to("cuda", dtype) for _ in range(2))
        qpos = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])
        diff = qpos.view(-1, 1) - torch.arange(2 * cp * chunk).view(1, -1)
        want = _reference(*(x.permute(1, 2, 0, 3) for x in (q, k, v, dout)), None, (diff >= lo) & (diff <= hi))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*cuDNN frontend refused.*")
            out, lse = band_fwd(q, k, v, mask, SCALE, "cudnn_fe")
            grads = band_bwd(dout, q, k, v, out, lse, mask, SCALE, "cudnn_fe")
        _close(out, want[0].permute(2, 0, 1, 3), tol, f"rank {rank} out")
        torch.testing.assert_close(lse, want[1], rtol=tol, atol=tol)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:5]):
            _close(got, ref.permute(2, 0, 1, 3), tol, f"rank {rank} {name}")


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_cp1_entry_point_takes_the_library_by_default(layout, monkeypatch):
    """`context_parallel_attention` at cp=1 with a window, a learnable sink and MLA head dims,
    kernel chosen by cpkit: the band block reaches the library (the sink folded into its
    forward), nothing is padded, and output and gradients (the sink's included) are the exact
    math's."""
    from cpkit.attention import context_parallel_attention

    calls = []
    real = cudnn_fe._ops

    class Spy:
        def __getattr__(self, name):
            op = getattr(real(), name)

            def call(*args, **kwargs):
                v = args[2] if name == "sdpa_fwd" else args[3]  # sdpa_bwd(dout, q, k, v, ...)
                calls.append((name, v.shape[-1], kwargs.get("sinks") is not None))
                return op(*args, **kwargs)
            return call
    monkeypatch.setattr(cudnn_fe, "_ops", lambda: Spy())
    dtype, tol = torch.bfloat16, 2e-2
    tokens, q, k, v, dout = _inputs(layout, (192, 128), dtype, seed=3)
    sink = _sink("learnable", torch.float32).requires_grad_()
    leaves = [x.requires_grad_() for x in (q, k, v)]
    kw = {}
    if layout == "thd":
        kw = dict(cu_seqlens=torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32,
                                          device="cuda"), max_seqlen=max(LENGTHS))
    out = context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="p2p", causal=True, softmax_scale=SCALE,
                                     window_size=(99, 0), softmax_offset=sink, **kw)
    out.backward(dout)
    assert ("sdpa_fwd", 128, True) in calls and ("sdpa_bwd", 128, False) in calls, calls
    pos, seg = _positions(layout, tokens)
    diff = pos.view(-1, 1) - pos.view(1, -1)
    allowed = (seg.view(-1, 1) == seg.view(1, -1)) & (diff >= 0) & (diff <= 99)
    want = _reference(*(_to_bhsd(x, layout) for x in (q, k, v, dout)), sink, allowed)
    _close(out, _from_bhsd(want[0], layout), tol, "out")
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, want[2:5]):
        _close(leaf.grad, _from_bhsd(ref, layout), tol, name)
    _close(sink.grad, want[5], 2e-2, "dsink")


def test_without_the_library_one_warning_and_flexattention(monkeypatch):
    """With the library reported missing, a window block runs on FlexAttention (the result is
    the exact math's) after one warning for the process."""
    monkeypatch.setattr(cudnn_fe, "available", lambda: False)
    monkeypatch.setattr(cudnn_fe, "_WARNED_MISSING", [])
    tokens, q, k, v, dout = _inputs("sbhd", (64, 64), torch.bfloat16, seed=9)
    mask = Band(Window(99, None), True, local_seq(tokens, 1), 0, "cuda").block(0)
    with pytest.warns(UserWarning, match="nvidia-cudnn-frontend is not importable") as record:
        out, lse = band_fwd(q, k, v, mask, SCALE)
        band_bwd(dout, q, k, v, out, lse, mask, SCALE)
    assert sum("cudnn-frontend" in str(w.message) for w in record) == 1
    pos = torch.arange(tokens)
    diff = pos.view(-1, 1) - pos.view(1, -1)
    want = _reference(*(x.permute(1, 2, 0, 3) for x in (q, k, v, dout)), None, (diff >= 0) & (diff <= 99))
    _close(out, want[0].permute(2, 0, 1, 3), 2e-2, "out")


def test_packings_of_new_lengths_share_a_few_graphs():
    """The library builds (and caches) one graph per shape it is told, the longest length
    included; cpkit tells it a power-of-two bound, so ten THD packings of four sequences of new
    lengths build one forward graph per bound, not per packing. Its backward graph also keys on
    the token totals (rounded to 64 by the library): one per (total, bound). Each result is the
    exact math's."""
    import cudnn.sdpa.fwd.torch_op as op

    gen = torch.Generator().manual_seed(4)
    before = len(op._graph_cache)
    bounds, backward_keys = set(), set()
    for _ in range(10):
        lengths = torch.randint(200, 1000, (4,), generator=gen).tolist()
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        tokens = sum(lengths)
        q, dout = (torch.randn(tokens, HEADS, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(tokens, KV_HEADS, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        out, lse = attn_fwd(q, k, v, True, SCALE, kernel="cudnn_fe", **kw)
        grads = attn_bwd(dout, q, k, v, out, lse, True, SCALE, kernel="cudnn_fe", **kw)
        bounds.add(1 << (max(lengths) - 1).bit_length())
        backward_keys.add((-(-tokens // 64), 1 << (max(lengths) - 1).bit_length()))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    allowed = (seg.view(-1, 1) == seg.view(1, -1)) & (pos.view(-1, 1) >= pos.view(1, -1))
    want = _reference(*(_to_bhsd(x, "thd") for x in (q, k, v, dout)), None, allowed)
    _close(out, _from_bhsd(want[0], "thd"), 2e-2, "out")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:5]):
        _close(got, _from_bhsd(ref, "thd"), 2e-2, name)
    assert len(op._graph_cache) - before <= len(bounds) + len(backward_keys), (len(op._graph_cache) - before, bounds)
