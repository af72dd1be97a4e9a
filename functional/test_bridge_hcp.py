"""Hierarchical CP through Megatron-Bridge's initialization on 4 ranks: Bridge's MPU path creates
the hierarchical groups (MCore's membership on every rank), and a training step of the small
GPT with cpkit's attention on them equals cp=1 (GQA at [2,2], [1,4], [4,1]; MLA and sliding
window + sinks at [2,2]). One scenario
(`cpkit.testing.scenarios.bridge_hcp.bridge_hcp_case`), one launch per backend: gloo (CI, fp32)
and nccl (gpu4, bf16). Needs CPKIT_BRIDGE_SRC (skips with the reason otherwise).

    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src python3 -m pytest functional/test_bridge_hcp.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpkit.testing import grid_params, grid_result
from cpkit.testing.bridge_src import bridge_src
from cpkit.testing.scenarios.bridge_hcp import WORLD, bridge_hcp_case, cases, expected_levels

_SRC, _WHY = bridge_src()
pytestmark = pytest.mark.skipif(_SRC is None, reason=_WHY)


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(cases, world_sizes=(WORLD,)))
def test_bridge_hcp_step_matches_cp1(backend, world_size, case_id):
    """Bridge's groups have MCore's membership on every rank; one step equals cp=1."""
    res = grid_result(bridge_hcp_case, cases, backend, world_size, case_id, timeout=300).check()
    case = next(c for c in cases(backend, world_size) if c["id"] == case_id)
    for rank, out in res.values.items():
        assert out["levels"] == list(expected_levels(rank, case["hcp"]))
    losses = {out["loss"] for out in res.values.values()}
    assert len(losses) == 1, f"ranks report different global losses: {losses}"


EXAMPLE = "examples/bridge_a2a_p2p.py"
ROOT = Path(__file__).resolve().parents[1]


def _example_command() -> list[str]:
    """The launch line of the example's docstring, as a user pastes it, for one step."""
    import re
    import shlex
    import sys

    text = (ROOT / EXAMPLE).read_text()
    line = next(ln.strip() for ln in text.splitlines() if "torchrun" in ln and EXAMPLE in ln)
    words = shlex.split(re.sub(r"^CPKIT_BRIDGE_SRC=\S+\s+", "", line))
    assert words[0] == "torchrun", line
    return [sys.executable, "-m", "torch.distributed.run", *words[1:], "--steps", "1"]


@pytest.mark.dist
def test_bridge_example_reaches_its_first_step():
    """examples/bridge_a2a_p2p.py, launched as its docstring says (torchrun, 4 gloo processes),
    configures a2a+p2p [2,2] in Bridge's fields and completes its first training step."""
    import os
    import signal
    import subprocess

    env = dict(os.environ, CPKIT_BRIDGE_SRC=str(_SRC), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(_example_command(), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        out, _ = proc.communicate()
        pytest.fail(f"the example hung for 300 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=[0, 1] p2p=[0, 2]" in out, out[-4000:]
    assert "step 1 loss" in out, out[-4000:]
