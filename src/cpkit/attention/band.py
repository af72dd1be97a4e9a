"""Sliding-window attention (MCore/TE `window_size`) over the CP layouts: the band mask of a block.

A query at global position i sees the keys at j with i - left <= j <= i + right (and j <= i
under a causal mask), within its own packed sequence (THD). `Band` gives, for this rank's
queries and the tokens another rank holds at the same CP level, the boolean mask [s_q, s_k] of
their block, or None when the block lies wholly outside the band, so the ring skips its
compute (sbhd: decided on the host from the chunk ranges, no device sync; THD blocks are always
computed, masked, because the chunk sizes differ per sequence and live on the device).

A block's band is a `BandMask`: the positions (and THD sequence ids) of its queries and keys
plus the window, O(s_q + s_k), never the dense [s_q, s_k] mask until a kernel asks for it.

Kernels: on CUDA, `band_fwd` / `band_bwd` run FlexAttention with the band as a block mask
(`flex_band.py`: compute and memory follow the band; tiles wholly outside it are skipped); on
CPU, with `kernel="math"`, or where FlexAttention fails for a shape (one warning, then exact
math for that shape), exact float32 math with the dense mask (O(s_q * s_k) memory per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cpkit.attention import flex_band
from cpkit.attention.chunks import LocalSeq
from cpkit.attention.kernels import _bhsd, _from_bhsd, _math_scores
from cpkit.errors import CPConfigError
from cpkit.sharding import segments_to_index

__all__ = ["Window", "check_window", "Band", "BandMask", "band_fwd", "band_bwd"]


@dataclass(frozen=True)
class Window:
    """The band: keys from `left` tokens before a query to `right` after it (None: unbounded)."""

    left: Optional[int]
    right: Optional[int]


class BandMask:
    """The band of one block: query positions/sequence ids `q`, key positions/sequence ids `k`
    (each (index [n], seq id [n] or None)), the window and whether the mask is causal."""

    def __init__(self, q, k, window: Window, causal: bool):
        self.q, self.k, self.window, self.causal = q, k, window, causal

    @property
    def shape(self) -> tuple[int, int]:
        """(s_q, s_k): the block's query and key counts."""
        return self.q[0].numel(), self.k[0].numel()

    def allows(self, q_idx, k_idx, q_seg=None, k_seg=None):
        """Whether queries at `q_idx` see keys at `k_idx` (broadcasting tensors)."""
        diff = q_idx - k_idx
        ok = diff >= 0 if self.causal else diff == diff
        if self.window.left is not None:
            ok = ok & (diff <= self.window.left)
        if self.window.right is not None:
            ok = ok & (diff >= -self.window.right)
        if q_seg is not None:
            ok = ok & (q_seg == k_seg)
        return ok

    def dense(self) -> torch.Tensor:
        """The boolean mask [s_q, s_k] (True: attend)."""
        (q_idx, q_seg), (k_idx, k_seg) = self.q, self.k
        segs = (None, None) if q_seg is None else (q_seg.view(-1, 1), k_seg.view(1, -1))
        return self.allows(q_idx.view(-1, 1), k_idx.view(1, -1), *segs)

    def mask_mod(self):
        """The band as a FlexAttention mask_mod(b, h, q, kv)."""
        (q_idx, q_seg), (k_idx, k_seg) = self.q, self.k
        if q_seg is None:
            return lambda b, h, i, j: self.allows(q_idx[i], k_idx[j])
        return lambda b, h, i, j: self.allows(q_idx[i], k_idx[j], q_seg[i], k_seg[j])


def check_window(window_size, causal: bool) -> Optional[Window]:
    """`window_size` (MCore/TE: (left, right), -1 for unbounded; None for no window) as a Window,
    or None when it bounds nothing. CPConfigError for anything else."""
    if window_size is None:
        return None
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    if not ok:
        raise CPConfigError.single("window_size", window_size, "must be (left, right) ints >= -1 (-1: unbounded)",
                                   "pass e.g. (4095, 0) for a causal window of 4096 tokens, or None")
    left, right = (None if w == -1 else w for w in window_size)
    if causal:
        right = None  # the causal mask bounds the right side
    if left is None and right is None:
        return None
    return Window(left, right)


def _chunk_ranges(seq: LocalSeq, rank: int) -> list[tuple[int, int]]:
    """sbhd: the global position ranges of `rank`'s tokens at the level of `seq`."""
    n, tokens = seq.size, seq.tokens
    if n == 1:
        return [(0, tokens)]
    c = tokens // 2
    last = 2 * n - 1 - rank
    return [(rank * c, (rank + 1) * c), (last * c, (last + 1) * c)]


