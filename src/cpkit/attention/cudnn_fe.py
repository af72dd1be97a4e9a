"""Attention blocks through NVIDIA's cuDNN frontend (`nvidia-cudnn-frontend`, extra `cpkit[kernels]`).

The frontend's torch ops `torch.ops.cudnn.sdpa_fwd` / `sdpa_bwd` (registered by importing
`cudnn.sdpa.fwd.torch_op`) run cuDNN's fused SDPA, the engine Transformer Engine's fused
attention builds on, with what torch's own SDPA cannot say: a diagonal band (sliding window,
left and right), ragged THD batches (cu_seqlens), sink logits, a V head dim of its own (MLA),
the log-sum-exp out of the forward, and a backward from a GIVEN output and LSE (the ring's
final, merged ones), so a block's share of the gradients needs no recompute.

    fwd(q, k, v, scale, causal, band, sink) -> (out, lse)          dense [s, b, h, d]
    varlen_fwd(q, k, v, scale, cu..., causal, band, sink)          THD [t, h, d]
    band_fwd(q, k, v, mask, scale, sink) / band_bwd(...)           a `band.BandMask` block
    bwd(...), varlen_bwd(...)                                      given the final out and LSE

The band: cuDNN's top-left diagonal band lets query i see key j when j > i - window_left and
j <= i + window_right (window_left counts the visible keys up to and including the diagonal:
cpkit's left distance + 1; -1 unbounded). A band block of the CP layouts is a set of position
runs (sbhd: a rank's chunks) whose query-minus-key distances lie in [lo, hi]; every pair of runs
is one rectangle, trimmed to the queries that see a key and the keys that some query sees, so
the trimmed band crosses its own diagonal and is one cuDNN band (`band_rectangles`, host
arithmetic). THD bands go to the kernel when the block is whole sequences against themselves
(one level of size 1: a2a, or no CP), where the band is the same for every sequence.

The sink: the forward folds the per-head logits into the softmax denominator (out and LSE then
are the sink's, `sink.apply_sink`); the backward needs no sink, as the final LSE already holds
it (`sink.py`), and the sink's own gradient comes from the LSE outside the kernel.

The library is optional: `available()` is False without it (one warning on CUDA); a shape the
library refuses warns once (per shape kind) and `try_run` returns None, so the caller falls back
(FlexAttention, torch's kernels, math).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from cpkit.attention.merge import merge_
from cpkit.attention.sink import apply_sink

__all__ = ["INSTALL_HINT", "available", "usable", "try_run", "Rect", "band_rectangles", "staircase", "fwd", "bwd",
           "varlen_fwd", "varlen_bwd", "band_fwd", "band_bwd", "expressible"]

INSTALL_HINT = "pip install 'cpkit[kernels]' (or: pip install --no-deps nvidia-cudnn-frontend)"
_DTYPES = (torch.bfloat16, torch.float16)
_FAILED: set = set()  # shape kinds the library refused: not tried again
_WARNED_MISSING: list = []


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the cuDNN frontend's SDPA torch ops import (registers torch.ops.cudnn.sdpa_*)."""
    try:
        import cudnn.sdpa.fwd.torch_op  # noqa: F401
    except Exception:  # noqa: BLE001 - missing wheel, a foreign build, no libcudnn: all "unavailable"
        return False
    return True


def _on_device(q: torch.Tensor) -> bool:
    return q.is_cuda


def usable(q: torch.Tensor, kernel: Optional[str]) -> bool:
    """Whether a block of `q` goes to the cuDNN frontend: a CUDA 16-bit tensor, `kernel` None
    (cpkit chooses) or "cudnn_fe", and the library importable. Without the library, warns once
    (where it would have been used) and returns False."""
    if kernel not in (None, "cudnn_fe") or not _on_device(q) or q.dtype not in _DTYPES:
        return False
    if available():
        return True
    if not _WARNED_MISSING:
        _WARNED_MISSING.append(True)
        warnings.warn("cpkit attention: nvidia-cudnn-frontend is not importable; sliding windows, sinks, "
                      f"THD and MLA run on FlexAttention / torch's kernels instead. {INSTALL_HINT}")
    return False


