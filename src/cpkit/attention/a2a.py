"""`a2a` (Ulysses): trade the sequence split for a head split with one all-to-all.

Before attention, one all-to-all over the a2a group (size A) sends head group j of q, k, v
(packed into one buffer) to rank j and receives every rank's sequence shard of this rank's
heads; the shards arrive in zigzag order and one index copy (`chunks.a2a_reorder`) puts them in
natural order (or, under `a2a+p2p`, in the zigzag layout of the p2p level), so the causal mask
is the plain one. Attention then runs over h/A heads (locally, or as a ring over the p2p group),
and a second all-to-all returns the output to the sequence split. Backward is the same two
all-to-alls in reverse. Needs h % A == 0 and h_kv % A == 0 (checked by the caller).

Tensors are sequence-first: q [s, b, h, d] / [t, h, d], k/v with h_kv heads.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpkit.attention.chunks import a2a_reorder, local_seq
from cpkit.attention.comm import all_to_all_seq, group_size
from cpkit.attention.p2p import ring_attention

__all__ = ["a2a_attention", "seq_to_heads", "heads_to_seq"]


def _split_heads(x: torch.Tensor, a: int) -> torch.Tensor:
    """[t, ..., h, d] -> [a, t, ..., h/a, d] view: head group first."""
    return x.unflatten(-2, (a, x.shape[-2] // a)).movedim(-3, 0)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[a, t, ..., h/a, d] -> [t, ..., h, d] (one copy)."""
    return x.movedim(0, -3).flatten(-3, -2)


def _pack_a2a(tensors, a: int, rows, group) -> torch.Tensor:
    """All-to-all of several [t, ..., h_i, d] tensors in one buffer; returns the received rows
    [a * t, ..., sum(h_i) / a, d] reordered by `rows`."""
    widths = [x.shape[-2] // a for x in tensors]
    first = tensors[0]
    send = first.new_empty((a, *first.shape[:-2], sum(widths), first.shape[-1]))
    start = 0
    for x, w in zip(tensors, widths):
        send[..., start:start + w, :].copy_(_split_heads(x, a))
        start += w
    recv = all_to_all_seq(send, group)
    return recv.flatten(0, 1).index_select(0, rows)


def _unpack_a2a(y: torch.Tensor, widths, a: int, inverse_rows, group):
    """Inverse of `_pack_a2a`: [a * t, ..., sum(w), d] rows -> list of [t, ..., w_i * a, d]."""
    send = y.index_select(0, inverse_rows).unflatten(0, (a, -1))
    recv = all_to_all_seq(send, group)
    outs, start = [], 0
    for w in widths:
        outs.append(_merge_heads(recv[..., start:start + w, :]))
        start += w
    return outs


def _split(y: torch.Tensor, widths):
    return tuple(y.split(widths, dim=-2))


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, rows, inverse_rows, *tensors):
        a = group_size(group)
        ctx.group, ctx.rows, ctx.inverse_rows = group, rows, inverse_rows
        ctx.widths = [x.shape[-2] // a for x in tensors]
        return _split(_pack_a2a(tensors, a, rows, group), ctx.widths)

    @staticmethod
    def backward(ctx, *grads):
        y = torch.cat([g.contiguous() for g in grads], dim=-2)
        outs = _unpack_a2a(y, ctx.widths, group_size(ctx.group), ctx.inverse_rows, ctx.group)
        return (None, None, None, *outs)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, rows, inverse_rows, y):
        ctx.group, ctx.rows, ctx.inverse_rows = group, rows, inverse_rows
        return _unpack_a2a(y, [y.shape[-2]], group_size(group), inverse_rows, group)[0]

    @staticmethod
    def backward(ctx, grad):
        a = group_size(ctx.group)
        return None, None, None, _pack_a2a([grad], a, ctx.rows, ctx.group)


def seq_to_heads(group: dist.ProcessGroup, rows: torch.Tensor, inverse_rows: torch.Tensor, *tensors):
    """Differentiable all-to-all: sequence-split [t, ..., h_i, d] tensors -> head-split
    [A * t, ..., h_i / A, d] in the row order `rows` (from `chunks.a2a_reorder`)."""
    return _SeqToHeads.apply(group, rows, inverse_rows, *tensors)


def heads_to_seq(group: dist.ProcessGroup, rows: torch.Tensor, inverse_rows: torch.Tensor,
                 y: torch.Tensor) -> torch.Tensor:
    """Inverse of `seq_to_heads` for one tensor: [A * t, ..., h / A, d] -> [t, ..., h, d]."""
    return _HeadsToSeq.apply(group, rows, inverse_rows, y)


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  a2a_group: Optional[dist.ProcessGroup], p2p_group: Optional[dist.ProcessGroup],
                  causal: bool, scale: float, cu_seqlens: Optional[torch.Tensor] = None,
                  max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Ulysses attention over `a2a_group`, with a ring over `p2p_group` in between (or local
    attention when p2p_group is None / of size 1); differentiable.

    q [s, b, h, d] or [t, h, d] (THD: `cu_seqlens` global padded offsets, `max_seqlen` their
    largest length, divisible by 2*cp), k/v with h_kv heads; this rank's shard of the whole CP
    group, whose position is p2p_rank * A + a2a_rank. Returns the output like q.
    """
    a, p = group_size(a2a_group), group_size(p2p_group)
    if a == 1:
        seq = local_seq(q.shape[0], p, cu_seqlens, max_seqlen)
        return ring_attention(q, k, v, p2p_group, causal, scale, seq)
    rows = a2a_reorder(q.shape[0], a, a * p, cu_seqlens, device=q.device)
    inverse_rows = torch.empty_like(rows)
    inverse_rows[rows] = torch.arange(rows.numel(), device=rows.device)
    qh, kh, vh = seq_to_heads(a2a_group, rows, inverse_rows, q, k, v)
    seq = local_seq(qh.shape[0], p, cu_seqlens, max_seqlen)
    out = ring_attention(qh, kh, vh, p2p_group, causal, scale, seq)
    return heads_to_seq(a2a_group, rows, inverse_rows, out)
