"""Sliding-window attention (MCore/TE `window_size`) over the CP layouts: the band mask of a block.

A query at global position i sees the keys at j with i - left <= j <= i + right (and j <= i
under a causal mask), within its own packed sequence (THD). `Band` gives, for this rank's
queries and the tokens another rank holds at the same CP level, the boolean mask [s_q, s_k] of
their block, or None when the block lies wholly outside the band, so the ring skips its
compute. Liveness is exact (a block with one visible query-key pair is computed) and decided
per chunk offset: in the 2*n chunk layout the query-minus-key positions of query chunk a against
key chunk b of one sequence with chunks of c tokens fill [(a-b)*c - (c-1), (a-b)*c + (c-1)], so
whether some pair is visible depends only on a - b and c. sbhd: host arithmetic on the one
chunk length, cached, no device sync. THD: the same test over every sequence's chunk length at
once, on the device, copied to the host once per Band (asynchronously, awaited when the first
block other than the rank's own is asked for) and reused by the backward.

The ring is not cut short when its trailing steps are dead: the zigzag layout makes the last
forward step (src = rank + 1) hold rank 0's second chunk 2n-1 against chunk 2n-2, adjacent, so
it is live whenever the window reaches one token beyond the query (every window that holds
more than the query itself).

A block's band is a `BandMask`: the positions (and THD sequence ids) of its queries and keys
plus the window, O(s_q + s_k), never the dense [s_q, s_k] mask until a kernel asks for it.

Kernels: on CUDA, `band_fwd` / `band_bwd` run the cuDNN frontend where it is installed and the
band is its diagonals (`cudnn_fe.py`: sbhd blocks as trimmed rectangles, THD whole sequences
at a level of size 1; the backward from the final output and LSE, no recompute), else
FlexAttention with the band as a block mask (`flex_band.py`: compute and memory follow the band;
tiles wholly outside it are skipped); on CPU, with `kernel="math"`, or where both fail for a
shape (one warning each, then the next one for that shape), exact float32 math with the dense
mask (O(s_q * s_k) memory per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from cpkit.attention import cudnn_fe, flex_band
from cpkit.attention.chunks import LocalSeq
from cpkit.attention.math_kernel import math_scores
from cpkit.attention.sink import apply_sink
from cpkit.attention.views import bhsd, from_bhsd
from cpkit.errors import CPConfigError
from cpkit.sharding import segments_to_index

__all__ = ["Window", "check_window", "Band", "BandMask", "band_fwd", "band_bwd"]


@dataclass(frozen=True)
class Window:
    """The band: keys from `left` tokens before a query to `right` after it (None: unbounded)."""

    left: Optional[int]
    right: Optional[int]


def _distance_range(window: Window, causal: bool) -> tuple[Optional[int], Optional[int]]:
    """(lowest, highest) query-minus-key position the window lets a query see; None: unbounded."""
    right = window.right
    return (0 if causal else (None if right is None else -right)), window.left


class BandMask:
    """The band of one block: query positions/sequence ids `q`, key positions/sequence ids `k`
    (each (index [n], seq id [n] or None)), the window and whether the mask is causal.
    `runs`: sbhd, the same positions as host runs ((global start, local start, length), ...)
    for queries and keys; `ragged`: THD blocks of whole sequences against themselves, (int32
    cu_seqlens, longest length). Kernels that take bands as diagonals (`cudnn_fe.py`) need one
    of them. `kernel_cache` holds what a kernel derives from the band (FlexAttention's block
    mask, cuDNN's rectangles), so that the backward reuses the forward's."""

    def __init__(self, q, k, window: Window, causal: bool, runs=None, ragged=None):
        self.q, self.k, self.window, self.causal = q, k, window, causal
        self.runs, self.ragged = runs, ragged
        self.kernel_cache: dict = {}

    @property
    def shape(self) -> tuple[int, int]:
        """(s_q, s_k): the block's query and key counts."""
        return self.q[0].numel(), self.k[0].numel()

    def distances(self) -> tuple[Optional[int], Optional[int]]:
        """(lowest, highest) query-minus-key position a query sees; None: unbounded."""
        return _distance_range(self.window, self.causal)

    def allows(self, q_idx, k_idx, q_seg=None, k_seg=None):
        """Whether queries at `q_idx` see keys at `k_idx` (broadcasting tensors)."""
        diff = q_idx - k_idx
        lo, hi = self.distances()
        ok = diff >= lo if lo is not None else diff == diff
        if hi is not None:
            ok = ok & (diff <= hi)
        if q_seg is not None:
            ok = ok & (q_seg == k_seg)
        return ok

    def dense(self) -> torch.Tensor:
        """The boolean mask [s_q, s_k] (True: attend)."""
        (q_idx, q_seg), (k_idx, k_seg) = self.q, self.k
        segs = (None, None) if q_seg is None else (q_seg.view(-1, 1), k_seg.view(1, -1))
        return self.allows(q_idx.view(-1, 1), k_idx.view(1, -1), *segs)


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


def _visible_offsets(chunk: torch.Tensor, size: int, window: Window, causal: bool) -> torch.Tensor:
    """Whether some query of chunk a sees some key of chunk b of the same sequence, for every
    chunk offset a - b = 1-2n .. 2n-1 of a level of `size` n ([4n-1] bool), given each
    sequence's chunk length `chunk` ([S] int64; at n == 1 the whole length). The offset's
    query-minus-key positions fill [delta*c - (c-1), delta*c + (c-1)] (all of them): visible iff
    that interval meets the window's [lo, hi] and c > 0 (empty chunks see nothing)."""
    delta = torch.arange(1 - 2 * size, 2 * size, device=chunk.device)
    c = chunk.to(torch.int64).view(-1, 1)
    ok = (c > 0).expand(-1, delta.numel())
    lo, hi = _distance_range(window, causal)
    if hi is not None:
        ok = ok & (delta * c - (c - 1) <= hi)
    if lo is not None:
        ok = ok & (delta * c + (c - 1) >= lo)
    return ok.any(0)


@lru_cache(maxsize=256)
def _sbhd_offsets(tokens: int, size: int, window: Window, causal: bool) -> tuple[bool, ...]:
    """`_visible_offsets` of an sbhd level: one chunk length, on the host."""
    chunk = tokens // 2 if size > 1 else tokens
    return tuple(_visible_offsets(torch.tensor([chunk]), size, window, causal).tolist())


def _held(rank: int, size: int) -> tuple[int, ...]:
    """The chunk ids `rank` holds at a level of `size` ranks (of 2*size chunks, or 1)."""
    return (rank, 2 * size - 1 - rank) if size > 1 else (0,)


class Band:
    """Band masks of this rank's queries against each rank's tokens at one CP level.

    `seq` describes the level (size, local tokens, THD offsets), `rank` this rank's position in
    it. Positions are global token indices (sbhd: in the sequence; THD: in the packed batch,
    with a sequence id per token so that sequences never see each other). Build one Band per
    attention call (the ring's forward and backward share it): THD liveness is read from the
    device once per Band."""

    def __init__(self, window: Window, causal: bool, seq: LocalSeq, rank: int, device, ring: bool = True):
        self.window, self.causal, self.seq, self.rank, self.device = window, causal, seq, rank, device
        self._q = self._tokens(rank)
        self._blocks: dict[int, BandMask] = {}
        self._offsets: Optional[tuple[bool, ...]] = None
        # A ring asks which blocks are live: start THD's copy now; all_gather never asks.
        self._pending = self._start_offsets() if ring else None

    def _ranges(self, rank: int) -> list[tuple[int, int]]:
        """sbhd: the global position ranges `rank` holds, in local order."""
        n, c = self.seq.size, self.seq.tokens // 2
        return [(0, self.seq.tokens)] if n == 1 else [(i * c, (i + 1) * c) for i in _held(rank, n)]

    def _runs(self, rank: int):
        """sbhd: `rank`'s tokens as runs (global start, local start, length); THD: None."""
        if self.seq.varlen:
            return None
        runs, local = [], 0
        for a, b in self._ranges(rank):
            runs.append((a, local, b - a))
            local += b - a
        return tuple(runs)

    def _ragged(self, natural_keys: bool):
        """THD at a level of size 1 against its own tokens: (int32 cu_seqlens, longest length)."""
        seq = self.seq
        if not seq.varlen or seq.size != 1 or not natural_keys:
            return None
        return seq.global_cu.to(self.device, torch.int32), int(seq.max_len)

    def _tokens(self, rank: int):
        seq = self.seq
        if not seq.varlen:
            ranges = self._ranges(rank)
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

    def _start_offsets(self):
        """THD over a ring: start the one device-to-host copy of the visible chunk offsets (a
        non-blocking copy and an event on CUDA, so the wait covers only the work queued before
        it, not the rank's own block computed meanwhile)."""
        seq = self.seq
        if not seq.varlen or seq.size == 1:  # sbhd: host arithmetic; one rank: only its own block
            return None
        cu = seq.global_cu
        visible = _visible_offsets((cu[1:] - cu[:-1]) // (2 * seq.size), seq.size, self.window, self.causal)
        if not visible.is_cuda:
            return visible, None
        host = torch.empty(visible.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(visible, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(visible.device))
        return host, event

    def _visible(self) -> tuple[bool, ...]:
        if self._offsets is None:
            if self._pending is None:
                self._pending = self._start_offsets()
            if self._pending is None:
                self._offsets = _sbhd_offsets(self.seq.tokens, self.seq.size, self.window, self.causal)
            else:
                visible, event = self._pending
                if event is not None:
                    event.synchronize()
                self._offsets, self._pending = tuple(visible.tolist()), None
        return self._offsets

    def live(self, src: int) -> bool:
        """Whether some query of this rank sees some token of rank `src` (THD: of the same
        sequence). The rank's own block is always live: the ring starts its running output
        there (a query sees itself, so it is dead only when the rank holds no tokens)."""
        if src == self.rank:
            return True
        n, visible = self.seq.size, self._visible()
        return any(visible[a - b + 2 * n - 1] for a in _held(self.rank, n) for b in _held(src, n))

    def block(self, src: int) -> Optional[BandMask]:
        """The band of this rank's queries against `src`'s tokens, or None when the whole block
        lies outside it."""
        if not self.live(src):
            return None
        if src not in self._blocks:  # the backward asks again: keep the kernel's derived masks
            runs = self._runs(src)
            self._blocks[src] = BandMask(self._q, self._tokens(src), self.window, self.causal,
                                         runs=None if runs is None else (self._runs(self.rank), runs),
                                         ragged=self._ragged(natural_keys=True))
        return self._blocks[src]

    def mask_for(self, keys) -> BandMask:
        """The band of this rank's queries against keys given as (global index, sequence id)
        (no host runs: kernels that need them fall back)."""
        return BandMask(self._q, keys, self.window, self.causal)

    def natural_mask(self, total: int) -> BandMask:
        """The band of this rank's queries against all `total` tokens of the level in natural
        order (all_gather's gathered keys)."""
        runs = None if self.seq.varlen else (self._runs(self.rank), ((0, 0, total),))
        return BandMask(self._q, self.natural_keys(total), self.window, self.causal, runs=runs,
                        ragged=self._ragged(natural_keys=self.seq.size == 1))

    def natural_keys(self, total: int):
        """(global index, sequence id) of all `total` tokens of the level in natural order."""
        index = torch.arange(total, device=self.device)
        if not self.seq.varlen:
            return index, None
        return index, torch.searchsorted(self.seq.global_cu.to(self.device), index, right=True) - 1


def _dense(x):
    return x if x.dim() == 4 else x.unsqueeze(1)  # THD [t, h, d] -> [t, 1, h, d]


def band_fwd(q, k, v, band: BandMask, scale: float, kernel: Optional[str] = None,
             sink: Optional[torch.Tensor] = None):
    """Attention of q over k/v where `band` allows it: (out like q with v's head dim, float32
    LSE [b, h, s] or [h, t]; -inf and zero output for rows that see no key). Kernels, in turn:
    the cuDNN frontend where the band is its diagonals (`cudnn_fe.expressible`), FlexAttention
    on CUDA, exact math (`kernel="math"` forces it). `sink` [h]: sink logits applied to this
    block as the whole attention (out and LSE include them; out is float32 when the sink was
    applied outside the kernel)."""
    got = None
    if cudnn_fe.usable(q, kernel) and cudnn_fe.expressible(band):
        got = cudnn_fe.try_run(cudnn_fe.band_fwd, _fe_key(q, k, v, band), q, k, v, band, scale, sink)
        if got is not None:
            return got
    if flex_band.wanted(q, kernel):
        got = flex_band.try_run(flex_band.fwd, q, k, v, band, scale)
    if got is None:
        got = _math_band_fwd(q, k, v, band.dense(), scale)
    return got if sink is None else apply_sink(*got, sink)


def band_bwd(dout, q, k, v, out, lse, band: BandMask, scale: float, kernel: Optional[str] = None):
    """(dq, dk, dv) in the dtypes of q, k, v of one band-masked block, given the FINAL out and
    LSE of the whole attention (a sink's included)."""
    if cudnn_fe.usable(q, kernel) and cudnn_fe.expressible(band):
        got = cudnn_fe.try_run(cudnn_fe.band_bwd, _fe_key(q, k, v, band) + ("bwd",), dout, q, k, v, out, lse,
                               band, scale)
        if got is not None:
            return got
    if flex_band.wanted(q, kernel):
        got = flex_band.try_run(flex_band.bwd, q, k, v, band, scale, dout, out, lse)
        if got is not None:
            return got
    return _math_band_bwd(dout, q, k, v, out, lse, band.dense(), scale)


def _fe_key(q, k, v, band: BandMask) -> tuple:
    """What a cuDNN refusal is remembered by: layout, dtype, head dims, GQA, band kind."""
    return ("band", q.dim(), q.dtype, q.shape[-1], v.shape[-1], q.shape[-2] != k.shape[-2],
            band.window, band.causal)


def _math_band_fwd(q, k, v, mask: torch.Tensor, scale: float):
    thd = q.dim() == 3
    qd, kd, vd = _dense(q), _dense(k), _dense(v)
    s, b, h, _ = qd.shape
    _, _, scores = math_scores(qd, kd, False, scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.nan_to_num(lse, neginf=0.0).unsqueeze(-1))
    out = torch.matmul(p, bhsd(vd.float()).unsqueeze(2))
    out = from_bhsd(out.reshape(b, h, s, -1)).to(q.dtype)
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
    qf, kf, scores = math_scores(q, k, False, scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.nan_to_num(lse.reshape(b, kv_heads, g, s), neginf=0.0)
    p = torch.exp(scores - lse.unsqueeze(-1))
    do = bhsd(dout.float()).reshape(b, kv_heads, g, s, -1)
    of = bhsd(out.float()).reshape(b, kv_heads, g, s, -1)
    vf = bhsd(v.float()).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - (do * of).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
    grads = (from_bhsd(dq.reshape(b, h, s, -1)).to(q.dtype), from_bhsd(dk).to(k.dtype), from_bhsd(dv).to(v.dtype))
    return tuple(x.squeeze(1) for x in grads) if thd else grads
