"""What every recurrent layer under CP shares (gdn.py, mamba.py): Megatron-LM's two modes, their
checks, and the collectives each mode is built from.

- chunkwise: `fold_earlier_ranks` (one all-gather of each rank's summary of its part, folded in
  rank order into the state entering this rank) and `causal_conv1d_cp` (the conv's halo of W-1
  tokens by one all-gather);
- headwise: `heads_in` / `heads_out` (one all-to-all each way between this rank's tokens of all
  heads and all tokens of H/cp heads, in sequence order by `gathered_order`).

Every collective is differentiable: its backward sends the gradients back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpkit.attention.comm import all_gather_seq
from cpkit.errors import Violation
from cpkit.hybrid.layout import CpPartitionMode, check_partition_lengths, partition_indices
from cpkit.parallel.group_info import group_device, group_rank, group_size

__all__ = ["LINEAR_CP_MODES", "mode_violations", "local_offsets", "fold_earlier_ranks", "causal_conv1d_cp",
           "heads_in", "heads_out", "gathered_order"]

LINEAR_CP_MODES = ("chunkwise", "headwise")


def mode_violations(mode: str, layout: CpPartitionMode, heads: int, cp: int) -> list[Violation]:
    """What is wrong with running a layer of `heads` heads in `mode` on rows in `layout` at `cp`."""
    problems = []
    if mode not in LINEAR_CP_MODES:
        problems.append(Violation("linear_cp_mode", mode, f"must be one of {LINEAR_CP_MODES}", "use 'chunkwise'"))
    elif mode == "chunkwise" and cp > 1 and layout is not CpPartitionMode.CONTIGUOUS:
        problems.append(Violation("layout", layout.value, "chunkwise CP continues the previous rank's state: "
                                  "its rows must be contiguous", "relayout(x, routes, 'contiguous', group) first"))
    if mode == "headwise" and heads % cp:
        problems.append(Violation("heads", heads, f"headwise CP splits heads over cp={cp}: must be divisible",
                                  f"use chunkwise, or a head count divisible by {cp}"))
    return problems


class _GatherThen(torch.autograd.Function):
    """`use(every)`, where `every` stacks every rank's x on a new dim 0 (one all-gather). The
    backward runs on every rank, also where `use` reads nothing gathered (rank 0 folds no earlier
    rank): it recomputes `use`, sums the gradients of every rank's entry with one all-reduce
    (gloo has it) and keeps this rank's. So the ranks always meet in the same collectives."""

    @staticmethod
    def forward(ctx, x, group, use):
        every = all_gather_seq(x.detach().unsqueeze(0).to(group_device(group)), group).to(x.device)
        ctx.group, ctx.use = group, use
        ctx.save_for_backward(every)
        return use(every)

    @staticmethod
    def backward(ctx, grad):
        (every,) = ctx.saved_tensors
        with torch.enable_grad():
            every = every.detach().requires_grad_(True)
            out = ctx.use(every)
            found = torch.autograd.grad(out, every, grad, allow_unused=True)[0] if out.requires_grad else None
        found = torch.zeros_like(every) if found is None else found
        found = found.contiguous().to(group_device(ctx.group))
        dist.all_reduce(found, group=ctx.group)
        return found[group_rank(ctx.group)].to(grad.device), None, None