def try_run(fn, key: tuple, *args, **kwargs):
    """`fn(*args, **kwargs)`, or None (one warning per `key`) when the library refuses the shape;
    out-of-memory is raised, not hidden."""
    if key in _FAILED:
        return None
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - cudnnGraphNotSupportedError, ValueError, NotImplementedError
        _FAILED.add(key)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        warnings.warn(f"cpkit attention: the cuDNN frontend refused {key}; falling back: {first}")
        return None


# ---------------------------------------------------------------------------------------------
# the band as cuDNN's window arguments


def _window_args(lo: Optional[int], hi: Optional[int], s_q: int, s_k: int) -> tuple[int, int]:
    """(window_left, window_right) of cuDNN's top-left band for query-minus-key distances in
    [lo, hi] (None: unbounded; lo <= 0 <= hi) over an s_q x s_k block; -1 where a side binds
    nothing there."""
    left = -1 if hi is None or hi >= s_q - 1 else hi + 1
    right = -1 if lo is None or -lo >= s_k - 1 else -lo
    return left, right


@dataclass(frozen=True)
class Rect:
    """One cuDNN call of a band block: queries q0 .. q0+nq and keys k0 .. k0+nk (local rows),
    with cuDNN's window (left, right) about the rectangle's top-left diagonal (i == j), or, with
    `bottom_right`, about its bottom-right one (i - j == nq - nk)."""

    q0: int
    nq: int
    k0: int
    nk: int
    left: int
    right: int
    bottom_right: bool = False


def _rect(q0: int, nq: int, k0: int, nk: int, lo: Optional[int], hi: Optional[int]) -> Rect:
    """The Rect of a trimmed rectangle whose visible distances i - j are [lo, hi] (lo <= 0 <= hi
    or None). Where the last query's nearest visible key is the last key (nk - nq == -lo < 0),
    the band is causal about the bottom-right diagonal (cuDNN's causal sliding-window form)."""
    if lo is not None and lo < 0 and nk - nq == -lo:
        left = -1 if hi is None or hi - lo >= nk - 1 else hi - lo + 1
        return Rect(q0, nq, k0, nk, left, 0, bottom_right=True)
    left, right = _window_args(lo, hi, nq, nk)
    return Rect(q0, nq, k0, nk, left, right)


def _split_at(q_run, k_run):
    """`k_run` (global start, local start, length) cut where `q_run`'s positions begin and end,
    so that each piece lies before, on or after the queries' positions."""
    gq, _, nq = q_run
    gk, lk, nk = k_run
    cuts = sorted({gk, gk + nk, *(c for c in (gq, gq + nq) if gk < c < gk + nk)})
    return [(a, lk + a - gk, b - a) for a, b in zip(cuts[:-1], cuts[1:])]


def band_rectangles(q_runs, k_runs, lo: Optional[int], hi: Optional[int]) -> list[Rect]:
    """The rectangles of a band block: for every query run and key run ((global start, local
    start, length) each), the key run cut where the query run's positions begin and end (so a
    rectangle is either the queries against their own positions, with the band about its
    diagonal, or against positions wholly before or after them: a corner no wider than the
    band), then trimmed to the queries that see some key and the keys some query sees, when the
    query-minus-key distance must lie in [lo, hi] (None: unbounded). Empty pairs are left out.
    One long rectangle whose band runs beside its diagonal was computed in full by cuDNN
    (all_gather's window block: 80 ms against FlexAttention's 44 on 1x H100)."""
    rects = []
    for q_run in q_runs:
        gq, lq, nq = q_run
        for gk, lk, nk in (piece for k_run in k_runs for piece in _split_at(q_run, k_run)):
            offset = gq - gk  # global distance = offset + i - j (local i, j)
            lo_l = None if lo is None else lo - offset
            hi_l = None if hi is None else hi - offset
            q_lo, q_hi = max(0, lo_l if lo_l is not None else 0), nq if hi_l is None else min(nq, hi_l + nk)
            k_lo, k_hi = max(0, -hi_l if hi_l is not None else 0), nk if lo_l is None else min(nk, nq - lo_l)
            if q_hi <= q_lo or k_hi <= k_lo:
                continue
            shift = q_lo - k_lo  # the trimmed rectangle's distances are the local ones minus this
            lo_t = None if lo_l is None else lo_l - shift
            hi_t = None if hi_l is None else hi_l - shift
            rects.append(_rect(lq + q_lo, q_hi - q_lo, lk + k_lo, k_hi - k_lo, lo_t, hi_t))
    return rects


