"""The examples a user copies into their own training loop (examples/, one per skill) run as
written: `python examples/<name>.py` in a fresh process, which spawns its gloo ranks on CPU, exits
0 within the timeout and prints its result. Each example asserts its own numbers (the loss, and
the gradients where it trains at two layouts, against CP 1 within 1e-5 in fp32; a failed assert
exits non-zero); the test checks the exit status and the printed lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 420

FLOAT = r"\d+\.\d{6}"
EXAMPLES = {
    "eval_cp_in_your_loop.py": [
        rf"train loss \(cp 1, 2 ranks\): {FLOAT}",
        rf"eval loss at cp 2: {FLOAT}; at cp 1: {FLOAT}",
        r"rebound \d+ attributes, e\.g\. .+; restored: True",
    ],
    "cp_attention_in_your_gpt.py": [rf"loss at cp 2: {FLOAT}; at cp 1: {FLOAT}; largest gradient difference"],
    "hierarchical_cp_in_your_gpt.py": [
        r"HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=\[0, 1\] p2p=\[0, 2\]",
        rf"loss at cp 4 \(a2a\+p2p \[2, 2\]\): {FLOAT}; at cp 1: {FLOAT}; largest gradient difference",
    ],
    "bridge_a2a_p2p.py": [
        r"HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=\[0, 1\] p2p=\[0, 2\]",
        rf"loss at cp 4 \(a2a\+p2p \[2, 2\], Bridge's groups\): {FLOAT}; at cp 1: {FLOAT}; largest gradient difference",
    ],
    "dynamic_cp_in_your_loop.py": [
        r"plan: \d+ micro-batches, CP sizes \[1, 2\]",
        rf"loss with dynamic CP: {FLOAT}; each sequence alone at cp 1: {FLOAT}",
    ],
}


# Examples that run Megatron-Bridge's code: skipped with the reason without a checkout.
NEEDS_BRIDGE = ("bridge_a2a_p2p.py",)


def test_every_example_is_tested():
    assert sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_as_written(name):
    if name in NEEDS_BRIDGE:
        from cpkit.testing.bridge_src import bridge_src

        src, why = bridge_src()
        if src is None:
            pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # not under torchrun
    try:
        proc = subprocess.run([sys.executable, f"examples/{name}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"examples/{name} ran past {TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"examples/{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for pattern in EXAMPLES[name]:
        assert re.search(pattern, proc.stdout), f"examples/{name} did not print /{pattern}/:\n{proc.stdout}"
