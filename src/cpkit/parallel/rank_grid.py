"""Rank arithmetic: the global ranks of every group a `CPLayout` implies, without processes.

Rank order is MCore's default "tp-cp-ep-dp-pp" with ep = 1: tp varies fastest, pp slowest,

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the groups here have the membership `parallel_state.initialize_model_parallel` gives, listed
in the same order (MCore's RankGenerator). Hierarchical CP groups split each CP group the way
MCore's `create_hierarchical_groups` (and TE) do: level 0 (a2a) is contiguous positions inside
the CP group, level 1 (p2p) is strided across them.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from cpkit.parallel.layout import CPLayout

__all__ = [
    "GROUP_KINDS",
    "groups_of_rank",
    "hierarchical_levels",
    "orthogonal_groups",
    "rank_coordinates",
    "rank_groups",
    "RANK_ORDER",
]

RANK_ORDER = ("tp", "cp", "dp", "pp")
"""Mesh axes from fastest to slowest varying (MCore's "tp-cp-ep-dp-pp" with ep = 1)."""

# Group kind -> the axes it spans. Kinds follow ProcessGroupCollection field names.
_AXES = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("cp", "dp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
}

GROUP_KINDS = tuple(_AXES) + ("embd", "pos_embd", "hcp_a2a", "hcp_p2p")
"""Every kind rank_groups() can return (hcp_* only for a2a+p2p layouts)."""


def _shape(layout: CPLayout) -> dict[str, int]:
    return {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}


def _strides(shape: dict[str, int]) -> dict[str, int]:
    strides, step = {}, 1
    for axis in RANK_ORDER:
        strides[axis] = step
        step *= shape[axis]
    return strides


def _index_tuples(sizes: Sequence[int]):
    """All index tuples over `sizes`, the first position varying fastest."""
    for rev in itertools.product(*(range(n) for n in reversed(sizes))):
        yield tuple(reversed(rev))


def orthogonal_groups(shape: dict[str, int], axes: Sequence[str]) -> list[list[int]]:
    """Groups spanning `axes` of a tp-cp-dp-pp mesh of `shape`.

    One group per combination of the other axes (the first of them varying fastest), members
    ordered with the first spanned axis fastest: MCore's RankGenerator.get_ranks order.
    """
    strides = _strides(shape)
    inner = [a for a in RANK_ORDER if a in axes]
    outer = [a for a in RANK_ORDER if a not in axes]
    groups = []
    for outer_idx in _index_tuples([shape[a] for a in outer]):
        base = sum(i * strides[a] for i, a in zip(outer_idx, outer))
        groups.append([
            base + sum(j * strides[a] for j, a in zip(inner_idx, inner))
            for inner_idx in _index_tuples([shape[a] for a in inner])
        ])
    return groups


def hierarchical_levels(cp_group: Sequence[int], sizes: Sequence[int]) -> list[list[list[int]]]:
    """Split one CP group (ranks in CP order) into the sub-groups of each hierarchy level.

    Level l groups positions that differ only in digit l of the mixed-radix position
    `p = d0 + sizes[0] * (d1 + sizes[1] * ...)`: level 0 is contiguous, level 1 strided by
    sizes[0]. Returns one list of groups per level.
    """
    if math.prod(sizes) != len(cp_group):
        raise ValueError(f"hierarchical sizes {list(sizes)} do not multiply to the CP group size {len(cp_group)}")
    levels = []
    for level in range(len(sizes)):
        stride = math.prod(sizes[:level])
        outer_sizes = [s for i, s in enumerate(sizes) if i != level]
        outer_strides = [math.prod(sizes[:i]) for i in range(len(sizes)) if i != level]
        groups = []
        for outer_idx in _index_tuples(outer_sizes):
            base = sum(i * st for i, st in zip(outer_idx, outer_strides))
            groups.append([cp_group[base + j * stride] for j in range(sizes[level])])
        levels.append(groups)
    return levels


def rank_groups(layout: CPLayout) -> dict[str, list[list[int]]]:
    """Every group of the layout, as lists of global ranks, keyed by kind.

    Kinds: tp, cp, dp, pp, mp (tp-pp), tp_cp, dp_cp, tp_dp_cp, embd (first and last pp stage of
    each pipeline, MCore's default), pos_embd (first stage), and for a2a+p2p hcp_a2a (level 0)
    and hcp_p2p (level 1), each listed CP group by CP group. Validates the layout first (raises
    CPConfigError).
    """
    layout.validate()
    shape = _shape(layout)
    out = {kind: orthogonal_groups(shape, axes) for kind, axes in _AXES.items()}
    out["embd"] = [[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in out["pp"]]
    out["pos_embd"] = [[p[0]] for p in out["pp"]]
    if layout.uses_hierarchical:
        sizes = layout.hierarchical_context_parallel_sizes
        a2a, p2p = [], []
        for cp_group in out["cp"]:
            level0, level1 = hierarchical_levels(cp_group, sizes)
            a2a += level0
            p2p += level1
        out["hcp_a2a"], out["hcp_p2p"] = a2a, p2p
    return out


def groups_of_rank(groups: dict[str, list[list[int]]], rank: int) -> dict[str, list[int]]:
    """For each kind, the group that holds `rank` (kinds where no group holds it are left out,
    e.g. embd on a middle pipeline stage)."""
    out = {}
    for kind, members in groups.items():
        for group in members:
            if rank in group:
                out[kind] = group
                break
    return out


def rank_coordinates(layout: CPLayout, rank: int) -> dict[str, int]:
    """This rank's index along each axis: {"tp": .., "cp": .., "dp": .., "pp": ..}."""
    shape = _shape(layout)
    strides = _strides(shape)
    return {axis: (rank // strides[axis]) % shape[axis] for axis in RANK_ORDER}
