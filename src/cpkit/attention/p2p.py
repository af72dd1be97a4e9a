"""`p2p`: ring attention over the load-balanced (2*cp chunk) layout.

Each rank keeps its queries and passes KV around the ring: at forward step i it holds the KV of
rank src = rank - i and already sends it on while computing with it. With a causal mask the
2-chunk layout gives three cases, each half the work of a full block except the diagonal:
  src == rank          causal attention over the local 2-chunk sequence;
  src < rank           all local queries vs the first KV chunk, no mask;
  src > rank           the second query chunk vs all KV, no mask.
Partial results are merged by log-sum-exp in fp32.

Backward recomputes each block with the saved final output and LSE and runs the ring the other
way, as TE does: it starts from the KV the forward ended with (the next rank's, src = rank + 1)
and ends with the rank's own, so the dKV of a block, passed along with the KV one step behind,
is complete on its owner after the last step with no extra transfer. dQ is accumulated locally
in fp32; dKV travels and accumulates in the input dtype, as in TE's ring (half the bytes of
fp32; a bf16 dKV is rounded once per hop, cp - 1 times in all). Every exchange moves one packed
buffer, posted before the previous block's merge or dQ add: [k, v] forward, [k, v, dk, dv]
backward, flat one after the other (`RingKV`), so k and v keep their own head dims (MLA's
192 / 128 travel and compute as they are, not padded to one dim: padded, p2p MLA ran at
0.84-0.86x TE on 4x H100). One buffer is one NCCL send and one receive kernel: sent as separate tensors, the second
tensor's kernel queued behind the first and could not start until the attention kernel, which
fills every SM, was nearly done; the next step then waited for it (4x H200 profile, README).

Tensors are sequence-first: q [s, b, h, d] / [t, h, d], k/v with h_kv heads.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpkit.attention.band import Band, BandMask, band_bwd, band_fwd
from cpkit.attention.chunks import LocalSeq
from cpkit.attention.comm import RingComm, group_size
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.attention.merge import merge_
from cpkit.attention.options import CPAttentionOptions
from cpkit.attention.sink import apply_sink, sink_grad

__all__ = ["RingKV", "ring_attention", "ring_forward", "ring_backward", "kv_to_save", "kv_from_saved"]


class RingKV:
    """One flat buffer of k and v, and in backward their gradients: segments [k, v(, dk, dv)],
    each read as a view of its own shape (`kv[0]` is k, `kv[1]` v, `kv[2]` dk, `kv[3]` dv)."""

    def __init__(self, buf: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size):
        nk, nv = k_shape.numel(), v_shape.numel()
        self.buf, self.k_shape, self.v_shape = buf, k_shape, v_shape
        self.bounds = (0, nk, nk + nv, 2 * nk + nv, 2 * (nk + nv))

    @classmethod
    def pack(cls, k: torch.Tensor, v: torch.Tensor) -> "RingKV":
        return cls(torch.cat((k.reshape(-1), v.reshape(-1))), k.shape, v.shape)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.buf[self.bounds[i]:self.bounds[i + 1]].view(self.v_shape if i % 2 else self.k_shape)

    def segments(self, lo: int, hi: int) -> torch.Tensor:
        """Segments lo..hi-1 as one contiguous tensor (what one exchange sends)."""
        return self.buf[self.bounds[lo]:self.bounds[hi]]

    def empty(self, with_grads: bool = False) -> "RingKV":
        """A buffer of the same layout: [k, v], or [k, v, dk, dv] `with_grads`."""
        return RingKV(self.buf.new_empty(self.bounds[4 if with_grads else 2]), self.k_shape, self.v_shape)


def _block_case(src: int, rank: int, causal: bool, band: Optional[Band] = None):
    """"diag", "full" (no mask, everything), "kv_first" (src < rank) or "q_second" (src > rank)
    for this rank's queries against the KV of rank `src`; with a sliding window, the block's
    band (a `BandMask`) or "skip" when the block lies wholly outside the window."""
    if band is not None:
        mask = band.block(src)
        return "skip" if mask is None else mask
    if src == rank:
        return "diag" if causal else "full"
    if not causal:
        return "full"
    return "kv_first" if src < rank else "q_second"


def _attend_fwd(q, kv, case, scale: float, seq: LocalSeq, kernel):
    if isinstance(case, BandMask):
        return band_fwd(q, kv[0], kv[1], case, scale, kernel)
    if case in ("diag", "full"):
        return attn_fwd(q, kv[0], kv[1], case == "diag", scale, kernel=kernel, **seq.kw("full", "full"))
    if case == "kv_first":
        return attn_fwd(q, seq.take(kv[0], 0), seq.take(kv[1], 0), False, scale, kernel=kernel,
                        **seq.kw("full", "half"))
    return attn_fwd(seq.take(q, 1), kv[0], kv[1], False, scale, kernel=kernel, **seq.kw("half", "full"))


def _attend_bwd(dout, q, kv, out, lse, case, scale: float, seq: LocalSeq, kernel):
    if isinstance(case, BandMask):
        return band_bwd(dout, q, kv[0], kv[1], out, lse, case, scale, kernel)
    if case in ("diag", "full"):
        return attn_bwd(dout, q, kv[0], kv[1], out, lse, case == "diag", scale, kernel=kernel,
                        **seq.kw("full", "full"))
    if case == "kv_first":
        return attn_bwd(dout, q, seq.take(kv[0], 0), seq.take(kv[1], 0), out, lse, False, scale,
                        kernel=kernel, **seq.kw("full", "half"))
    return attn_bwd(seq.take(dout, 1), seq.take(q, 1), kv[0], kv[1], seq.take(out, 1),
                    seq.take(lse, 1, dim=-1), False, scale, kernel=kernel, **seq.kw("half", "full"))


def _merge_block(out, lse, case, o, l, seq: LocalSeq) -> None:
    """Fold one block's output and LSE into the running fp32 output and LSE."""
    if isinstance(case, str) and case == "q_second":
        seq.merge_(out, lse, 1, o, l)
    else:
        merge_(out, lse, o, l)


