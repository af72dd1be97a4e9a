"""The cuDNN-frontend kernel family (`src/cpkit/attention/cudnn_fe.py`) on CPU, without the library.

CPU CI has neither a GPU nor `nvidia-cudnn-frontend`, so these tests check cpkit's side: the
band as cuDNN rectangles (host arithmetic, against the band's own position rule), the selection
rule and the fallbacks. A stand-in for `torch.ops.cudnn.sdpa_fwd/sdpa_bwd` written here from
the library's documented contract (top-left band: key j visible from query i when
j > i - window_left and j <= i + window_right; sink logits in the denominator; THD backward
reading a padded [n, h, max_q, 1] LSE) lets the wrappers run end to end against the exact
dense-mask math. The real library is tested on one GPU by functional/test_kernels_gpu.py.
fp32 tolerance rtol = atol = 1e-5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from cpkit.attention import cudnn_fe, kernels
from cpkit.attention.band import Band, Window, _math_band_bwd, _math_band_fwd, band_bwd, band_fwd
from cpkit.attention.chunks import local_seq
from cpkit.attention.kernels import attn_bwd, attn_fwd, kernel_candidates
from cpkit.attention.sink import apply_sink

FP32 = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# a stand-in for the library's ops, from its documented contract


def _visible(s_q, s_k, causal, left, right, bottom_right=False):
    i = torch.arange(s_q).view(-1, 1)
    j = torch.arange(s_k).view(1, -1)
    if bottom_right:  # the diagonal through the last query and the last key
        i = i + (s_k - s_q)
    ok = torch.ones(s_q, s_k, dtype=torch.bool)
    rb = right if right >= 0 else (0 if causal else None)
    if rb is not None:
        ok &= j <= i + rb
    if left >= 0:
        ok &= j > i - left
    return ok


def _dense_fwd(q, k, v, scale, mask, sinks):  # [b, h, s, d]
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    scores = (q.float() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    full = scores if sinks is None else torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], -1)
    lse = torch.logsumexp(full, -1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (p @ vv).to(q.dtype), lse


def _dense_bwd(do, q, k, v, o, lse, scale, mask):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    scores = (q.float() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    dv = p.transpose(-1, -2) @ do.float()
    ds = p * (do.float() @ vv.transpose(-1, -2) - (do.float() * o.float()).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale

    def fold(x):  # expanded kv heads -> kv heads
        return x.unflatten(1, (k.shape[1], g)).sum(2)
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


class FakeOps:
    """torch.ops.cudnn.sdpa_fwd / sdpa_bwd as the library documents them (fp32 math)."""

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def sdpa_fwd(self, q, k, v, scale, is_causal=False, window_left=-1, window_right=-1, sinks=None,
                 cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0, return_lse=True,
                 causal_bottom_right=False):
        self.calls.append(("fwd", window_left, window_right, sinks is not None))
        if self.refuse:
            raise ValueError("not supported")
        sk = None if sinks is None else sinks.view(1, -1, 1, 1)
        if cu_seqlens_q is None:
            mask = _visible(q.shape[2], k.shape[2], is_causal, window_left, window_right, causal_bottom_right)
            o, lse = _dense_fwd(q, k, v, scale, mask, sk)
            return o, lse.unsqueeze(-1)
        o = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        stats = torch.zeros(q.shape[0], q.shape[1], 1)
        for (a, b), (c, d) in zip(_pairs(cu_seqlens_q), _pairs(cu_seqlens_kv)):
            mask = _visible(b - a, d - c, is_causal, window_left, window_right)
            oo, ll = _dense_fwd(*(x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d])), scale, mask, sk)
            o[a:b], stats[a:b, :, 0] = oo[0].transpose(0, 1), ll[0].t()
        return o, stats

    def sdpa_bwd(self, do, q, k, v, o, lse, scale, is_causal=False, window_left=-1, window_right=-1,
                 cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0, causal_bottom_right=False):
        self.calls.append(("bwd", window_left, window_right, False))
        if self.refuse:
            raise ValueError("not supported")
        if cu_seqlens_q is None:
            mask = _visible(q.shape[2], k.shape[2], is_causal, window_left, window_right, causal_bottom_right)
            return _dense_bwd(do, q, k, v, o, lse.reshape(o.shape[:-1]), scale, mask)
        assert lse.shape == (cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q, 1)
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for n, ((a, b), (c, d)) in enumerate(zip(_pairs(cu_seqlens_q), _pairs(cu_seqlens_kv))):
            mask = _visible(b - a, d - c, is_causal, window_left, window_right)
            t = [x.transpose(0, 1)[None] for x in (do[a:b], q[a:b], k[c:d], v[c:d], o[a:b])]
            g = _dense_bwd(*t, lse[n:n + 1, :, :b - a, 0], scale, mask)
            for acc, x, (lo, hi) in zip(grads, g, ((a, b), (c, d), (c, d))):
                acc[lo:hi] = x[0].transpose(0, 1)
        return tuple(grads)


def _pairs(cu):
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


@pytest.fixture
def fake(monkeypatch):
    """The cuDNN frontend 'installed' on CPU for fp32 tensors, through FakeOps."""
    ops = FakeOps()
    monkeypatch.setattr(cudnn_fe, "available", lambda: True)
    monkeypatch.setattr(cudnn_fe, "_on_device", lambda q: True)
    monkeypatch.setattr(cudnn_fe, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(cudnn_fe, "_ops", lambda: ops)
    monkeypatch.setattr(cudnn_fe, "_FAILED", set())
    monkeypatch.setattr(cudnn_fe, "STAIR_MIN", 2)  # the backward's staircase at these small windows too
    return ops


# ---------------------------------------------------------------------------------------------
# the band as rectangles


@settings(max_examples=150, deadline=None)
@given(
    q_runs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=3),
    k_runs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=3),
    lo=st.one_of(st.none(), st.integers(-12, 12)),
    width=st.one_of(st.none(), st.integers(0, 20)),
)
def test_rectangles_cover_exactly_the_band(q_runs, k_runs, lo, width):
    """The rectangles' cuDNN bands, put together, are the band's mask: query at global position
    i sees key at j iff lo <= i - j <= hi (None: unbounded), for any runs of positions."""
    hi = None if width is None else (width if lo is None else lo + width)

    def runs(spec):
        out, local = [], 0
        for start, length in spec:
            out.append((start, local, length))
            local += length
        return out, torch.cat([torch.arange(s, s + n) for s, n in spec])

    (qr, qpos), (kr, kpos) = runs(q_runs), runs(k_runs)
    diff = qpos.view(-1, 1) - kpos.view(1, -1)
    want = torch.ones_like(diff, dtype=torch.bool)
    if lo is not None:
        want &= diff >= lo
    if hi is not None:
        want &= diff <= hi
    rects = cudnn_fe.band_rectangles(qr, kr, lo, hi)
    assert torch.equal(_union(rects, want.shape), want)


def _union(rects, shape):
    got = torch.zeros(shape, dtype=torch.bool)
    for r in rects:
        assert r.nq > 0 and r.nk > 0
        rect = _visible(r.nq, r.nk, False, r.left, r.right, r.bottom_right)
        assert rect.any(1).all(), "every query of a rectangle sees a key (no empty rows for the kernel)"
        assert not (got[r.q0:r.q0 + r.nq, r.k0:r.k0 + r.nk] & rect).any(), "rectangles overlap"
        got[r.q0:r.q0 + r.nq, r.k0:r.k0 + r.nk] |= rect
    return got


@settings(max_examples=200, deadline=None)
@given(nq=st.integers(1, 60), nk=st.integers(1, 60), left=st.integers(-1, 70), right=st.integers(1, 70),
       offset=st.integers(0, 5))
def test_the_backwards_staircase_has_the_same_pairs(nq, nk, left, right, offset):
    """`staircase` splits a top-left band reaching right of its diagonal into forms cuDNN's
    backward skips tiles in (right 0, or 1 / -1 on shifted keys) without changing one pair."""
    left = -1 if left == 0 else left
    r = cudnn_fe.Rect(offset, nq, offset, nk, left, right)
    want = torch.zeros(nq + offset, nk + offset, dtype=torch.bool)
    want[offset:, offset:] = _visible(nq, nk, False, left, right)
    assume(want.any(1)[offset:].all())  # a rectangle with empty rows is never made (band_rectangles trims them)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cudnn_fe, "STAIR_MIN", 1)
        steps = cudnn_fe.staircase([r])
    assert all(s.right <= 0 and not s.bottom_right for s in steps) or steps == [r]
    assert torch.equal(_union(steps, want.shape), want)


# ---------------------------------------------------------------------------------------------
# band blocks end to end through the stand-in


def _qkv(tokens, thd, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lead = (tokens,) if thd else (tokens, 2)
    return (torch.randn(*lead, 4, 16, generator=gen), torch.randn(*lead, 2, 16, generator=gen),
            torch.randn(*lead, 2, dv, generator=gen))


WINDOWS = {"causal-window": (Window(5, None), True), "two-sided": (Window(3, 6), False),
           "left-only": (Window(4, None), False), "right-only": (Window(None, 2), False)}


@pytest.mark.parametrize("dv", [16, 8], ids=["d", "mla"])
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("cp,rank,src", [(1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 0, 1), (4, 1, 3), (4, 2, 1)])
def test_sbhd_band_blocks_match_math(fake, cp, rank, src, window, dv):
    """A ring block (rank's queries against src's keys, zigzag chunks) through the stand-in:
    output, LSE and the gradients from a final out/LSE equal the dense-mask math."""
    win, causal = WINDOWS[window]
    band = Band(win, causal, local_seq(48 // cp, cp), rank, "cpu")
    mask = band.block(src)
    if mask is None:
        pytest.skip("block outside the window")
    q, k, v = _qkv(48 // cp, False, dv)
    out, lse = band_fwd(q, k, v, mask, 0.25)
    ref_out, ref_lse = _math_band_fwd(q, k, v, mask.dense(), 0.25)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(lse, ref_lse, **FP32)
    # gradients of this block's share, given a "final" out and LSE (another block merged in)
    dout = torch.randn_like(ref_out)
    final_lse = torch.logaddexp(ref_lse, torch.zeros_like(ref_lse))
    final_out = ref_out * torch.exp(ref_lse - final_lse).movedim(-1, 0).unsqueeze(-1)
    got = band_bwd(dout, q, k, v, final_out, final_lse, mask, 0.25)
    want = _math_band_bwd(dout, q, k, v, final_out, final_lse, mask.dense(), 0.25)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **FP32)
    assert fake.calls, "the stand-in ran"


@pytest.mark.parametrize("window", ["causal-window", "two-sided"])
def test_thd_whole_sequences_are_one_ragged_call(fake, window):
    """THD at a level of size 1 (a2a, no CP): one varlen call with the band for every sequence;
    THD at a level of size 2 is not the library's (FlexAttention / math take it)."""
    win, causal = WINDOWS[window]
    cu = torch.tensor([0, 16, 24, 48])
    band = Band(win, causal, local_seq(48, 1, cu, 24), 0, "cpu")
    mask = band.block(0)
    q, k, v = _qkv(48, True, 8)
    out, lse = band_fwd(q, k, v, mask, 0.25)
    ref_out, ref_lse = _math_band_fwd(q, k, v, mask.dense(), 0.25)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(lse, ref_lse, **FP32)
    dout = torch.randn_like(out)
    for g, w in zip(band_bwd(dout, q, k, v, ref_out, ref_lse, mask, 0.25),
                    _math_band_bwd(dout, q, k, v, ref_out, ref_lse, mask.dense(), 0.25)):
        torch.testing.assert_close(g, w, **FP32)
    assert len(fake.calls) == 2
    split = Band(win, causal, local_seq(24, 2, cu, 24), 0, "cpu").block(0)
    assert not cudnn_fe.expressible(split)


