"""The parts of `python -m cpkit.cluster` that need no processes: the default layout, which a2a
group sizes the checks may use, and how rank outcomes merge into the report (root cause first)."""

import argparse
import json

from cpkit.cluster import _layout, build_parser
from cpkit.cluster.checks import JobShape
from cpkit.cluster.report import Report, merge_outcomes
from cpkit.parallel.layout import CPLayout


def _args(*argv) -> argparse.Namespace:
    return build_parser().parse_args(["all", *argv])


def test_default_layout_fills_each_node_with_the_a2a_level():
    lay = _layout(_args(), 16, 8)
    assert (lay.cp, lay.cp_comm_type, lay.hierarchical_context_parallel_sizes) == (16, "a2a+p2p", [8, 2])
    lay = _layout(_args("--tp", "2"), 16, 8)  # cp=8 strided by tp: 4 CP positions per node
    assert (lay.cp, lay.hierarchical_context_parallel_sizes) == (8, [4, 2])
    assert _layout(_args(), 4, 4).cp_comm_type == "p2p"  # one node: no hierarchy needed
    lay = _layout(_args("--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "4,1"), 4, 2)
    assert lay.hierarchical_context_parallel_sizes == [4, 1]  # flags win; the topology check refuses it


def test_checks_build_a2a_groups_only_inside_a_node_unless_allowed():
    job = JobShape("gloo", 4, 2, CPLayout(world_size=4, cp=4), allow_cross_node_a2a=False)
    assert job.a2a_sizes == [1, 2] and job.inner_a2a == 2 and not job.a2a_fits(4)
    job = JobShape("gloo", 4, 2, CPLayout(world_size=4, cp=4), allow_cross_node_a2a=True)
    assert job.a2a_sizes == [1, 2, 4] and job.inner_a2a == 2
    assert JobShape("nccl", 16, 8, CPLayout(world_size=16, cp=16), False).inner_a2a == 8


def _outcome(passed, detail, seconds=None):
    return {"passed": passed, "detail": detail, "seconds": seconds}


def test_merge_puts_the_raising_and_the_hung_rank_before_the_ones_they_stopped():
    entry = merge_outcomes("attention", {
        0: _outcome(False, "rank 0: aborted: another rank failed ..."),
        1: _outcome(False, "rank 1: timed out: ... stack:\n  File \"comm.py\", line 107, in wait\n    work.wait()"),
        2: _outcome(False, "rank 2: timed out: ... stack:\n  File \"checks.py\", line 9, in run\n    time.sleep(1e6)"),
        3: _outcome(False, "rank 3: Traceback ...\nRuntimeError: boom"),
        4: None,
    })
    assert entry["passed"] is False and entry["seconds"] is None
    first, *_ = entry["detail"].splitlines()
    assert first == ("raised: rank(s) [3]; hung outside communication: rank(s) [2]; timed out waiting in "
                     "communication: rank(s) [1]; stopped after another rank failed: rank(s) [0]; "
                     "no outcome (died, or hung with no watchdog report): rank(s) [4]")
    blocks = [line for line in entry["detail"].splitlines() if line.startswith("--- rank")]
    assert blocks == ["--- rank 3 ---", "--- rank 2 ---", "--- rank 1 ---", "--- rank 0 ---", "--- rank 4 ---"]


def test_merge_of_a_pass_keeps_rank_0s_detail_and_the_slowest_time():
    entry = merge_outcomes("smoke", {0: _outcome(True, "ok", 1.5), 1: _outcome(True, "ok too", 2.5)})
    assert entry == {"name": "smoke", "passed": True, "detail": "ok", "seconds": 2.5}


def test_report_marks_the_checks_after_a_failure_not_run(tmp_path, capsys):
    report = Report(str(tmp_path / "r.json"), {"world_size": 2}, ["smoke", "attention", "eval-cp"])
    report.add({"name": "smoke", "passed": True, "detail": "ok", "seconds": 1.0})
    report.add({"name": "attention", "passed": False, "detail": "raised: rank(s) [1]", "seconds": None})
    report.write()
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["world_size"] == 2
    assert data["checks"][-1] == {"name": "eval-cp", "passed": False, "detail": "not run: attention failed",
                                  "seconds": None}
    out, err = capsys.readouterr()
    assert "attention        FAIL" not in out and "attention  FAIL" in out and "eval-cp    not run" in out
    assert "raised: rank(s) [1]" in err