def _add_block(acc, case, grad, seq: LocalSeq, part_of: str) -> None:
    """Add one block's gradient into `acc`: the second query chunk's rows for dQ of a
    "q_second" block, the first KV chunk's rows for dKV of a "kv_first" block, else all."""
    case = case if isinstance(case, str) else "band"
    if part_of == "q" and case == "q_second":
        seq.add_(acc, 1, grad)
    elif part_of == "kv" and case == "kv_first":
        seq.add_(acc, 0, grad)
    else:
        acc.add_(grad)


def ring_forward(q, k, v, comm: Optional[RingComm], causal: bool, scale: float, seq: LocalSeq,
                 kernel: Optional[str] = None, band: Optional[Band] = None,
                 sink: Optional[torch.Tensor] = None):
    """The ring's forward (no autograd): (output like q, fp32 LSE, what `ring_backward` needs
    of k and v: the packed `RingKV` the forward ended with (the next rank's), or (k, v)
    without a ring). `comm` None: local attention. `kernel`: `CPAttentionOptions.kernel`.
    `band`: sliding-window masks of this level (blocks outside the window are skipped).
    `sink`: per-head sink logits of q's heads, applied once after the last merge (the output
    and LSE returned include it). Also the
    per-chunk step of `a2a.a2a_attention`."""
    n, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if n == 1:  # one block: nothing to merge, no fp32 copy of the output; the kernel takes the sink
        if band is not None:
            out, lse = band_fwd(q, k, v, band.block(rank), scale, kernel, sink=sink)
        else:
            out, lse = attn_fwd(q, k, v, causal, scale, kernel=kernel, sink=sink, **seq.kw("full", "full"))
        return out.to(q.dtype), lse.float().contiguous(), (k, v)
    kv = RingKV.pack(k, v)  # one kernel packs what the first exchange sends
    out = lse = block = None
    for step in range(n):
        pending = None
        if step + 1 < n:
            nxt = kv.empty()
            pending = comm.exchange(kv.buf, nxt.buf)
        if block is not None:  # after the post: the exchange starts while this merge runs
            if out.dtype != torch.float32:  # more merges to come: accumulate in fp32
                out = out.float()
            _merge_block(out, lse, *block, seq)
        case = _block_case((rank - step) % n, rank, causal, band)
        block = None
        if step == 0:
            # The first block's own output is the running one: a ring of 2 merges once, into
            # it (merge_ computes in fp32 and rounds once), with no fp32 copy of the output.
            # The own block always has keys (a query sees itself), so it is never skipped.
            out, lse = _attend_fwd(q, kv, case, scale, seq, kernel)
            lse = lse.float().contiguous()
        elif not _skipped(case):
            block = (case, *_attend_fwd(q, kv, case, scale, seq, kernel))
        if pending is not None:
            pending.wait()
            kv = nxt
    if block is not None:
        _merge_block(out, lse, *block, seq)
    if sink is not None:
        out, lse = apply_sink(out, lse, sink)
    return out.to(q.dtype), lse, kv


def _skipped(case) -> bool:
    return isinstance(case, str) and case == "skip"


