"""`p2p`: ring attention over the load-balanced (2*cp chunk) layout.

Each rank keeps its queries and passes its KV around the ring: at step i it holds the KV of
rank src = rank - i and already sends it on while computing with it. With a causal mask the
2-chunk layout gives three cases, each half the work of a full block except the diagonal:
  step 0 (own KV)      causal attention over the local 2-chunk sequence;
  src < rank           all local queries vs the first KV chunk, no mask;
  src > rank           the second query chunk vs all KV, no mask.
Partial results are merged by log-sum-exp in fp32. Backward recomputes each step's block
with the saved final output and LSE, rotates KV around the ring again and sends each block's
dKV along with it (one step behind, in the same buffer), so the dKV of a block is complete
when it arrives back at its owner. dQ is accumulated locally in fp32; dKV travels and
accumulates in the input dtype, as in TE's ring (half the bytes of fp32; a bf16 dKV is rounded
once per hop, cp - 1 times in all). Every exchange moves one packed buffer (`_slots`).

Tensors are sequence-first: q [s, b, h, d] / [t, h, d], k/v with h_kv heads.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpkit.attention.chunks import LocalSeq
from cpkit.attention.comm import RingComm, group_size
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.attention.merge import merge_

__all__ = ["ring_attention", "ring_forward", "ring_backward"]


def _step_case(step: int, rank: int, causal: bool) -> str:
    """"diag", "full" (no mask, everything), "kv_first" (src < rank) or "q_second" (src > rank)."""
    if step == 0:
        return "diag" if causal else "full"
    if not causal:
        return "full"
    return "kv_first" if step <= rank else "q_second"


def _slots(*likes: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat buffer holding tensors shaped like `likes` back to back, and their views.

    Each ring step moves one such buffer, so every exchange is one NCCL send and one receive
    kernel, posted before the step's attention. Sent as separate tensors, the second tensor's
    kernel queued behind the first and could not start until the attention kernel, which fills
    every SM, was nearly done; the next step then waited for it (4x H200 profile, README)."""
    sizes = [t.numel() for t in likes]
    flat = torch.empty(sum(sizes), dtype=likes[0].dtype, device=likes[0].device)
    return flat, [part.view(t.shape) for part, t in zip(flat.split(sizes), likes)]


def _packed_kv(k: torch.Tensor, v: torch.Tensor, with_grads: bool = False):
    """`_slots` for (k, v) (and their gradient accumulators), k and v copied in."""
    flat, views = _slots(k, v, k, v) if with_grads else _slots(k, v)
    views[0].copy_(k)
    views[1].copy_(v)
    return flat, views


def _merge_block(out, lse, case: str, o, l, seq: LocalSeq) -> None:
    """Fold one step's block output and LSE into the running fp32 output and LSE."""
    if case == "q_second":
        seq.merge_(out, lse, 1, o, l)
    else:
        merge_(out, lse, o, l)


def _add_dq(dq, case: str, dq_b, seq: LocalSeq) -> None:
    """Add one step's dQ block into the fp32 dQ."""
    if case == "q_second":
        seq.add_(dq, 1, dq_b)
    else:
        dq.add_(dq_b)


