"""Facts about process groups, defined once: look-up, size, rank, global ranks, and the a2a+p2p check.

Every layer of cpkit (attention, groups, rebinding, eval and dynamic CP) reads groups through
these functions. A group is a `torch.distributed.ProcessGroup`, None (no group: size 1), or, for
a2a+p2p, the two-level list `[a2a_group, p2p_group]` (TE's convention; size = the product).
Fields of a ProcessGroupCollection are read with `cpkit.compat.get_pg` (None when unset, on
every MCore). Nothing here imports megatron-core at import time: the functional attention
path imports this module.
`check_hierarchical_groups` is the one validity check of `[a2a, p2p]` groups; the attention
module, the functional entry point, TE binding, the build-time gate and eval CP all call it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.layout import A2A_P2P

__all__ = [
    "group_size",
    "group_rank",
    "global_ranks",
    "members",
    "group_device",
    "uses_hierarchical",
    "check_hierarchical_groups",
    "require_hierarchical_groups",
]

_BUILD_FIX = ("build the collection with cpkit.parallel.groups.build_pg_collection(layout), or call "
              "initialize_model_parallel(..., hierarchical_context_parallel_sizes=[a2a, p2p]) "
              "and ProcessGroupCollection.use_mpu_process_groups()")


def group_size(group: Any) -> int:
    """Size of `group`: 1 for None (no group), the product for a hierarchical [a2a, p2p] list,
    else `group.size()`."""
    if group is None:
        return 1
    if isinstance(group, (list, tuple)):
        return math.prod(group_size(g) for g in group)
    return int(group.size())


def group_rank(group: Any) -> int:
    """This process's rank in `group` (0 for None). CP chunks are ordered by it; new_group sorts
    the ranks it is given, so read it from the group rather than from a rank list."""
    return 0 if group is None else int(group.rank())


def global_ranks(group: Any) -> Optional[list[int]]:
    """Global ranks of `group` in group-rank order, None for None."""
    if group is None:
        return None
    return list(dist.get_process_group_ranks(group))


def members(group: Any) -> Optional[tuple]:
    """Sorted global ranks of `group` (a tuple per level for a [a2a, p2p] list), None for None:
    what two groups are compared by when their objects differ."""
    if group is None:
        return None
    if isinstance(group, (list, tuple)):
        return tuple(members(g) for g in group)
    return tuple(sorted(global_ranks(group)))


def group_device(group: Any) -> torch.device:
    """The device of a tensor handed to a collective over `group`: the current CUDA device for an
    NCCL group (NCCL refuses CPU tensors; so does any group without a CPU backend), else cpu (gloo
    moves CPU tensors, also on a host with GPUs). None means the default group; without one, cpu.
    For a hierarchical [a2a, p2p] list, its first level's (both share a backend).

    Take a collective's device from here, never from the data it reduces: that data can be empty
    on some ranks (a pipeline stage other than the last has no losses), and a device taken from
    it then falls back to cpu where the group needs cuda.
    """
    if isinstance(group, (list, tuple)):
        group = group[0] if group else None
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return torch.device("cpu")
        group = dist.group.WORLD
    try:
        backend = str(dist.get_backend(group))  # "gloo", "nccl", "cpu:gloo,cuda:nccl"
    except ValueError:  # a group torch.distributed does not list (cpkit.testing.fakes)
        backend = group._get_backend_name()
    if "nccl" in backend or all(d.type != "cpu" for d in group._device_types):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def uses_hierarchical(cp_comm_type: Any) -> bool:
    """True when `cp_comm_type` (a string, or MCore's per-layer list) uses a2a+p2p."""
    if isinstance(cp_comm_type, str):
        return cp_comm_type == A2A_P2P
    return isinstance(cp_comm_type, (list, tuple)) and A2A_P2P in cp_comm_type


def _describe(hcp: Any) -> Any:
    if isinstance(hcp, (list, tuple)):
        return [g.size() if isinstance(g, dist.ProcessGroup) else type(g).__name__ for g in hcp]
    return type(hcp).__name__


def check_hierarchical_groups(
    hcp: Any,
    cp: Any = None,
    *,
    source: str = "pg_collection.hcp",
    sizes: Optional[Sequence[int]] = None,
    fix: str = _BUILD_FIX,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The one validity check of hierarchical CP groups; returns (a2a_group, p2p_group).

    `hcp` must be exactly two process groups [a2a, p2p] of this rank (TE's convention). With
    `cp` (this rank's CP group) their sizes must multiply to its size, and the a2a group must be
    a contiguous, aligned block of CP positions holding this rank and the p2p group the positions
    strided by the a2a size through it, so that a rank's CP position is
    p2p_rank * a2a_size + a2a_rank. With `sizes` (the configured
    hierarchical_context_parallel_sizes) the group sizes must equal them. Without `cp` only the
    shape is checked (cheap enough for every forward). Raises CPConfigError naming `source`
    and listing every problem: without this check, a2a+p2p without usable groups would attend
    to the local chunk only.
    """
    if hcp is None:
        raise CPConfigError.single(source, None, "a2a+p2p needs hierarchical CP groups [a2a, p2p]; MCore's "
                                   "decentralized path leaves hcp unset", fix)
    if (not isinstance(hcp, (list, tuple)) or len(hcp) != 2
            or not all(isinstance(g, dist.ProcessGroup) for g in hcp)):
        raise CPConfigError.single(
            source, _describe(hcp),
            "a2a+p2p needs exactly two groups, a two-level list [a2a_group, p2p_group] of process "
            "groups of this rank (TE's convention: level 0 contiguous ranks, level 1 strided)", fix)
    a2a, p2p = hcp
    found: list[Violation] = []
    got = [a2a.size(), p2p.size()]
    if cp is not None and got[0] * got[1] != group_size(cp):
        found.append(Violation(source, got, f"the group sizes {got[0]}*{got[1]} must multiply to the cp "
                               f"group size {group_size(cp)}", fix))
    if sizes is not None and list(sizes) != got:
        found.append(Violation("hierarchical_context_parallel_sizes", list(sizes),
                               f"{source} has sizes {got}; they must match",
                               "build the groups from the same layout as the attention"))
    if not found and cp is not None:
        found += _membership_violations(cp, a2a, p2p, source)
    if found:
        raise CPConfigError(found)
    return a2a, p2p


def _membership_violations(cp: Any, a2a: Any, p2p: Any, source: str) -> list[Violation]:
    """a2a = a contiguous, aligned block of CP positions holding this rank; p2p = the positions
    strided by the a2a size through this rank (MCore's and TE's convention)."""
    cp_ranks, a2a_ranks, p2p_ranks = global_ranks(cp), sorted(global_ranks(a2a)), sorted(global_ranks(p2p))
    me = dist.get_rank()
    fix = "build the groups with cpkit.parallel.groups.build_pg_collection(layout) (level 0 contiguous, level 1 strided)"
    if not set(a2a_ranks) | set(p2p_ranks) <= set(cp_ranks):
        return [Violation(source, [a2a_ranks, p2p_ranks], f"both groups must lie inside the CP group {cp_ranks}", fix)]
    pos = {r: i for i, r in enumerate(cp_ranks)}
    if me not in pos or me not in a2a_ranks or me not in p2p_ranks:
        return [Violation(source, [a2a_ranks, p2p_ranks],
                          f"rank {me} must be in its CP group {cp_ranks} and in both hcp groups", fix)]
    out = []
    n = len(a2a_ranks)
    start = pos[me] - pos[me] % n
    if [pos[r] for r in a2a_ranks] != list(range(start, start + n)):
        out.append(Violation(source, [a2a_ranks, p2p_ranks],
                             f"the a2a group (level 0) must be CP positions {start}..{start + n - 1} "
                             f"of CP group {cp_ranks}", fix))
    first = pos[me] % n
    if [pos[r] for r in p2p_ranks] != list(range(first, len(cp_ranks), n)):
        out.append(Violation(source, [a2a_ranks, p2p_ranks],
                             f"the p2p group (level 1) must be CP positions {first}, {first}+{n}, ... "
                             f"of CP group {cp_ranks}", fix))
    return out


def require_hierarchical_groups(
    pg_collection: Any,
    cp_comm_type: Any,
    *,
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None,
):
    """The build-time gate for a2a+p2p: return (a2a_group, p2p_group) of `pg_collection.hcp`,
    or None when `cp_comm_type` (a string or per-layer list) does not use a2a+p2p.

    Raises CPConfigError, listing every problem, when cp or hcp is missing (MCore's
    decentralized path leaves hcp unset) or hcp fails check_hierarchical_groups against cp and
    `hierarchical_context_parallel_sizes`.
    """
    if not uses_hierarchical(cp_comm_type):
        return None
    from cpkit.compat import get_pg  # imports megatron-core

    cp = get_pg(pg_collection, "cp")
    hcp = get_pg(pg_collection, "hcp")
    if cp is None:
        missing = [Violation("pg_collection.cp", None, "a2a+p2p needs the CP group", _BUILD_FIX)]
        try:
            check_hierarchical_groups(hcp, sizes=hierarchical_context_parallel_sizes)
        except CPConfigError as exc:
            missing += exc.violations
        raise CPConfigError(missing)
    return check_hierarchical_groups(hcp, cp, sizes=hierarchical_context_parallel_sizes)
