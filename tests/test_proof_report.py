"""The GPU proof's report (cpkit.validation.proof_report): counts from junit, stage walls from the timing
lines, GPU utilization, and each budget's verdict; nothing here needs a GPU."""

from __future__ import annotations

import json

from cpkit.validation import proof_report

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" timestamp="2026-11-27T19:00:00">
<testcase classname="functional.test_a" name="test_x[nccl2-a]" time="1"/>
<testcase classname="functional.test_a" name="test_x[nccl2-b]" time="1"><failure message="boom"/></testcase>
<testcase classname="functional.test_a" name="test_y[nccl4-c]" time="1"><skipped type="pytest.xfail" message="known"/></testcase>
</testsuite></testsuites>"""


def _folder(tmp_path, rows):
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "case-times.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gpu-util.csv").write_text("0, 50, 100\n1, 30, 100\n0, 70, 100\n1, 10, 100\n")
    return tmp_path


ROWS = [
    dict(grid="cpkit.testing.scenarios.attention.attention_case", backend="nccl", world_size=2, wall_s=10, cases_s=9, t0=100.0, t1=110.0),
    dict(grid="functional.test_gpt.gpt_case", backend="nccl", world_size=2, wall_s=30, cases_s=9, t0=105.0, t1=135.0),
    dict(grid="functional.test_gpt.gpt_case", backend="nccl", world_size=4, wall_s=50, cases_s=40, t0=100.0, t1=150.0),
    dict(grid="functional.test_te_backend.gpt_case", backend="nccl", world_size=4, wall_s=20, cases_s=20, t0=140.0, t1=160.0),
    dict(example="examples/x.py", seconds=12, t0=100.0, t1=112.0, ok=True),
    dict(grid="functional.test_gpt.gpt_case", backend="nccl", world_size=4, case="c1", seconds=7.5, ok=True, compiled=3),
    dict(pool=True, backend="nccl", world_size=4, gpus="0,1,2,3", index=1, starts=2, cases=9, start_s=6.1,
         retired={"hang": 1}),
]


def test_stage_walls_span_each_stage_and_keep_te_and_examples_apart():
    assert proof_report.stage_walls(ROWS) == {"2-GPU": 35.0, "4-GPU": 50.0, "TE": 20.0, "examples": 12.0}


def test_gpu_busy_is_the_mean_per_gpu(tmp_path):
    assert proof_report.gpu_busy(_folder(tmp_path, ROWS) / "gpu-util.csv") == {"0": 60.0, "1": 20.0}


def test_a_failure_or_an_over_budget_wall_is_not_met(tmp_path):
    folder = _folder(tmp_path, ROWS)
    text, met = proof_report.report(folder, gpus=4, setup_s=40, pytest_s=250, total_s=300, marker="gpu2 or gpu4",
                                    command="bash scripts/gpu-proof.sh", machine="4x H200", commit="abc1234",
                                    fingerprint="f" * 16)
    assert not met and "NOT green (1 failed" in text
    assert "| passed | 1 |" in text and "| xfailed | 1 |" in text and "| 4-GPU | 50.0 |" in text
    assert "pytest wall (gpu2 or gpu4): 250 s of 300 s: within" in text
    assert "proof command end to end: 300 s of 420 s: within" in text
    assert "nccl4 0,1,2,3 #1: 2, 9, 6.1, hang x1" in text and "7.5 nccl4 functional.test_gpt c1 (3 graphs compiled)" in text
    assert "Cases that compiled (torch.compile graphs): 1, 3 graphs, 7.5 s of case time" in text


def test_the_budgets_decide_when_the_run_is_green(tmp_path):
    folder = _folder(tmp_path, ROWS)
    (folder / "junit.xml").write_text(JUNIT.replace('<failure message="boom"/>', ""))
    kwargs = dict(marker="gpu2", command="c", machine="2x H100", commit="abc1234", fingerprint="0" * 16)
    assert proof_report.report(folder, gpus=2, setup_s=30, pytest_s=170, total_s=230, **kwargs)[1]
    text, met = proof_report.report(folder, gpus=2, setup_s=30, pytest_s=181, total_s=230, **kwargs)
    assert not met and "pytest wall (gpu2): 181 s of 180 s: OVER" in text


def test_the_fingerprint_names_the_tree_not_its_history(tmp_path):
    for top in ("src", "functional", "tests", "examples", "scripts"):
        (tmp_path / top).mkdir()
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    first = proof_report.fingerprint(tmp_path)
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence" / "README.md").write_text("a run\n")
    assert proof_report.fingerprint(tmp_path) == first  # evidence and cards do not change what ran
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert proof_report.fingerprint(tmp_path) != first