class _AllToAll(torch.autograd.Function):
    """x [size, ...] with x[j] for rank j -> [size, ...] with entry j from rank j; backward: the same."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    device = x.device
    x = x.contiguous().to(group_device(group))
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out.to(device)


def local_offsets(cu_seqlens: Sequence[int], cp: int) -> list[int]:
    """This rank's offsets in the contiguous layout: each sequence contributes length / cp rows."""
    return [c // cp for c in cu_seqlens]


def fold_earlier_ranks(summary: torch.Tensor, group: Any, fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       state_shape: Sequence[int]) -> torch.Tensor:
    """The state entering this rank: from zeros of `state_shape`, `state = fold(part, state)` with
    the summary `part` of ranks 0, 1, ..., rank-1 in that order. `summary` is this rank's part
    (any tensor the same shape on every rank); one all-gather brings every rank's."""

    def entering(every: torch.Tensor) -> torch.Tensor:
        state = every.new_zeros(tuple(state_shape))
        for r in range(group_rank(group)):
            state = fold(every[r], state)
        return state

    return _GatherThen.apply(summary, group, entering)


def causal_conv1d_cp(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Sequence[int], group: Any) -> torch.Tensor:
    """Depthwise causal conv1d (weight [C, W]) of this rank's contiguous rows x [T_local, C], each
    sequence continuing the previous ranks' tokens: the halo of W-1 tokens comes by one all-gather."""
    cp, rank = group_size(group), group_rank(group)
    cu = check_partition_lengths(cu_seqlens, cp)
    local = local_offsets(cu, cp)
    width = weight.shape[1]
    spans = list(zip(local, local[1:]))
    tails = [x[max(b - (width - 1), a):b] for a, b in spans]  # the same length on every rank
    sizes = [tail.shape[0] for tail in tails]

    def halos(every: torch.Tensor) -> torch.Tensor:
        """[n_seq, W-1, C]: for each sequence, the last W-1 tokens of ranks 0..r-1 (zeros before its start)."""
        out, offset = [], 0
        for size in sizes:
            before = every[:rank, offset:offset + size].reshape(-1, every.shape[-1])[-(width - 1):]
            out.append(F.pad(before, (0, 0, width - 1 - before.shape[0], 0)))
            offset += size
        return torch.stack(out) if out else every.new_zeros((0, width - 1, every.shape[-1]))

    if cp > 1:
        halo = _GatherThen.apply(torch.cat(tails), group, halos)
    else:
        halo = x.new_zeros((len(spans), width - 1, x.shape[1]))
    outs = []
    for i, (a, b) in enumerate(spans):
        if a == b:  # an empty sequence: nothing to convolve (its halo is never read)
            outs.append(x[a:b])
            continue
        seq = torch.cat([halo[i], x[a:b]]).t().unsqueeze(0)  # [1, C, W-1 + L]
        outs.append(F.conv1d(seq, weight.unsqueeze(1), groups=weight.shape[0]).squeeze(0).t())
    return torch.cat(outs) if outs else x[:0]


def heads_in(x: torch.Tensor, cp: int, group: Any, order: torch.Tensor) -> torch.Tensor:
    """[T_local, H, ...] of this rank -> [T_global, H/cp, ...] in sequence order: rank j gets heads
    j*H/cp .. (j+1)*H/cp - 1 of every token."""
    t, h = x.shape[:2]
    parts = x.reshape(t, cp, h // cp, *x.shape[2:]).movedim(1, 0)  # [cp, T_local, H/cp, ...]
    return _AllToAll.apply(parts, group).reshape(cp * t, h // cp, *x.shape[2:]).index_select(0, order)


def heads_out(x: torch.Tensor, cp: int, group: Any, order: torch.Tensor) -> torch.Tensor:
    """The inverse of heads_in: [T_global, H/cp, ...] in sequence order -> [T_local, H, ...]."""
    rows = torch.empty_like(x).index_copy(0, order, x)  # back to the rank-major gathered order
    parts = rows.reshape(cp, x.shape[0] // cp, *x.shape[1:])
    back = _AllToAll.apply(parts, group)  # [cp (heads of rank j), T_local, H/cp, ...]
    return back.movedim(0, 1).reshape(x.shape[0] // cp, cp * x.shape[1], *x.shape[2:])


def gathered_order(cu: Sequence[int], cp: int, layout: CpPartitionMode, device) -> torch.Tensor:
    """For rows gathered rank-major from `layout`, the gathered position of each global token."""
    held = torch.cat([partition_indices(layout, cu, r, cp) for r in range(cp)])
    return torch.argsort(held).to(device)
