"""Registry of the aligned CP groups a dynamic-CP plan can use, created once up front.

A plan names a group by (cp_size, first rank), positions in the DPxCP group. Process groups are
expensive and must be created collectively (every rank calls `new_group` for every group, in the
same order), so all of them are made once at start-up and looked up per micro-batch.

The rank arithmetic (`aligned_blocks`, `registry_layout`) is pure and tested without processes;
`build_group_registry` is the thin part that calls `torch.distributed.new_group`.

Two optional kinds of group per block, for layouts beyond tp = 1 with one comm type:
- with `tp_rank_lists` (the tensor-parallel groups of the world), the block's tp x cp group: the
  union of the tp groups of its ranks (what MCore's `pg_collection.tp_cp` is for a static CP group);
- with `hierarchical_sizes=[a2a, p2p]`, every block of size a2a * p2p also gets its a2a+p2p pair
  (`cpkit.parallel.rank_grid.hierarchical_levels`: a2a contiguous, p2p strided, as MCore and TE split a
  CP group); smaller blocks run a flat comm type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from cpkit.dynamic.plan import CPGroupAssignment
from cpkit.errors import CPConfigError

__all__ = [
    "BlockSpec",
    "GroupRegistry",
    "aligned_blocks",
    "build_group_registry",
    "registry_layout",
    "tp_cp_layout",
    "hierarchical_layout",
]


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


def aligned_blocks(
    dp_cp_size: int, min_cp_size: int = 1, max_cp_size: int | None = None
) -> list[tuple[int, int]]:
    """(cp_size, first position) of every aligned block a plan can use, sizes ascending, then
    first ascending. A block of size k starts at a multiple of k and ends at or before
    dp_cp_size; sizes are the powers of two from min_cp_size to max_cp_size (default: the
    largest that fits). E.g. dp_cp_size=6: (1,0)..(1,5), (2,0), (2,2), (2,4), (4,0).
    """
    if not (isinstance(dp_cp_size, int) and not isinstance(dp_cp_size, bool) and dp_cp_size >= 1):
        raise CPConfigError.single("dp_cp_size", dp_cp_size, "must be an int >= 1", "pass e.g. 8")
    largest = 1 << (dp_cp_size.bit_length() - 1)
    if not _is_pow2(min_cp_size) or min_cp_size > largest:
        raise CPConfigError.single(
            "min_cp_size", min_cp_size, f"must be a power of two in [1, {largest}]",
            f"pass a power of two <= the largest aligned group of dp_cp_size={dp_cp_size}",
        )
    top = largest if max_cp_size is None else max_cp_size
    if not _is_pow2(top) or not min_cp_size <= top <= largest:
        raise CPConfigError.single(
            "max_cp_size", max_cp_size, f"must be a power of two in [{min_cp_size}, {largest}]",
            "pass None for every size up to the largest aligned group",
        )
    blocks, size = [], min_cp_size
    while size <= top:
        blocks.extend((size, first) for first in range(0, dp_cp_size - size + 1, size))
        size *= 2
    return blocks


@dataclass(frozen=True)
class BlockSpec:
    """One group to create: which DPxCP replica, its (cp_size, first position), its global ranks."""

    replica: int
    cp_size: int
    first: int
    global_ranks: tuple[int, ...]


def registry_layout(
    dp_cp_rank_lists: Sequence[Sequence[int]], min_cp_size: int = 1, max_cp_size: int | None = None
) -> list[BlockSpec]:
    """Every group to create, in creation order, for all DPxCP groups of the world.

    `dp_cp_rank_lists[j]` lists the global ranks of DPxCP group j by position; every rank
    passes the same lists in the same order (torch.distributed.new_group must be called by all
    ranks for every group, in one order). Raises CPConfigError if the lists differ in length,
    repeat a rank, or are empty.
    """
    lists = [tuple(ranks) for ranks in dp_cp_rank_lists]
    if not lists or not lists[0]:
        raise CPConfigError.single(
            "dp_cp_rank_lists", [list(r) for r in lists], "must hold at least one non-empty list",
            "pass the global ranks of every DPxCP group, e.g. [[0, 1, 2, 3]]",
        )
    sizes = {len(r) for r in lists}
    if len(sizes) > 1:
        raise CPConfigError.single(
            "dp_cp_rank_lists", sorted(sizes), "all DPxCP groups must have the same size",
            "pass one list per DPxCP group of one parallel layout",
        )
    flat = [r for ranks in lists for r in ranks]
    if len(set(flat)) != len(flat):
        raise CPConfigError.single(
            "dp_cp_rank_lists", [list(r) for r in lists], "a global rank appears twice",
            "pass disjoint DPxCP groups",
        )
    blocks = aligned_blocks(len(lists[0]), min_cp_size, max_cp_size)
    return [
        BlockSpec(replica=j, cp_size=size, first=first, global_ranks=ranks[first:first + size])
        for j, ranks in enumerate(lists)
        for size, first in blocks
    ]


@dataclass(frozen=True)
class GroupRegistry:
    """The aligned CP groups of one DPxCP group, looked up by (cp_size, first position)."""

    dp_cp_ranks: tuple[int, ...]
    groups: Mapping[tuple[int, int], Any]
    tp_cp_groups: Mapping[tuple[int, int], Any] = field(default_factory=dict)
    """(cp_size, first) -> the block's tp x cp group (built only with tp_rank_lists)."""
    hcp_groups: Mapping[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    """(cp_size, first) -> (a2a, p2p) groups of this rank (built only with hierarchical_sizes)."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """The CP sizes available, ascending."""
        return tuple(sorted({size for size, _ in self.groups}))

    def get(self, cp_size: int, first_rank: int) -> Any:
        """The process group of block [first_rank, first_rank + cp_size) (DPxCP positions).

        Raises CPConfigError if no such block was created (unaligned, out of range, or a size
        outside the registry's sizes).
        """
        key = (cp_size, first_rank)
        if key not in self.groups:
            raise CPConfigError.single(
                "(cp_size, first_rank)", key,
                f"is not an aligned group of this registry (sizes {list(self.sizes)}, "
                f"dp_cp_size={len(self.dp_cp_ranks)})",
                "use a block from the plan, or build the registry with the sizes the plan uses",
            )
        return self.groups[key]

    def for_assignment(self, assignment: CPGroupAssignment) -> Any:
        """The process group of one plan group."""
        return self.get(assignment.cp_size, assignment.first_rank)

    def tp_cp_for(self, assignment: CPGroupAssignment) -> Any:
        """The tp x cp group of one plan group, or None when the registry has none for it."""
        return self.tp_cp_groups.get((assignment.cp_size, assignment.first_rank))

    def hcp_for(self, assignment: CPGroupAssignment) -> tuple[Any, Any] | None:
        """This rank's (a2a, p2p) groups of one plan group, or None when its block is flat."""
        return self.hcp_groups.get((assignment.cp_size, assignment.first_rank))

    def global_ranks(self, cp_size: int, first_rank: int) -> tuple[int, ...]:
        """Global ranks of block [first_rank, first_rank + cp_size)."""
        self.get(cp_size, first_rank)
        return self.dp_cp_ranks[first_rank:first_rank + cp_size]


def tp_cp_layout(layout: Sequence[BlockSpec], tp_rank_lists: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The distinct tp x cp groups of the blocks in `layout`, in creation order: each block's
    group is the sorted union of the tp groups of its ranks. Raises CPConfigError when a rank of a
    block is in no tp group, or a rank is in two."""
    owner: dict[int, tuple[int, ...]] = {}
    for ranks in tp_rank_lists:
        for r in ranks:
            if r in owner:
                raise CPConfigError.single("tp_rank_lists", [list(t) for t in tp_rank_lists],
                                           f"rank {r} is in two tp groups", "pass the disjoint tp groups of the world")
            owner[r] = tuple(ranks)
    out: list[tuple[int, ...]] = []
    for spec in layout:
        missing = [r for r in spec.global_ranks if r not in owner]
        if missing:
            raise CPConfigError.single("tp_rank_lists", [list(t) for t in tp_rank_lists],
                                       f"ranks {missing} are in no tp group", "pass every tp group of the world")
        union = tuple(sorted({m for r in spec.global_ranks for m in owner[r]}))
        if union not in out:
            out.append(union)
    return out


def hierarchical_layout(layout: Sequence[BlockSpec], sizes: Sequence[int]) -> list[tuple[BlockSpec, list[list[int]], list[list[int]]]]:
    """(block, a2a groups, p2p groups) of every block in `layout` whose size is the product of
    `sizes` = [a2a, p2p], in creation order. Raises CPConfigError unless sizes are two ints >= 2."""
    from cpkit.parallel.rank_grid import hierarchical_levels

    if not (len(sizes) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 2 for x in sizes)):
        raise CPConfigError.single("hierarchical_sizes", list(sizes), "must be [a2a, p2p], two ints >= 2",
                                   "pass e.g. [2, 2] for a2a+p2p on blocks of 4 ranks")
    product = sizes[0] * sizes[1]
    out = []
    for spec in layout:
        if spec.cp_size == product:
            a2a, p2p = hierarchical_levels(list(spec.global_ranks), list(sizes))
            out.append((spec, a2a, p2p))
    return out


def build_group_registry(
    dp_cp_rank_lists: Sequence[Sequence[int]],
    rank: int,
    *,
    min_cp_size: int = 1,
    max_cp_size: int | None = None,
    new_group: Callable[..., Any] | None = None,
    tp_rank_lists: Sequence[Sequence[int]] | None = None,
    hierarchical_sizes: Sequence[int] | None = None,
    **new_group_kwargs: Any,
) -> GroupRegistry:
    """Create every aligned CP group of every DPxCP group (collective: call on all ranks).

    Calls `new_group(ranks=[...], **new_group_kwargs)` once per `registry_layout` entry, in that
    order, and returns the registry of the DPxCP group that holds global `rank`.
    `new_group` defaults to torch.distributed.new_group (pass e.g. backend="gloo" through
    new_group_kwargs). With `tp_rank_lists` (every tp group of the world) it then creates each
    block's tp x cp group (tp_cp_layout); with `hierarchical_sizes=[a2a, p2p]` the a2a and p2p
    groups of every block of size a2a * p2p (hierarchical_layout). Raises CPConfigError if
    `rank` is in no DPxCP group, or for tp lists or sizes those functions reject.
    """
    lists = [tuple(ranks) for ranks in dp_cp_rank_lists]
    mine = [j for j, ranks in enumerate(lists) if rank in ranks]
    if not mine:
        raise CPConfigError.single(
            "rank", rank, "is in none of the DPxCP groups given",
            "pass every DPxCP group of the world, this rank's included",
        )
    layout = registry_layout(lists, min_cp_size, max_cp_size)
    if new_group is None:
        import torch.distributed as dist  # imported here: the arithmetic above needs no torch

        new_group = dist.new_group
    groups: dict[tuple[int, int], Any] = {}
    for spec in layout:
        group = new_group(ranks=list(spec.global_ranks), **new_group_kwargs)
        if spec.replica == mine[0]:
            groups[(spec.cp_size, spec.first)] = group
    tp_cp: dict[tuple[int, int], Any] = {}
    if tp_rank_lists is not None:
        made = {ranks: new_group(ranks=list(ranks), **new_group_kwargs) for ranks in tp_cp_layout(layout, tp_rank_lists)}
        owner = {r: tuple(t) for t in tp_rank_lists for r in t}
        for spec in layout:
            if spec.replica == mine[0]:
                union = tuple(sorted({m for r in spec.global_ranks for m in owner[r]}))
                tp_cp[(spec.cp_size, spec.first)] = made[union]
    hcp: dict[tuple[int, int], tuple[Any, Any]] = {}
    if hierarchical_sizes is not None:
        for spec, a2a_lists, p2p_lists in hierarchical_layout(layout, hierarchical_sizes):
            pair = [None, None]
            for level, lists_ in enumerate((a2a_lists, p2p_lists)):
                for ranks in lists_:
                    group = new_group(ranks=list(ranks), **new_group_kwargs)
                    if rank in ranks:
                        pair[level] = group
            if spec.replica == mine[0]:
                hcp[(spec.cp_size, spec.first)] = (pair[0], pair[1])
    return GroupRegistry(dp_cp_ranks=lists[mine[0]], groups=groups, tp_cp_groups=tp_cp, hcp_groups=hcp)