def test_all_gather_natural_keys_are_rectangles(fake):
    """all_gather's band (local zigzag queries against all keys in natural order)."""
    band = Band(Window(5, None), True, local_seq(12, 4), 1, "cpu", ring=False)
    mask = band.natural_mask(48)
    q, _, _ = _qkv(12, False)
    _, k, v = _qkv(48, False, seed=1)
    out, lse = band_fwd(q, k, v, mask, 0.25)
    ref_out, ref_lse = _math_band_fwd(q, k, v, mask.dense(), 0.25)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(lse, ref_lse, **FP32)


@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
def test_sink_is_folded_into_the_kernel(fake, thd):
    """A sink goes to the kernel (one forward with sinks), and the result equals the kernel
    without a sink followed by apply_sink; the backward needs no sink."""
    q, k, v = _qkv(24, thd)
    sink = torch.tensor([0.0, 0.5, -1.0, 2.0])
    kw = dict(cu_seqlens_q=torch.tensor([0, 10, 24], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, 10, 24], dtype=torch.int32), max_seqlen_q=14, max_seqlen_k=14) if thd else {}
    out, lse = attn_fwd(q, k, v, True, 0.25, sink=sink, **kw)
    assert fake.calls[-1][3], "sinks passed to the kernel"
    ref = apply_sink(*attn_fwd(q, k, v, True, 0.25, kernel="math", **kw), sink) if not thd else \
        apply_sink(*kernels._loop_fwd(q, k, v, True, 0.25, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kernel="math"), sink)
    torch.testing.assert_close(out.float(), ref[0], **FP32)
    torch.testing.assert_close(lse, ref[1], **FP32)