def ring_backward(dout, q, kv, out, lse, comm: Optional[RingComm], causal: bool, scale: float,
                  seq: LocalSeq, kernel: Optional[str] = None, band: Optional[Band] = None):
    """The ring's backward from `ring_forward`'s output, LSE and `kv` (its third result):
    (dq, dk, dv) in q's dtype.

    Step s computes against the KV of src = rank + s + 1, so the last step is the rank's own
    block. One buffer [k, v, dk, dv] travels to the previous rank: at step s it carries the KV
    for the next step and the dKV accumulated at step s - 1, posted before the step's attention;
    it brings the next KV and the dKV of the block being computed, to which this rank adds its
    share once the exchange is done. `out` and `lse` are ring_forward's (a sink included), so
    the blocks' probabilities are the final ones; blocks `band` skips add nothing."""
    # cuDNN wants dout and out in one layout: both sequence-first contiguous.
    dout, out = dout.contiguous(), out.contiguous()
    n, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if n == 1:  # one block: the kernel's grads are the grads
        if band is not None:
            return band_bwd(dout, q, kv[0], kv[1], out, lse, band.block(rank), scale, kernel)
        return attn_bwd(dout, q, kv[0], kv[1], out, lse, causal, scale, kernel=kernel, **seq.kw("full", "full"))
    buf = kv  # [k, v] now (a RingKV); [k, v, dk, dv] from the first exchange on
    dq = dq_block = None  # dq float32: local, so accumulating it exactly costs no communication
    for step in range(n):
        # KV for the next step but not at the last one; dKV from the second step on.
        lo, hi = (0 if step + 1 < n else 2), (4 if step > 0 else 2)
        nxt = kv.empty(with_grads=True)
        pending = comm.exchange(buf.segments(lo, hi), nxt.segments(lo, hi), reverse=True)
        if dq_block is not None:  # after the post: the exchange starts while this add runs
            _add_block(dq, *dq_block, seq, "q")
        case = _block_case((rank + step + 1) % n, rank, causal, band)
        skip = _skipped(case)  # outside the window: no grads, the dKV passes on unchanged
        if not skip:
            dq_b, dk_b, dv_b = _attend_bwd(dout, q, buf, out, lse, case, scale, seq, kernel)
        partial = isinstance(case, str) and case in ("q_second", "kv_first", "skip")
        if step == 0 and not skip and not (isinstance(case, str) and case == "q_second"):
            dq = dq_b.float()
        elif step == 0:  # the first block covers only the second query chunk, or nothing
            dq = torch.zeros_like(q, dtype=torch.float32)
            if not skip:
                _add_block(dq, case, dq_b, seq, "q")
        dq_block = None if step == 0 or skip else (case, dq_b)
        pending.wait()
        # The received dKV is this block's, with the shares of the ranks before; add ours.
        dk_acc, dv_acc = nxt[2], nxt[3]
        if step == 0 and not partial:  # the first share of this block covers it all
            dk_acc.copy_(dk_b)
            dv_acc.copy_(dv_b)
        else:
            if step == 0:
                dk_acc.zero_()
                dv_acc.zero_()
            if not skip:
                _add_block(dk_acc, case, dk_b, seq, "kv")
                _add_block(dv_acc, case, dv_b, seq, "kv")
        buf = nxt
    if dq_block is not None:
        _add_block(dq, *dq_block, seq, "q")
    return dq.to(q.dtype), dk_acc, dv_acc


def kv_to_save(kv) -> tuple[list[torch.Tensor], Optional[tuple]]:
    """`ring_forward`'s KV result as (tensors for save_for_backward, the packed layout: (k shape,
    v shape) of a RingKV, None for a plain (k, v))."""
    if isinstance(kv, RingKV):
        return [kv.buf], (kv.k_shape, kv.v_shape)
    return list(kv), None


def kv_from_saved(tensors, layout: Optional[tuple]):
    """The inverse of `kv_to_save`."""
    return RingKV(tensors[0], *layout) if layout is not None else tuple(tensors)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, group, causal, scale, seq, options, window):
        size = group_size(group)
        comm = RingComm(group, options.ring_batched(size)) if size > 1 else None
        band = None if window is None else Band(window, causal, seq, comm.rank if comm else 0, q.device)
        out, lse, kv = ring_forward(q, k, v, comm, causal, scale, seq, options.kernel, band, sink)
        kv_tensors, ctx.kv_layout = kv_to_save(kv)
        ctx.save_for_backward(q, out, lse, sink, *kv_tensors)
        ctx.setup = (comm, causal, scale, seq, options.kernel, band)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, sink, *kv_tensors = ctx.saved_tensors
        kv = kv_from_saved(kv_tensors, ctx.kv_layout)
        comm, causal, scale, seq, kernel, band = ctx.setup
        dq, dk, dv = ring_backward(dout, q, kv, out, lse, comm, causal, scale, seq, kernel, band)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_grad(dout, out, lse, sink).to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: Optional[dist.ProcessGroup], causal: bool, scale: float,
                   seq: LocalSeq, options: CPAttentionOptions, window=None,
                   sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ring (p2p) CP attention of this rank's shard; differentiable.

    q [s, b, h, d] or [t, h, d] (THD, `seq` carries the cu_seqlens), k/v with h_kv heads, all
    in the 2-chunk layout of `group` (None or size 1: plain local attention). Returns the
    output like q. `window` (`band.Window`): sliding window; `sink` [h]: sink logits (the
    gradient flows to it). Every rank of `group` must call it with the same shapes, flags and
    options.
    """
    return _RingAttention.apply(q, k, v, sink, group, causal, scale, seq, options, window)
