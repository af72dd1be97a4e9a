"""Process groups for a CPLayout on MCore's decentralized path, hierarchical CP included.

`build_pg_collection(layout)` returns the ProcessGroupCollection MCore modules take as
`pg_collection`, with the membership `parallel_state.initialize_model_parallel` gives for the
same sizes (rank order tp-cp-dp-pp, see `cpkit.parallel.rank_grid.rank_groups`) and, unlike MCore's decentralized
path, `hcp` set for a2a+p2p. `describe_groups` / `log_groups` print the groups for logs. The
build-time gate for a2a+p2p groups is `cpkit.parallel.group_info.require_hierarchical_groups`.
"""

from __future__ import annotations

import logging
import warnings
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from cpkit.compat import get_pg
from cpkit.errors import CPConfigError
from cpkit.parallel.group_info import global_ranks
from cpkit.parallel.layout import CPLayout
from cpkit.parallel.rank_grid import rank_groups

__all__ = [
    "HCP_LOG_PREFIX",
    "build_pg_collection",
    "describe_groups",
    "log_groups",
]

HCP_LOG_PREFIX = "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"
"""Start of the log line that shows hierarchical CP is active (the signal to look for in logs)."""

logger = logging.getLogger(__name__)

# Kinds whose groups span mesh axes: built through HyperCommGrid when it agrees with cpkit's
# arithmetic. Value: the grid dims.
_GRID_KINDS = {
    "tp": ["tp"],
    "cp": ["cp"],
    "dp": ["dp"],
    "pp": ["pp"],
    "mp": ["tp", "pp"],
    "tp_cp": ["tp", "cp"],
    "dp_cp": ["cp", "dp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
}

# ProcessGroupCollection fields in log order, with the MCore group each one is.
_DESCRIBED = (
    ("tp", "TENSOR_MODEL_PARALLEL_GROUP"),
    ("cp", "CONTEXT_PARALLEL_GROUP"),
    ("dp", "DATA_PARALLEL_GROUP"),
    ("pp", "PIPELINE_MODEL_PARALLEL_GROUP"),
    ("mp", "MODEL_PARALLEL_GROUP"),
    ("tp_cp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP"),
    ("dp_cp", "DATA_PARALLEL_GROUP_WITH_CP"),
    ("tp_dp_cp", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"),
    ("embd", "EMBEDDING_GROUP"),
    ("pos_embd", "POSITION_EMBEDDING_GROUP"),
)


def _hyper_comm_grid_class():
    """MCore's HyperCommGrid, or None where this MCore lacks it."""
    try:
        with warnings.catch_warnings():
            # Its import warns when absl is missing; it then logs through `logging`, which is fine.
            warnings.filterwarnings("ignore", message="absl.logging is not installed")
            from megatron.core.hyper_comm_grid import HyperCommGrid
    except ImportError:
        return None
    return HyperCommGrid


def _same_membership(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> bool:
    return sorted(sorted(g) for g in a) == sorted(sorted(g) for g in b)


class _GroupMaker:
    """Creates groups with torch.distributed.new_group in call order (the same on every rank),
    creating each distinct membership once, and keeps the one that holds this rank."""

    def __init__(self, rank: int, timeout: Optional[timedelta], backend: Optional[str]):
        self.rank = rank
        self.timeout = timeout
        self.backend = backend
        self._made: dict[tuple[int, ...], Any] = {}

    def mine(self, memberships: Sequence[Sequence[int]], desc: str) -> Any:
        """Create every group of `memberships` (every rank must call this, member or not);
        return the one holding this rank, or None."""
        found = None
        for members in memberships:
            key = tuple(sorted(members))
            if key not in self._made:
                self._made[key] = dist.new_group(
                    list(key), timeout=self.timeout, backend=self.backend, group_desc=f"CPKIT_{desc}"
                )
            if self.rank in key:
                found = self._made[key]
        return found


def build_pg_collection(
    layout: CPLayout,
    *,
    rank: Optional[int] = None,
    use_hyper_comm_grid: bool = True,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
) -> ProcessGroupCollection:
    """Build every process group of `layout` and return this rank's ProcessGroupCollection.

    Collective over the default group: every rank must call it, with the same layout, after
    torch.distributed is initialized with world_size == layout.world_size. Sets tp, cp, dp, pp,
    mp, tp_cp, dp_cp, tp_dp_cp, embd and pos_embd (only on ranks of the first/last pipeline
    stage, as MCore), intra_dp_cp (= dp_cp), the ep = 1 expert groups (ep, expt_tp = tp,
    tp_ep = tp, tp_ep_pp = mp, expt_dp = intra_expt_dp = dp_cp), intra_dist_opt (all ranks),
    and for a2a+p2p `hcp = [a2a group, p2p group]` of this rank.

    The axis groups come from MCore's HyperCommGrid (shape [tp, cp, dp, pp]) where it exists
    and agrees with `cpkit.parallel.rank_grid.rank_groups`; otherwise (or with use_hyper_comm_grid=False)
    from that arithmetic. Raises CPConfigError for an invalid layout or a world size mismatch.
    """
    layout.validate()
    if not dist.is_initialized():
        raise CPConfigError.single("world_size", layout.world_size,
                                   "build_pg_collection needs torch.distributed initialized",
                                   "call torch.distributed.init_process_group first (or use cpkit.testing.launch)")
    actual = dist.get_world_size()
    if actual != layout.world_size:
        raise CPConfigError.single("world_size", layout.world_size,
                                   f"must equal the torch.distributed world size {actual}",
                                   f"build the layout with world_size={actual}")
    rank = dist.get_rank() if rank is None else rank
    expected = rank_groups(layout)
    maker = _GroupMaker(rank, timeout, backend)

    grid_cls = _hyper_comm_grid_class() if use_hyper_comm_grid else None
    grid = None
    if grid_cls is not None:
        grid = grid_cls([layout.tp, layout.cp, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"],
                        backend=backend)
    groups: dict[str, Any] = {}
    for kind, dims in _GRID_KINDS.items():
        if grid is not None and _same_membership(grid.get_rank_enum(dims), expected[kind]):
            groups[kind] = grid.create_pg(dims, timeout=timeout, group_desc=f"CPKIT_{kind.upper()}")
        else:
            if grid is not None:
                logger.warning("HyperCommGrid %s groups differ from MCore's rank order; using "
                               "cpkit's rank arithmetic", kind)
            groups[kind] = maker.mine(expected[kind], kind.upper())

    groups["embd"] = maker.mine(expected["embd"], "EMBD")
    groups["pos_embd"] = maker.mine(expected["pos_embd"], "POS_EMBD")
    groups["ep"] = maker.mine([[r] for r in range(layout.world_size)], "EP")
    groups["intra_dist_opt"] = maker.mine([list(range(layout.world_size))], "INTRA_DIST_OPT")
    if layout.uses_hierarchical:
        a2a = maker.mine(expected["hcp_a2a"], "HCP_A2A")
        p2p = maker.mine(expected["hcp_p2p"], "HCP_P2P")
        groups["hcp"] = [a2a, p2p]

    # With ep = 1 and one distributed-optimizer instance these coincide, as in parallel_state.
    groups["intra_dp_cp"] = groups["dp_cp"]
    groups["expt_dp"] = groups["dp_cp"]
    groups["intra_expt_dp"] = groups["dp_cp"]
    groups["expt_tp"] = groups["tp"]
    groups["tp_ep"] = groups["tp"]
    groups["tp_ep_pp"] = groups["mp"]
    return ProcessGroupCollection(**{k: v for k, v in groups.items() if v is not None})


def describe_groups(pg_collection: ProcessGroupCollection) -> list[str]:
    """Log lines for this rank's groups: a header, then `<field> <MCORE_GROUP_NAME> ranks=[...]`
    per set field (global ranks), and, when hcp is set, a line
    `HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=[...] p2p=[...]` (levels named level<i> when there
    are not exactly two). Needs torch.distributed initialized (reads group membership)."""
    lines = [f"PROCESS_GROUPS rank={dist.get_rank()} world_size={dist.get_world_size()}"]
    for field, name in _DESCRIBED:
        group = get_pg(pg_collection, field)
        if group is not None:
            lines.append(f"{field} {name} ranks={global_ranks(group)}")
    hcp = get_pg(pg_collection, "hcp")
    if hcp:
        names = ["a2a", "p2p"] if len(hcp) == 2 else [f"level{i}" for i in range(len(hcp))]
        parts = [f"{n}={global_ranks(g)}" for n, g in zip(names, hcp)]
        lines.append(f"{HCP_LOG_PREFIX} " + " ".join(parts))
    return lines


def log_groups(pg_collection: ProcessGroupCollection, logger: Optional[logging.Logger] = None) -> list[str]:
    """Log describe_groups() at INFO on global rank 0 only; returns the lines logged (empty on
    other ranks). Every rank may call it; it does not communicate."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    lines = describe_groups(pg_collection)
    log = logger or logging.getLogger(__name__)
    for line in lines:
        log.info(line)
    return lines