def test_mla_dense_block_takes_v_as_it_is(fake):
    """v with its own head dim goes to the library unpadded; the other kernels get padded copies
    (exact); both equal the math on v as it is, forward and backward."""
    q, k, v = _qkv(16, False, dv=8)
    ref_out, ref_lse = kernels._math_fwd(q, k, v, True, 0.25)
    dout = torch.randn_like(ref_out)
    ref_grads = kernels._math_bwd(dout, q, k, v, ref_out, ref_lse, True, 0.25)
    for name, (fwd, bwd) in (("cudnn_fe", kernels._DENSE["cudnn_fe"]), ("cpu", kernels._DENSE["cpu"])):
        seen = []

        def spy(*args, fn=fwd):
            seen.append(args[2].shape[-1])
            return fn(*args)
        out, lse = kernels._call(0, spy, name, (q, k, v, True, 0.25))
        assert seen == [8 if name == "cudnn_fe" else 16] and out.shape[-1] == 8
        torch.testing.assert_close(out, ref_out, **FP32)
        torch.testing.assert_close(lse, ref_lse, **FP32)
        grads = kernels._call(1, bwd, name, (dout, q, k, v, ref_out, ref_lse, True, 0.25))
        for g, w in zip(grads, ref_grads):
            torch.testing.assert_close(g, w, **FP32)


