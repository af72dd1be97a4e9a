"""`p2p`: ring attention over the load-balanced (2*cp chunk) layout.

Each rank keeps its queries and passes its KV around the ring: at step i it holds the KV of
rank src = rank - i and already sends it on while computing with it. With a causal mask the
2-chunk layout gives three cases, each half the work of a full block except the diagonal:
  step 0 (own KV)      causal attention over the local 2-chunk sequence;
  src < rank           all local queries vs the first KV chunk, no mask;
  src > rank           the second query chunk vs all KV, no mask.
Partial results are merged by log-sum-exp in fp32. Backward recomputes each step's block
with the saved final output and LSE, rotates KV around the ring again and sends each block's
dKV along with it, so the dKV of a block is complete when it arrives back at its owner. dQ is
accumulated locally in fp32; dKV travels and accumulates in the input dtype, as in TE's ring
(half the bytes of fp32; a bf16 dKV is rounded once per hop, cp - 1 times in all).

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


def _buffer(x: torch.Tensor) -> torch.Tensor:
    """A contiguous receive buffer shaped like x (x may be a strided view, e.g. of packed QKV)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def ring_forward(q, k, v, comm: Optional[RingComm], causal: bool, scale: float, seq: LocalSeq):
    """The ring's forward (no autograd): (output like q, fp32 LSE). `comm` None: local attention.
    Also the per-chunk step of `a2a.a2a_attention`."""
    n, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if n == 1:  # one block: nothing to merge, no fp32 copy of the output
        out, lse = attn_fwd(q, k, v, causal, scale, **seq.kw("full", "full"))
        return out, lse.float().contiguous()
    kv = (k, v)  # sent as two tensors of one batch: no packing copy
    out = torch.empty_like(q, dtype=torch.float32)  # keeps q's (sequence-first) strides
    lse = None
    for step in range(n):
        pending = None
        if step + 1 < n:
            nxt = (_buffer(k), _buffer(v))
            pending = comm.exchange(kv, nxt)
        case = _step_case(step, rank, causal)
        if case in ("diag", "full"):
            o, l = attn_fwd(q, kv[0], kv[1], case == "diag", scale, **seq.kw("full", "full"))
            if step == 0:
                out.copy_(o)
                lse = l.float().contiguous()
            else:
                merge_(out, lse, o, l)
        elif case == "kv_first":
            o, l = attn_fwd(q, seq.take(kv[0], 0), seq.take(kv[1], 0), False, scale, **seq.kw("full", "half"))
            merge_(out, lse, o, l)
        else:
            o, l = attn_fwd(seq.take(q, 1), kv[0], kv[1], False, scale, **seq.kw("half", "full"))
            seq.merge_(out, lse, 1, o, l)
        if pending is not None:
            pending.wait()
            kv = nxt
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, comm: Optional[RingComm], causal: bool, scale: float,
                  seq: LocalSeq):
    """The ring's backward from `ring_forward`'s output and LSE: (dq, dk, dv) in q's dtype.
    dout and out must be contiguous."""
    n, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    if n == 1:  # one block: the kernel's grads are the grads
        return attn_bwd(dout, q, k, v, out, lse, causal, scale, **seq.kw("full", "full"))
    kv = (k, v)
    dq = None  # float32: local, so accumulating it exactly costs no communication
    dkv = dkv_pending = nxt_dkv = None
    for step in range(n):
        pending = None
        if step + 1 < n:
            nxt = (_buffer(k), _buffer(v))
            pending = comm.exchange(kv, nxt, tag=0)
        case = _step_case(step, rank, causal)
        if case in ("diag", "full"):
            dq_b, dk_b, dv_b = attn_bwd(dout, q, kv[0], kv[1], out, lse, case == "diag", scale,
                                        **seq.kw("full", "full"))
        elif case == "kv_first":
            dq_b, dk_b, dv_b = attn_bwd(dout, q, seq.take(kv[0], 0), seq.take(kv[1], 0), out, lse, False,
                                        scale, **seq.kw("full", "half"))
        else:
            dq_b, dk_b, dv_b = attn_bwd(
                seq.take(dout, 1), seq.take(q, 1), kv[0], kv[1], seq.take(out, 1),
                seq.take(lse, 1, dim=-1), False, scale, **seq.kw("half", "full"),
            )
        if step == 0:
            dq = dq_b.float()
        elif case == "q_second":
            seq.add_(dq, 1, dq_b)
        else:
            dq.add_(dq_b)
        # This block's dKV travels with it, in the input dtype (as TE's ring does: half the bytes
        # of fp32): started by its owner at step 0, accumulated by every rank since, complete
        # when it arrives back at its owner after the last step.
        if step == 0:
            dkv = (dk_b, dv_b)
        else:
            dkv_pending.wait()
            dkv = nxt_dkv
            if case == "kv_first":
                seq.add_(dkv[0], 0, dk_b)
                seq.add_(dkv[1], 0, dv_b)
            else:
                dkv[0].add_(dk_b)
                dkv[1].add_(dv_b)
        nxt_dkv = (_buffer(k), _buffer(v))
        dkv_pending = comm.exchange(dkv, nxt_dkv, tag=1)
        if pending is not None:
            pending.wait()
            kv = nxt
    dkv_pending.wait()  # the last send brings every rank its own block's dKV
    return dq.to(q.dtype), nxt_dkv[0], nxt_dkv[1]


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
