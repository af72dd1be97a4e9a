"""Scenario of functional/test_groups.py and `python -m cpkit.cluster smoke`: build_pg_collection
gives MCore's membership (hcp included), every group communicates, and the a2a+p2p gate holds.

`groups_case(case)` runs on every rank of a launch; `case` is a dict with "id", "cp" and
optionally "tp", "pp", "cp_comm_type", "hier" ([a2a, p2p]) and "use_grid" (False: skip
HyperCommGrid); the world size is the launch's.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from cpkit.process_device import device

__all__ = ["CASES", "FIELDS", "groups_case"]

# Fields compared between cpkit's collection and MCore's (parallel_state) one.
FIELDS = ["tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp", "embd", "pos_embd",
          "intra_dp_cp", "expt_dp", "expt_tp", "tp_ep", "tp_ep_pp", "ep"]

CASES = [
    dict(id="a2a_p2p_2x2", cp=4, cp_comm_type="a2a+p2p", hier=[2, 2]),
    dict(id="a2a_p2p_2x2_no_grid", cp=4, cp_comm_type="a2a+p2p", hier=[2, 2], use_grid=False),
    dict(id="a2a_p2p_4x1", cp=4, cp_comm_type="a2a+p2p", hier=[4, 1]),
    dict(id="a2a_p2p_1x4", cp=4, cp_comm_type="a2a+p2p", hier=[1, 4]),
    dict(id="a2a_p2p_2x1_dp2", cp=2, cp_comm_type="a2a+p2p", hier=[2, 1]),
    dict(id="p2p_tp2_cp2", tp=2, cp=2),
    dict(id="p2p_cp2_dp2", cp=2),
    dict(id="p2p_pp2_cp2", pp=2, cp=2),
]


class _WarningCounter(logging.Handler):
    """Counts warnings, e.g. build_pg_collection falling back from HyperCommGrid."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += 1


def _ranks_of(pg_collection, field):
    from cpkit.compat import get_pg

    group = get_pg(pg_collection, field)
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _hcp_ranks(pg_collection):
    from cpkit.compat import get_pg

    hcp = get_pg(pg_collection, "hcp")
    return None if not hcp else [sorted(dist.get_process_group_ranks(g)) for g in hcp]


def _check_all_reduce(group, members) -> None:
    """Sum the global ranks over `group`; the total must be that of its `members`."""
    if group is None:
        return
    t = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(t, group=group)
    assert t.item() == sum(members), f"all_reduce over {members} gave {t.item()}, not {sum(members)}"


def _mcore_reference(layout):
    """Membership of MCore's own groups for the layout (global parallel_state, then torn down)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        hierarchical_context_parallel_sizes=layout.hierarchical_context_parallel_sizes,
        create_gloo_process_groups=False,
    )
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups(FIELDS + ["hcp"])
        # MCore 0.16's destroy_model_parallel leaves _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS set,
        # so after an a2a+p2p case hcp is stale: read it only when this layout made it.
        hcp = _hcp_ranks(pgc) if layout.hierarchical_context_parallel_sizes else None
        return {f: _ranks_of(pgc, f) for f in FIELDS}, hcp
    finally:
        parallel_state.destroy_model_parallel()


def groups_case(case):
    """One layout on every rank: cpkit's groups have MCore's membership and its rank arithmetic,
    every group carries an all-reduce, rank 0 logs the hierarchical groups, and the a2a+p2p gate
    passes on them and fails on swapped levels. Returns this rank's describe_groups() lines."""
    from cpkit.compat import get_pg
    from cpkit.errors import CPConfigError
    from cpkit.parallel.group_info import require_hierarchical_groups
    from cpkit.parallel.groups import HCP_LOG_PREFIX, build_pg_collection, describe_groups
    from cpkit.parallel.layout import CPLayout
    from cpkit.parallel.rank_grid import groups_of_rank, rank_groups

    rank = dist.get_rank()
    layout = CPLayout(world_size=dist.get_world_size(), tp=case.get("tp", 1), pp=case.get("pp", 1),
                      cp=case["cp"], cp_comm_type=case.get("cp_comm_type", "p2p"),
                      hierarchical_context_parallel_sizes=case.get("hier"))
    warnings = _WarningCounter()
    logging.getLogger("cpkit.parallel.groups").addHandler(warnings)
    try:
        pgc = build_pg_collection(layout, use_hyper_comm_grid=case.get("use_grid", True))
    finally:
        logging.getLogger("cpkit.parallel.groups").removeHandler(warnings)
    assert warnings.count == 0, "HyperCommGrid disagreed with MCore's rank order"
    mine = {f: _ranks_of(pgc, f) for f in FIELDS}
    mine_hcp = _hcp_ranks(pgc)

    # 1. the same membership as MCore's initialize_model_parallel
    ref, ref_hcp = _mcore_reference(layout)
    assert mine == ref, f"rank {rank}: cpkit {mine} != MCore {ref}"
    assert mine_hcp == ref_hcp, f"rank {rank}: hcp cpkit {mine_hcp} != MCore {ref_hcp}"
    # ... and as the pure arithmetic
    expected = groups_of_rank(rank_groups(layout), rank)
    assert mine["cp"] == expected["cp"] and mine["dp"] == expected["dp"] and mine["tp"] == expected["tp"]

    # 2. the log line, and every group communicates
    for field in FIELDS:
        _check_all_reduce(get_pg(pgc, field), mine[field])
    lines = describe_groups(pgc)
    hcp_lines = [line for line in lines if line.startswith(HCP_LOG_PREFIX)]
    if layout.uses_hierarchical:
        assert mine_hcp == [expected["hcp_a2a"], expected["hcp_p2p"]]
        assert hcp_lines == [f"{HCP_LOG_PREFIX} a2a={expected['hcp_a2a']} p2p={expected['hcp_p2p']}"]
        for group, members in zip(pgc.hcp, mine_hcp):
            _check_all_reduce(group, members)
        # 3. the gate passes on cpkit's groups and fails on swapped levels
        a2a, p2p = require_hierarchical_groups(pgc, "a2a+p2p",
                                               hierarchical_context_parallel_sizes=case["hier"])
        assert a2a is pgc.hcp[0] and p2p is pgc.hcp[1]
        if case["hier"] == [2, 2]:
            from cpkit.compat import new_pg_collection

            swapped = new_pg_collection(cp=pgc.cp, hcp=[pgc.hcp[1], pgc.hcp[0]])
            try:
                require_hierarchical_groups(swapped, "a2a+p2p")
            except CPConfigError as exc:
                assert "level 0" in str(exc)
            else:
                raise AssertionError("swapped hierarchical levels passed the gate")
    else:
        assert mine_hcp is None and hcp_lines == []
    return lines