STAIR_MIN, STAIR_MAX_BLOCKS = 128, 64
"""The backward takes a band as a staircase (`staircase`) where it reaches at least STAIR_MIN keys
right of its diagonal (smaller blocks would be smaller than one of cuDNN's tiles) in at most
STAIR_MAX_BLOCKS blocks (two calls each)."""


def staircase(rects: list[Rect]) -> list[Rect]:
    """The same pairs, with each top-left rectangle whose band reaches `right` >= STAIR_MIN keys
    right of its diagonal split into forms cuDNN's backward skips tiles in: the band up to the
    diagonal (right 0), and per `right`-row block of the part above it, a strict upper triangle
    (the keys shifted by one: window 1 / -1) and a causal square. The backward took such a band
    whole as the whole rectangle (128K, cp 2: 199 ms for all_gather's two-sided window against
    38 for the causal one, twice the pairs; evidence/2026-11-28-1xH200-4dfd836/)."""
    out = []
    for r in rects:
        if r.bottom_right or r.right < STAIR_MIN or -(-r.nq // r.right) > STAIR_MAX_BLOCKS:
            out.append(r)
            continue
        out.append(Rect(r.q0, r.nq, r.k0, r.nk, r.left, 0))
        step = r.right
        for top in range(0, r.nq, step):
            rows = min(step - 1, r.nq - top, r.nk - top - 1)  # keys top+1 .. top+step-1 above the diagonal
            if rows > 0:
                out.append(Rect(r.q0 + top, rows, r.k0 + top + 1, min(step - 1, r.nk - top - 1), 1, -1))
            keys = min(step, r.nk - top - step)  # keys top+step .. top+2*step-1, up to `right` past each row
            if keys > 0:
                out.append(Rect(r.q0 + top, min(step, r.nq - top), r.k0 + top + step, keys, -1, 0))
    return out


def expressible(mask) -> bool:
    """Whether a `band.BandMask` is cuDNN bands: position runs known on the host (sbhd), or
    whole sequences against themselves (THD at one level of size 1)."""
    return mask.runs is not None or mask.ragged is not None


# ---------------------------------------------------------------------------------------------
# the ops (one place, so tests can stand in for them on CPU)


def _ops():
    return torch.ops.cudnn


def _bhsd(x):  # [s, b, h, d] -> [b, h, s, d] view
    return x.permute(1, 2, 0, 3)


def _from_bhsd(x):  # [b, h, s, d] -> [s, b, h, d] view
    return x.permute(2, 0, 1, 3)


def _sinks(sink: Optional[torch.Tensor], heads: int):
    return None if sink is None else sink.detach().float().reshape(1, heads, 1, 1).contiguous()


def fwd(q, k, v, scale: float, causal: bool = False, window: tuple[int, int] = (-1, -1),
        sink: Optional[torch.Tensor] = None, bottom_right: bool = False):
    """Dense q [s, b, h, d], k [s_k, b, h_kv, d], v [s_k, b, h_kv, d_v] -> (out [s, b, h, d_v]
    in q's dtype, float32 LSE [b, h, s]). `causal`: top-left causal; `window`: cuDNN's (left,
    right), about the bottom-right diagonal with `bottom_right`; `sink` [h]: sink logits folded
    in (out and LSE include them)."""
    s, b, h, _ = q.shape
    o, stats = _ops().sdpa_fwd(_bhsd(q), _bhsd(k), _bhsd(v), scale, is_causal=causal, window_left=window[0],
                               window_right=window[1], sinks=_sinks(sink, h), return_lse=True,
                               **({"causal_bottom_right": True} if bottom_right else {}))
    return _from_bhsd(o), stats.reshape(b, h, s)


def bwd(dout, q, k, v, out, lse, scale: float, causal: bool = False, window: tuple[int, int] = (-1, -1),
        bottom_right: bool = False):
    """(dq, dk, dv) of a dense block given the FINAL `out` and `lse` [b, h, s] (a sink's
    included); shapes as in `fwd`."""
    dq, dk, dv = _ops().sdpa_bwd(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, scale,
                                 is_causal=causal, window_left=window[0], window_right=window[1],
                                 **({"causal_bottom_right": True} if bottom_right else {}))
    return _from_bhsd(dq), _from_bhsd(dk), _from_bhsd(dv)


def _bucket(max_len: int) -> int:
    """`max_len` rounded up to a power of two (at least 128): the library builds one graph per
    longest length it is told, and it is only a bound, so packed batches of ever-new lengths
    share a few graphs (sequences shorter than the bound cost no compute)."""
    return max(128, 1 << (int(max_len) - 1).bit_length())


def varlen_fwd(q, k, v, scale: float, cu_q, cu_k, max_q: int, max_k: int, causal: bool = False,
               window: tuple[int, int] = (-1, -1), sink: Optional[torch.Tensor] = None):
    """THD q [t, h, d], k/v [t_k, h_kv, d / d_v], int32 `cu_q`/`cu_k` -> (out [t, h, d_v], float32
    LSE [h, t]); the band and causal mask per sequence. `max_q`/`max_k`: bounds of the lengths."""
    o, stats = _ops().sdpa_fwd(q, k, v, scale, is_causal=causal, window_left=window[0], window_right=window[1],
                               sinks=_sinks(sink, q.shape[1]), cu_seqlens_q=cu_q.to(torch.int32),
                               cu_seqlens_kv=cu_k.to(torch.int32), max_seqlen_q=_bucket(max_q),
                               max_seqlen_kv=_bucket(max_k), return_lse=True)
    return o, stats[:, :, 0].t()


def _padded_lse(lse, cu_q, max_q: int) -> torch.Tensor:
    """[h, t] LSE -> [n, h, max_q, 1], the layout cuDNN's THD backward reads (rows past a
    sequence's end are ignored)."""
    n, (heads, tokens) = cu_q.numel() - 1, lse.shape
    cu = cu_q.to(torch.int64)
    token = torch.arange(tokens, device=lse.device)
    seq = torch.searchsorted(cu[1:], token, right=True)
    padded = lse.new_zeros((n, heads, max_q, 1))
    padded[seq, :, token - cu[seq], 0] = lse.t()
    return padded


def _packed_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [t, h, d] with densely packed rows (token stride h * d): a copy only where it is a
    strided view, e.g. one of q/k/v split out of a2a's packed all-to-all buffer."""
    t, h, d = x.shape
    return x if x.stride() == (h * d, d, 1) or t <= 1 else x.contiguous()


def varlen_bwd(dout, q, k, v, out, lse, scale: float, cu_q, cu_k, max_q: int, max_k: int,
               causal: bool = False, window: tuple[int, int] = (-1, -1)):
    """(dq, dk, dv) of a THD block given the FINAL `out` and `lse` [h, t].

    Inputs go in with densely packed rows: given q as a view whose token stride is wider than
    h * d (a2a's packed buffer), the library's THD backward returned a wrong dq (12-80% of the
    elements, up to 3.0 off; an abort at larger widths; 1.32.0 on H100), while the forward and
    dk, dv read such views correctly (`functional/test_kernel_conformance.py`, `thd-strided`)."""
    max_q, max_k = _bucket(max_q), _bucket(max_k)
    dout, q, k, v, out = (_packed_rows(x) for x in (dout, q, k, v, out))
    return _ops().sdpa_bwd(dout, q, k, v, out, _padded_lse(lse.float(), cu_q, max_q), scale,
                           is_causal=causal, window_left=window[0], window_right=window[1],
                           cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_kv=cu_k.to(torch.int32),
                           max_seqlen_q=max_q, max_seqlen_kv=max_k)


# ---------------------------------------------------------------------------------------------
# band blocks


def _ragged_window(mask) -> tuple[int, int]:
    lo, hi = mask.distances()
    _, max_len = mask.ragged
    return _window_args(lo, hi, max_len, max_len)


def _rects(mask) -> list[Rect]:
    if "cudnn_fe" not in mask.kernel_cache:
        lo, hi = mask.distances()
        mask.kernel_cache["cudnn_fe"] = band_rectangles(*mask.runs, lo, hi)
    return mask.kernel_cache["cudnn_fe"]


def _covers(rects: list[Rect], s_q: int, s_k: int) -> bool:
    return len(rects) == 1 and rects[0].nq == s_q and rects[0].nk == s_k


def band_fwd(q, k, v, mask, scale: float, sink: Optional[torch.Tensor] = None):
    """(out like q with v's head dim, float32 LSE [b, h, s] or [h, t]) of q over k/v within the
    `band.BandMask` `mask` (`expressible(mask)` must hold); rows that see no key get a zero
    output and LSE -inf (the sink's logit with a sink). `sink` [h]: folded in (out and LSE
    include it)."""
    if mask.ragged is not None:
        cu, max_len = mask.ragged
        return varlen_fwd(q, k, v, scale, cu, cu, max_len, max_len, window=_ragged_window(mask), sink=sink)
    rects = _rects(mask)
    if _covers(rects, q.shape[0], k.shape[0]):
        r = rects[0]
        return fwd(q, k, v, scale, window=(r.left, r.right), sink=sink, bottom_right=r.bottom_right)
    s, b, h, _ = q.shape
    out = q.new_zeros((s, b, h, v.shape[-1]))
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    written = set()
    for r in rects:
        rows = slice(r.q0, r.q0 + r.nq)
        o, l = fwd(q[rows], k[r.k0:r.k0 + r.nk], v[r.k0:r.k0 + r.nk], scale, window=(r.left, r.right),
                   bottom_right=r.bottom_right)
        if _disjoint(r.q0, r.nq, written):  # the first rectangle of these rows: no merge
            out[rows].copy_(o)
            lse[..., rows].copy_(l)
        else:
            merge_(out[rows], lse[..., rows], o, l)
        written.add((r.q0, r.nq))
    if sink is not None:
        out, lse = apply_sink(out, lse, sink)
    return out, lse


def _disjoint(start: int, length: int, spans) -> bool:
    return all(start + length <= a or a + n <= start for a, n in spans)


def _each_once(spans) -> bool:
    """Whether the (start, length) spans are pairwise disjoint."""
    return all(_disjoint(*span, spans[:i]) for i, span in enumerate(spans))


def band_bwd(dout, q, k, v, out, lse, mask, scale: float):
    """(dq, dk, dv) in the dtypes of q, k, v of a band block, given the FINAL `out` and `lse`."""
    if mask.ragged is not None:
        cu, max_len = mask.ragged
        return varlen_bwd(dout, q, k, v, out, lse, scale, cu, cu, max_len, max_len, window=_ragged_window(mask))
    rects = staircase(_rects(mask))
    if _covers(rects, q.shape[0], k.shape[0]):
        r = rects[0]
        return bwd(dout, q, k, v, out, lse, scale, window=(r.left, r.right), bottom_right=r.bottom_right)
    # Rows that one rectangle alone covers take its gradients as they are; rows two rectangles
    # share (a query run against both key runs, a staircase's steps) accumulate in fp32.
    exact_q = _each_once([(r.q0, r.nq) for r in rects])
    exact_k = _each_once([(r.k0, r.nk) for r in rects])
    dq = torch.zeros_like(q, dtype=None if exact_q else torch.float32)
    dk, dv = (torch.zeros_like(x, dtype=None if exact_k else torch.float32) for x in (k, v))
    for r in rects:
        rows, keys = slice(r.q0, r.q0 + r.nq), slice(r.k0, r.k0 + r.nk)
        g = bwd(dout[rows], q[rows], k[keys], v[keys], out[rows], lse[..., rows], scale, window=(r.left, r.right),
                bottom_right=r.bottom_right)
        for acc, part, span, exact in ((dq, g[0], rows, exact_q), (dk, g[1], keys, exact_k), (dv, g[2], keys, exact_k)):
            (acc[span].copy_ if exact else acc[span].add_)(part)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
