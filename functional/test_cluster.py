"""`python -m cpkit.cluster` under torchrun as two nodes of 2 ranks on localhost (gloo): two
torchrun processes, `--nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1`, as on a cluster.

- `all` passes on every rank and rank 0's report holds every check;
- a rank that raises (fault injected on rank 3, node 1) makes both torchrun processes exit
  non-zero long before the check's timeout, with that rank's traceback in the report;
- a layout whose a2a group of 4 spans the two nodes is refused before any check.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpkit.harness.children import popen_tied

from cpkit.cluster.checks import CHECKS, FAULT_ENV

pytestmark = pytest.mark.dist

SRC = str(Path(__file__).resolve().parents[1] / "src")
LAUNCH_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str], env_extra: dict | None = None,
               deadline_s: float = LAUNCH_TIMEOUT_S) -> tuple[list[int], list[str], float]:
    """Start node 1 then node 0 (torchrun, 2 ranks each) and wait for both, at most `deadline_s`
    (then both are killed: their exit codes are negative, their output what they wrote until
    then); returns (exit codes [node 0, node 1], their combined output, seconds)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    procs = []
    start = time.monotonic()
    for node in (1, 0):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "cpkit.cluster", *args, "--backend", "gloo"]  # also on a host with GPUs
        procs.append(popen_tied(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    procs.reverse()  # [node 0, node 1]
    outputs = []
    try:
        for p in procs:
            remaining = max(1.0, deadline_s - (time.monotonic() - start))
            try:
                outputs.append(p.communicate(timeout=remaining)[0])
            except subprocess.TimeoutExpired:
                break
    finally:
        seconds = time.monotonic() - start
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    outputs += [p.communicate()[0] for p in procs[len(outputs):]]
    return [p.returncode for p in procs], outputs, seconds


def test_all_checks_pass_on_two_nodes(tmp_path):
    report_path = tmp_path / "report.json"
    codes, out, _ = _two_nodes(["all", "--report", str(report_path)])
    assert codes == [0, 0], f"exit codes {codes}\n--- node 0 ---\n{out[0]}\n--- node 1 ---\n{out[1]}"
    report = json.loads(report_path.read_text())
    assert {k: report[k] for k in ("world_size", "nnodes", "nproc_per_node", "backend")} == \
        {"world_size": 4, "nnodes": 2, "nproc_per_node": 2, "backend": "gloo"}
    assert report["layout"]["cp_comm_type"] == "a2a+p2p"
    assert report["layout"]["hierarchical_context_parallel_sizes"] == [2, 2]  # a2a inside each node
    assert [c["name"] for c in report["checks"]] == list(CHECKS)
    for check in report["checks"]:
        assert set(check) == {"name", "passed", "detail", "seconds"}
        assert check["passed"] is True and check["seconds"] > 0 and check["detail"], check
    assert report["topology"]["cross_node_p2p_hops"] == [[0, 2], [2, 0], [1, 3], [3, 1]]
    # rank 0 prints the groups per node and the table
    assert "  node 1 (ranks 2-3): cp [[0, 1, 2, 3]]; hcp_a2a [[2, 3]]; hcp_p2p [[0, 2], [1, 3]]" in out[0]
    assert "hierarchical     pass" in out[0]


def test_a_raising_rank_ends_both_nodes_promptly_with_its_traceback(tmp_path):
    report_path = tmp_path / "report.json"
    timeout_s = 240  # the check's timeout: a hang would last this long
    # Killed at a third of it: a fault that makes them wait costs this test no more.
    codes, out, seconds = _two_nodes(["all", "--report", str(report_path), "--timeout", str(timeout_s)],
                                     {FAULT_ENV: "smoke:3"}, deadline_s=timeout_s / 3)
    assert codes[0] != 0 and codes[1] != 0, f"exit codes {codes}\n{out[0]}\n{out[1]}"
    assert seconds < timeout_s / 3, f"took {seconds:.0f} s: the other ranks waited for the timeout"
    report = json.loads(report_path.read_text())
    smoke, *rest = report["checks"]
    assert smoke["name"] == "smoke" and smoke["passed"] is False
    assert smoke["detail"].startswith("raised: rank(s) [3]")
    assert f"RuntimeError: fault injected through {FAULT_ENV} on rank 3 in smoke" in smoke["detail"]
    assert [c["name"] for c in rest] == list(CHECKS[1:])
    assert all(c["passed"] is False and c["detail"] == "not run: smoke failed" for c in rest)


def test_an_a2a_group_spanning_two_nodes_is_refused():
    codes, out, _ = _two_nodes(["smoke", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "4,1"])
    assert codes[0] != 0 and codes[1] != 0, f"exit codes {codes}\n{out[0]}\n{out[1]}"
    assert ("error: hierarchical_context_parallel_sizes=[4, 1]: a2a groups span nodes with nproc_per_node=2: "
            "[0, 1, 2, 3] (nodes [0, 1])") in out[0]
    assert "--allow-cross-node-a2a" in out[0] and "[2, 2]" in out[0]