def ring_forward(q, k, v, comm: Optional[RingComm], causal: bool, scale: float, seq: LocalSeq):
    """The ring's forward (no autograd): (output like q, fp32 LSE). `comm` None: local attention.
    Also the per-chunk step of `a2a.a2a_attention`.

    Each step posts the next exchange before merging the previous step's block: the exchange's
    NCCL kernel then starts while the merge runs instead of racing the attention kernel for SMs."""
    n, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if n == 1:  # one block: nothing to merge, no fp32 copy of the output
        out, lse = attn_fwd(q, k, v, causal, scale, **seq.kw("full", "full"))
        return out, lse.float().contiguous()
    buf, kv = _packed_kv(k, v)
    out = torch.empty_like(q, dtype=torch.float32)  # keeps q's (sequence-first) strides
    lse = block = None
    for step in range(n):
        pending = None
        if step + 1 < n:
            nxt, nxt_kv = _slots(k, v)
            pending = comm.exchange(buf, nxt)
        if block is not None:
            _merge_block(out, lse, *block, seq)
        case = _step_case(step, rank, causal)
        if case in ("diag", "full"):
            o, l = attn_fwd(q, kv[0], kv[1], case == "diag", scale, **seq.kw("full", "full"))
        elif case == "kv_first":
            o, l = attn_fwd(q, seq.take(kv[0], 0), seq.take(kv[1], 0), False, scale, **seq.kw("full", "half"))
        else:
            o, l = attn_fwd(seq.take(q, 1), kv[0], kv[1], False, scale, **seq.kw("half", "full"))
        if step == 0:
            out.copy_(o)
            lse = l.float().contiguous()
        else:
            block = (case, o, l)
        if pending is not None:
            pending.wait()
            buf, kv = nxt, nxt_kv
    _merge_block(out, lse, *block, seq)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, comm: Optional[RingComm], causal: bool, scale: float,
                  seq: LocalSeq):
    """The ring's backward from `ring_forward`'s output and LSE: (dq, dk, dv) in q's dtype.
    dout and out must be contiguous.

    One buffer [k, v, dk, dv] travels: at step s a rank sends the KV it just used and the dKV it
    finished accumulating at step s - 1 (TE's scheme), both in one exchange posted before the
    step's attention; it receives the next KV with the dKV of the block it is computing, and
    adds its share once the exchange is done. A last exchange takes every block's dKV home.
    The previous step's dQ is added after each post, giving the NCCL kernel its start."""
    n, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if n == 1:  # one block: the kernel's grads are the grads
        return attn_bwd(dout, q, k, v, out, lse, causal, scale, **seq.kw("full", "full"))
    kv_numel = k.numel() + v.numel()
    buf, views = _packed_kv(k, v, with_grads=True)
    dq = dq_block = None  # dq float32: local, so accumulating it exactly costs no communication
    for step in range(n):
        # kv part [0, kv_numel) but not after the last step; dKV part from the second step on.
        lo = 0 if step + 1 < n else kv_numel
        hi = 2 * kv_numel if step > 0 else kv_numel
        nxt, nxt_views = _slots(k, v, k, v)
        pending = comm.exchange(buf[lo:hi], nxt[lo:hi])
        if dq_block is not None:
            _add_dq(dq, *dq_block, seq)
        kk, vv = views[0], views[1]
        case = _step_case(step, rank, causal)
        if case in ("diag", "full"):
            dq_b, dk_b, dv_b = attn_bwd(dout, q, kk, vv, out, lse, case == "diag", scale,
                                        **seq.kw("full", "full"))
        elif case == "kv_first":
            dq_b, dk_b, dv_b = attn_bwd(dout, q, seq.take(kk, 0), seq.take(vv, 0), out, lse, False,
                                        scale, **seq.kw("full", "half"))
        else:
            dq_b, dk_b, dv_b = attn_bwd(
                seq.take(dout, 1), seq.take(q, 1), kk, vv, seq.take(out, 1),
                seq.take(lse, 1, dim=-1), False, scale, **seq.kw("half", "full"),
            )
        if step == 0:
            dq = dq_b.float()
        else:
            dq_block = (case, dq_b)
        pending.wait()
        # The received dKV is this step's block's (the previous ranks' shares); add ours. It
        # travels in the input dtype, as in TE's ring: half the bytes of fp32.
        dk_acc, dv_acc = nxt_views[2], nxt_views[3]
        if step == 0:
            dk_acc.copy_(dk_b)
            dv_acc.copy_(dv_b)
        elif case == "kv_first":
            seq.add_(dk_acc, 0, dk_b)
            seq.add_(dv_acc, 0, dv_b)
        else:
            dk_acc.add_(dk_b)
            dv_acc.add_(dv_b)
        buf, views = nxt, nxt_views
    home, (dk, dv) = _slots(k, v)
    pending = comm.exchange(buf[kv_numel:], home)  # the block's owner is the next rank
    _add_dq(dq, *dq_block, seq)
    pending.wait()
    return dq.to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, seq):
        comm = RingComm(group) if group_size(group) > 1 else None
        out, lse = ring_forward(q, k, v, comm, causal, scale, seq)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.scale, ctx.seq = comm, causal, scale, seq
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # cuDNN wants dout and out in one layout; both sequence-first contiguous here.
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out.contiguous(), lse, ctx.comm,
                                    ctx.causal, ctx.scale, ctx.seq)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: Optional[dist.ProcessGroup], causal: bool, scale: float,
                   seq: LocalSeq) -> torch.Tensor:
    """Ring (p2p) CP attention of this rank's shard; differentiable.

    q [s, b, h, d] or [t, h, d] (THD, `seq` carries the cu_seqlens), k/v with h_kv heads, all
    in the 2-chunk layout of `group` (None or size 1: plain local attention). Returns the
    output like q. Every rank of `group` must call it with the same shapes and flags.
    """
    return _RingAttention.apply(q, k, v, group, causal, scale, seq)
