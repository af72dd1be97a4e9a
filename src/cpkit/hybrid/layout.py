"""The two CP partition modes of a hybrid model and the routes between them.

Attention layers want **zigzag**: each sequence (padded to a multiple of 2*cp) is cut into 2*cp
chunks and rank r holds chunks r and 2cp-1-r, which balances the causal work (cpkit's attention
and TE take this layout: src/cpkit/sharding.py::thd_partition). Recurrent layers (gated delta net,
Mamba) want **contiguous**: rank r holds chunks 2r and 2r+1, the r-th of cp consecutive parts of
every sequence, so it continues the state of rank r-1. Both hold total/cp tokens on every rank.

A `Route` says, for one rank, which of its rows go to which rank and where the rows it receives
land; `build_routes` computes both directions once per batch (pure arithmetic on the padded
offsets, no communication), and every layer transition of that batch reuses them. `relayout`
moves a tensor along a route with one all-to-all and is differentiable: the backward sends the
gradient back along the inverse route.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import torch
import torch.distributed as dist

from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.group_info import group_device, group_size
from cpkit.sharding import thd_partition

__all__ = ["CpPartitionMode", "check_partition_lengths", "partition_indices", "Route", "HybridRoutes",
           "build_routes", "relayout"]


class CpPartitionMode(str, Enum):
    """How a sequence is spread over the CP ranks (Megatron-LM dev's names)."""

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


def check_partition_lengths(cu_seqlens: Sequence[int], cp_size: int) -> list[int]:
    """The offsets as a list after checking every sequence: a length the modes cannot split (not a
    multiple of 2*cp) raises one CPConfigError naming every such sequence, its length and the
    padding that fixes it."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    mult = 2 * cp_size if cp_size > 1 else 1  # cp 1 splits nothing
    bad = []
    if not cu or cu[0] != 0:
        bad.append(Violation("cu_seqlens", cu[:3], "must start at 0", "pass cumulative offsets [0, l0, l0 + l1, ...]"))
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        if b < a:
            bad.append(Violation(f"cu_seqlens (sequence {i})", b - a, "offsets must not decrease",
                                 "pass cumulative offsets [0, l0, l0 + l1, ...]"))
        elif (b - a) % mult:
            bad.append(Violation(
                f"cu_seqlens (sequence {i})", b - a,
                f"zigzag and contiguous need every sequence padded to a multiple of 2*cp = {mult}",
                f"pad sequence {i} by {-(b - a) % mult} token(s) to {b - a + (-(b - a) % mult)}; "
                "cpkit.sharding.pad_cu_seqlens(seq_lens, cp_size) builds padded offsets"))
    if bad:
        raise CPConfigError(bad)
    return cu


def partition_indices(mode: CpPartitionMode | str, cu_seqlens: Sequence[int], cp_rank: int, cp_size: int) -> torch.Tensor:
    """The global packed-token indices (int64, [total / cp]) rank `cp_rank` holds in `mode`, in its
    local order: per sequence, zigzag's chunks r and 2cp-1-r, contiguous's chunks 2r and 2r+1.
    `cu_seqlens`: the global padded offsets (sbhd: [0, seq_len])."""
    mode = CpPartitionMode(mode)
    cu = check_partition_lengths(cu_seqlens, cp_size)
    if mode is CpPartitionMode.ZIGZAG:
        return thd_partition(torch.tensor(cu, dtype=torch.int64), cp_rank, cp_size)
    parts = [torch.arange(a + cp_rank * (b - a) // cp_size, a + (cp_rank + 1) * (b - a) // cp_size)
             for a, b in zip(cu, cu[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class Route:
    """One rank's part of a relayout: send `x[send_index]` split by `send_splits` (one count per
    destination rank), receive `recv_splits` rows from each rank, and put received row i at
    local position `recv_index[i]`."""

    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_index: torch.Tensor

    def to(self, device: Any) -> "Route":
        return Route(self.send_index.to(device), self.send_splits, self.recv_splits, self.recv_index.to(device))


@dataclass(frozen=True)
class HybridRoutes:
    """Both directions for one batch and one rank: zigzag -> contiguous (`to_contiguous`), and back."""

    to_contiguous: Route
    to_zigzag: Route
    cp_size: int


def _route(src: list[torch.Tensor], dst: list[torch.Tensor], rank: int) -> Route:
    total = sum(int(s.numel()) for s in src)
    owner = torch.empty(total, dtype=torch.int64)
    position = torch.empty(total, dtype=torch.int64)
    for r, idx in enumerate(dst):
        owner[idx] = r
        position[idx] = torch.arange(idx.numel())
    size = len(src)
    dest = owner[src[rank]]
    send_index = torch.argsort(dest, stable=True)  # rows grouped by destination, local order kept
    send_splits = tuple(torch.bincount(dest, minlength=size).tolist())
    received = [idx[owner[idx] == rank] for idx in src]  # from each rank, in its send order
    recv_splits = tuple(int(r.numel()) for r in received)
    recv_index = position[torch.cat(received)]
    return Route(send_index, send_splits, recv_splits, recv_index)


def build_routes(cu_seqlens: Sequence[int], cp_rank: int, cp_size: int, device: Any = "cpu") -> HybridRoutes:
    """Both routes of rank `cp_rank` for a batch with global padded offsets `cu_seqlens` (sbhd:
    [0, seq_len]). Arithmetic only: call it once per batch and reuse it for every transition."""
    zig = [partition_indices(CpPartitionMode.ZIGZAG, cu_seqlens, r, cp_size) for r in range(cp_size)]
    con = [partition_indices(CpPartitionMode.CONTIGUOUS, cu_seqlens, r, cp_size) for r in range(cp_size)]
    return HybridRoutes(_route(zig, con, cp_rank).to(device), _route(con, zig, cp_rank).to(device), cp_size)


def _move(x: torch.Tensor, route: Route, group: Any) -> torch.Tensor:
    """Rows of `x` (dim 0) along `route`: one all-to-all over `group`, on the group's device."""
    device = group_device(group)
    rows = x.index_select(0, route.send_index.to(x.device)).contiguous().to(device)
    out_rows = rows.new_empty((sum(route.recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out_rows, rows, output_split_sizes=list(route.recv_splits),
                           input_split_sizes=list(route.send_splits), group=group)
    out = torch.empty_like(out_rows)
    out.index_copy_(0, route.recv_index.to(device), out_rows)
    return out.to(x.device)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, back, group):
        ctx.back, ctx.group = back, group
        return _move(x, route, group)

    @staticmethod
    def backward(ctx, grad):
        return _move(grad.contiguous(), ctx.back, ctx.group), None, None, None


def relayout(x: torch.Tensor, routes: HybridRoutes, to: CpPartitionMode | str, group: Any, seq_dim: int = 0) -> torch.Tensor:
    """`x` (this rank's rows along `seq_dim` in the other mode) in mode `to`: one all-to-all over
    the CP `group`, differentiable. Identity at cp 1. Raises CPConfigError when `x` does not hold
    this rank's total/cp rows or the group's size is not the routes'."""
    to = CpPartitionMode(to)
    size = group_size(group)
    route, back = ((routes.to_contiguous, routes.to_zigzag) if to is CpPartitionMode.CONTIGUOUS
                   else (routes.to_zigzag, routes.to_contiguous))
    problems = []
    if size != routes.cp_size:
        problems.append(Violation("group size", size, f"must be the routes' cp_size {routes.cp_size}",
                                  "build the routes with this CP group's size"))
    if x.shape[seq_dim] != route.send_index.numel():
        problems.append(Violation(f"x.shape[{seq_dim}]", x.shape[seq_dim],
                                  f"must be this rank's {route.send_index.numel()} tokens (total / cp)",
                                  "pass this rank's shard of the batch the routes were built for"))
    if problems:
        raise CPConfigError(problems)
    if size == 1:
        return x
    moved = _Relayout.apply(x.movedim(seq_dim, 0), route, back, group)
    return moved.movedim(0, seq_dim)