# ---------------------------------------------------------------------------------------------
# selection and fallback


def test_selection_rule():
    """The documented default: torch's cuDNN first for dense blocks of one head dim, the cuDNN
    frontend first for MLA; without the library the old order; a forced "cudnn_fe" without the
    library lets cpkit choose; fp32 and CPU never use it."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert kernel_candidates(cuda, bf16, fe=True) == ["cudnn", "cudnn_fe", "flash", "efficient"]
    assert kernel_candidates(cuda, bf16, fe=True, mla=True)[0] == "cudnn_fe"
    assert kernel_candidates(cuda, bf16, fe=False) == ["cudnn", "flash", "efficient"]
    assert kernel_candidates(cuda, bf16, "cudnn_fe", fe=True) == ["cudnn_fe"]
    assert kernel_candidates(cuda, bf16, "cudnn_fe", fe=False) == ["cudnn", "flash", "efficient"]
    assert kernel_candidates(cuda, torch.float32, fe=True) == ["efficient", "math"]
    assert kernel_candidates(torch.device("cpu"), bf16, fe=True) == ["cpu", "math"]


def test_missing_library_warns_once_and_falls_back(monkeypatch):
    """Without the library a band block runs the fallback (math on CPU) with one warning for the
    process, not one per call, and not on CPU tensors (where the library never applies)."""
    monkeypatch.setattr(cudnn_fe, "available", lambda: False)
    monkeypatch.setattr(cudnn_fe, "_on_device", lambda q: True)
    monkeypatch.setattr(cudnn_fe, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(cudnn_fe, "_WARNED_MISSING", [])
    mask = Band(Window(5, None), True, local_seq(24, 2), 0, "cpu").block(0)
    q, k, v = _qkv(24, False)
    with pytest.warns(UserWarning, match="nvidia-cudnn-frontend is not importable") as record:
        for _ in range(3):
            out, _ = band_fwd(q, k, v, mask, 0.25, kernel="math")
            band_fwd(q, k, v, mask, 0.25)
    assert sum("cudnn-frontend" in str(w.message) for w in record) == 1
    torch.testing.assert_close(out, _math_band_fwd(q, k, v, mask.dense(), 0.25)[0], **FP32)


def test_no_warning_on_cpu_tensors():
    """On a CPU tensor the library is never a candidate: no warning."""
    q, k, v = _qkv(24, False)
    mask = Band(Window(5, None), True, local_seq(24, 2), 0, "cpu").block(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert not cudnn_fe.usable(q, None)
        band_fwd(q, k, v, mask, 0.25, kernel="math")


def test_refused_shape_warns_once_and_falls_back(fake):
    """A shape the library refuses: one warning, the fallback's result, and the library not
    asked again for that shape kind."""
    fake.refuse = True
    mask = Band(Window(5, None), True, local_seq(24, 2), 1, "cpu").block(0)
    q, k, v = _qkv(24, False)
    with pytest.warns(UserWarning, match="refused"):
        out, lse = band_fwd(q, k, v, mask, 0.25)
    calls = len(fake.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention's own CPU notices
        again, _ = band_fwd(q, k, v, mask, 0.25)
    assert len(fake.calls) == calls
    want = _math_band_fwd(q, k, v, mask.dense(), 0.25)
    torch.testing.assert_close(out, want[0], **FP32)
    torch.testing.assert_close(again, want[0], **FP32)