class Band:
    """Band masks of this rank's queries against each rank's tokens at one CP level.

    `seq` describes the level (size, local tokens, THD offsets), `rank` this rank's position in
    it. Positions are global token indices (sbhd: in the sequence; THD: in the packed batch,
    with a sequence id per token so that sequences never see each other)."""

    def __init__(self, window: Window, causal: bool, seq: LocalSeq, rank: int, device):
        self.window, self.causal, self.seq, self.rank, self.device = window, causal, seq, rank, device
        self._q = self._tokens(rank)

    def _tokens(self, rank: int):
        seq = self.seq
        if not seq.varlen:
            ranges = _chunk_ranges(seq, rank)
            return torch.cat([torch.arange(a, b, device=self.device) for a, b in ranges]), None
        cu = seq.global_cu.to(self.device)
        n = seq.size
        if n == 1:
            index = torch.arange(seq.tokens, device=self.device)
        else:
            starts, chunk = cu[:-1], (cu[1:] - cu[:-1]) // (2 * n)
            seg_starts = torch.stack([starts + rank * chunk, starts + (2 * n - 1 - rank) * chunk], 1)
            index = segments_to_index(seg_starts.reshape(-1), chunk.repeat_interleave(2), seq.tokens)
        return index, torch.searchsorted(cu, index, right=True) - 1

    def _live(self, src: int) -> bool:
        """sbhd: whether any query of this rank sees any token of `src` (host arithmetic)."""
        if self.seq.varlen:
            return True
        lo = 0 if self.causal else (-self.window.right if self.window.right is not None else None)
        hi = self.window.left
        for a0, a1 in _chunk_ranges(self.seq, self.rank):
            for b0, b1 in _chunk_ranges(self.seq, src):
                d_min, d_max = a0 - (b1 - 1), (a1 - 1) - b0  # query position minus key position
                if (hi is None or d_min <= hi) and (lo is None or d_max >= lo):
                    return True
        return False

    def block(self, src: int) -> Optional[BandMask]:
        """The band of this rank's queries against `src`'s tokens, or None when the whole block
        lies outside it."""
        if not self._live(src):
            return None
        return self.mask_for(self._tokens(src))

    def mask_for(self, keys) -> BandMask:
        """The band of this rank's queries against keys given as (global index, sequence id)."""
        return BandMask(self._q, keys, self.window, self.causal)

    def natural_keys(self, total: int):
        """(global index, sequence id) of all `total` tokens of the level in natural order."""
        index = torch.arange(total, device=self.device)
        if not self.seq.varlen:
            return index, None
        return index, torch.searchsorted(self.seq.global_cu.to(self.device), index, right=True) - 1


def _dense(x):
    return x if x.dim() == 4 else x.unsqueeze(1)  # THD [t, h, d] -> [t, 1, h, d]


def band_fwd(q, k, v, band: BandMask, scale: float, kernel: Optional[str] = None):
    """Attention of q over k/v where `band` allows it: (out like q, float32 LSE [b, h, s] or
    [h, t]; -inf and zero output for rows that see no key). `kernel="math"` forces exact math."""
    if flex_band.wanted(q, kernel):
        got = flex_band.try_run(flex_band.fwd, q, k, v, band, scale)
        if got is not None:
            return got
    return _math_band_fwd(q, k, v, band.dense(), scale)


def band_bwd(dout, q, k, v, out, lse, band: BandMask, scale: float, kernel: Optional[str] = None):
    """(dq, dk, dv) in the dtypes of q, k, v of one band-masked block, given the FINAL out and
    LSE of the whole attention."""
    if flex_band.wanted(q, kernel):
        got = flex_band.try_run(flex_band.bwd, q, k, v, band, scale, dout, out, lse)
        if got is not None:
            return got
    return _math_band_bwd(dout, q, k, v, out, lse, band.dense(), scale)


def _math_band_fwd(q, k, v, mask: torch.Tensor, scale: float):
    thd = q.dim() == 3
    qd, kd, vd = _dense(q), _dense(k), _dense(v)
    s, b, h, _ = qd.shape
    _, _, scores = _math_scores(qd, kd, False, scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.nan_to_num(lse, neginf=0.0).unsqueeze(-1))
    out = torch.matmul(p, _bhsd(vd.float()).unsqueeze(2))
    out = _from_bhsd(out.reshape(b, h, s, -1)).to(q.dtype)
    lse = lse.reshape(b, h, s)
    return (out.squeeze(1), lse.squeeze(0)) if thd else (out, lse)


def _math_band_bwd(dout, q, k, v, out, lse, mask: torch.Tensor, scale: float):
    thd = q.dim() == 3
    dout, q, k, v, out = (_dense(x) for x in (dout, q, k, v, out))
    if thd:
        lse = lse.unsqueeze(0)
    s, b, h, _ = q.shape
    kv_heads = k.shape[2]
    g = h // kv_heads
    qf, kf, scores = _math_scores(q, k, False, scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.nan_to_num(lse.reshape(b, kv_heads, g, s), neginf=0.0)
    p = torch.exp(scores - lse.unsqueeze(-1))
    do = _bhsd(dout.float()).reshape(b, kv_heads, g, s, -1)
    of = _bhsd(out.float()).reshape(b, kv_heads, g, s, -1)
    vf = _bhsd(v.float()).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - (do * of).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
    grads = (_from_bhsd(dq.reshape(b, h, s, -1)).to(q.dtype), _from_bhsd(dk).to(k.dtype), _from_bhsd(dv).to(v.dtype))
    return tuple(x.squeeze(1) for x in grads) if thd else grads
