"""build_pg_collection on 4 ranks: the same membership as MCore's initialize_model_parallel, hcp
included; an all-reduce over every group; the HIERARCHICAL_CONTEXT_PARALLEL_GROUPS log line; the a2a+p2p
gate on real groups. The scenario lives in cpkit.testing.scenarios.groups (the cluster smoke check runs it).

All cases run in one launch per backend; each case is its own test node.
"""

import pytest

from cpkit.testing import grid_params, grid_result
from cpkit.testing.scenarios.groups import CASES, groups_case

# On NCCL only the cases that make communicators of new shapes: the hierarchical groups (the
# card's follow-ups: 2x2, and the degenerate 4x1 and 1x4) and pp x cp (pipeline, embedding
# groups of non-adjacent ranks). The membership itself is rank arithmetic, the same on every
# backend, and every case checks it on gloo; each NCCL case costs a communicator per group.
NCCL_CASES = ("a2a_p2p_2x2", "a2a_p2p_4x1", "a2a_p2p_1x4", "p2p_pp2_cp2")


def _cases(backend, world_size):
    return [c for c in CASES if backend == "gloo" or c["id"] in NCCL_CASES]


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(_cases, scenario=groups_case, timeout=300, world_sizes=(4,)))
def test_groups_match_mcore(backend, world_size, case_id):
    res = grid_result(groups_case, _cases, backend, world_size, case_id, timeout=300).check()
    lines = res.values[0]
    assert lines[0].startswith("PROCESS_GROUPS rank=0 world_size=4")
    if case_id == "a2a_p2p_2x2":
        assert "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=[0, 1] p2p=[0, 2]" in lines
        assert res.values[3][-1] == "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=[2, 3] p2p=[1, 3]"
