"""build_pg_collection on 4 ranks: the same membership as MCore's initialize_model_parallel, hcp
included; an all-reduce over every group; the HIERARCHICAL_CONTEXT_PARALLEL_GROUPS log line; the a2a+p2p
gate on real groups. The scenario lives in cpkit.testing.scenarios.groups (the cluster smoke check runs it).

All cases run in one launch per backend; each case is its own test node.
"""

import pytest

from cpkit.testing import dist_params, run_cases
from cpkit.testing.scenarios.groups import CASES, groups_case


# One (backend, world_size) value per fixture param, keeping dist_params' marks and ids.
_BACKENDS = [pytest.param(tuple(p.values), marks=p.marks, id=p.id) for p in dist_params((4,))]


@pytest.fixture(scope="module", params=_BACKENDS)
def results(request):
    backend, world_size = request.param
    return run_cases(groups_case, CASES, world_size, backend=backend, timeout=300)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_groups_match_mcore(results, case_id):
    res = results[case_id].check()
    lines = res.values[0]
    assert lines[0].startswith("PROCESS_GROUPS rank=0 world_size=4")
    if case_id == "a2a_p2p_2x2":
        assert "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=[0, 1] p2p=[0, 2]" in lines
        assert res.values[3][-1] == "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=[2, 3] p2p=[1, 3]"
