"""Hierarchical CP through Megatron-Bridge's initialization on 4 ranks: Bridge's MPU path creates
the hierarchical groups (MCore's membership on every rank), and a training step of the small
GPT with cpkit's attention on them equals cp=1 (GQA at [2,2], [1,4], [4,1]; MLA and sliding
window + sinks at [2,2]). One scenario
(`cpkit.testing.scenarios.bridge_hcp.bridge_hcp_case`), one launch per backend: gloo (CI, fp32)
and nccl (gpu4, bf16). Needs CPKIT_BRIDGE_SRC (skips with the reason otherwise).

    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src python3 -m pytest functional/test_bridge_hcp.py -q
"""

from __future__ import annotations

import pytest

from cpkit.testing import grid_params, grid_result
from cpkit.upstream.bridge import bridge_src
from cpkit.testing.scenarios.bridge_hcp import WORLD, bridge_hcp_case, cases, expected_levels

_SRC, _WHY = bridge_src()
pytestmark = pytest.mark.skipif(_SRC is None, reason=_WHY)


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(cases, scenario=bridge_hcp_case, timeout=300, world_sizes=(WORLD,)))
def test_bridge_hcp_step_matches_cp1(backend, world_size, case_id):
    """Bridge's groups have MCore's membership on every rank; one step equals cp=1."""
    res = grid_result(bridge_hcp_case, cases, backend, world_size, case_id, timeout=300).check()
    case = next(c for c in cases(backend, world_size) if c["id"] == case_id)
    for rank, out in res.values.items():
        assert out["levels"] == list(expected_levels(rank, case["hcp"]))
    losses = {out["loss"] for out in res.values.values()}
    assert len(losses) == 1, f"ranks report different global losses: {losses}"

