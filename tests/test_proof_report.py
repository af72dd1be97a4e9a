"""The GPU proof's report (cpkit.validation.proof_report): counts per tier (the gpu1 tier's junit and the
multi-GPU tier's) and combined, stage walls from the timing lines, GPU utilization, each budget's verdict
by host size, and the exit verdict over both tiers; nothing here needs a GPU."""

from __future__ import annotations

import json

import pytest

from cpkit.validation import proof_report

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" timestamp="2026-11-27T19:00:00">
<testcase classname="functional.test_a" name="test_x[nccl2-a]" time="1"/>
<testcase classname="functional.test_a" name="test_x[nccl2-b]" time="1"><failure message="boom"/></testcase>
<testcase classname="functional.test_a" name="test_y[nccl4-c]" time="1"><skipped type="pytest.xfail" message="known"/></testcase>
</testsuite></testsuites>"""
GPU1_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" timestamp="2026-11-27T19:00:00">
<testcase classname="functional.test_kernels_gpu" name="test_k[a]" time="1"/>
<testcase classname="functional.test_kernels_gpu" name="test_k[b]" time="1"/>
<testcase classname="functional.test_kernels_gpu" name="test_k[c]" time="0"><skipped type="pytest.skip" message="refused by design"/></testcase>
</testsuite></testsuites>"""
GPU1_FAILING = GPU1_JUNIT.replace('name="test_k[b]" time="1"/>', 'name="test_k[b]" time="1"><failure message="off"/></testcase>')
GREEN = JUNIT.replace('<failure message="boom"/>', "")
WORDS = dict(command="c", machine="2x H100", commit="abc1234", fingerprint="0" * 16)


LAUNCH_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" timestamp="2026-11-27T19:00:00">
<testcase classname="functional.test_launcher" name="test_all_reduce_smoke[nccl2]" time="6"/>
</testsuite></testsuites>"""


def _folder(tmp_path, rows, gpu1=GPU1_JUNIT, multi=JUNIT, launch=LAUNCH_JUNIT):
    for name, text in (("junit-gpu1.xml", gpu1), ("junit.xml", multi), ("junit-launch.xml", launch)):
        if text is not None:
            (tmp_path / name).write_text(text)
    (tmp_path / "case-times.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gpu-util.csv").write_text("0, 50, 100\n1, 30, 100\n0, 70, 100\n1, 10, 100\n")
    return tmp_path


ROWS = [
    dict(grid="cpkit.testing.scenarios.attention.attention_case", backend="nccl", world_size=2, wall_s=10, cases_s=9, t0=100.0, t1=110.0),
    dict(grid="functional.test_gpt.gpt_case", backend="nccl", world_size=2, wall_s=30, cases_s=9, t0=105.0, t1=135.0),
    dict(grid="functional.test_gpt.gpt_case", backend="nccl", world_size=4, wall_s=50, cases_s=40, t0=100.0, t1=150.0),
    dict(grid="functional.test_te_backend.gpt_case", backend="nccl", world_size=4, wall_s=20, cases_s=20, t0=140.0, t1=160.0),
    dict(example="examples/x.py", seconds=12, t0=100.0, t1=112.0, ok=True),
    dict(grid="functional.test_gpt.gpt_case", backend="nccl", world_size=4, case="c1", seconds=7.5, ok=True, compiled=3,
         cached=2),
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
                                    fingerprint="f" * 16, gpu1_s=120, multi_gpu_s=245, gpu1_workers=8)
    assert not met and "NOT green (gpu2 or gpu4: 1 failed" in text
    assert "-m gpu1` over functional/ and tests/ (8 xdist workers on 4 GPUs, each worker pinned to one) beside pytest `-m \"gpu2 or gpu4\"`" in text
    assert "| outcome | gpu1 | gpu2 or gpu4 | gpu2 or gpu4: own launches | all |" in text
    assert "| passed | 2 | 1 | 1 | 4 |" in text and "| xfailed | 0 | 1 | 0 | 1 |" in text
    assert "| skipped | 1 | 0 | 0 | 1 |" in text
    assert "| gpu1 tier (its pytest) | 120 |" in text
    assert "| gpu2 or gpu4 tier (its pytests: the pools' and the own launches, side by side) | 245 |" in text
    assert "| 4-GPU | 50.0 |" in text and "| pytest (both tiers, side by side) | 250 |" in text
    assert "pytest wall (gpu1 beside gpu2 or gpu4): 250 s of 300 s: within" in text
    assert "proof command end to end: 300 s of 420 s: within" in text
    assert "nccl4 0,1,2,3 #1: 2, 9, 6.1, hang x1" in text and "7.5 nccl4 functional.test_gpt c1 (3 graphs compiled, 2 from the machine's cache)" in text
    assert "3 graphs (2 with their kernels from the machine's inductor cache)" in text
    assert "Cases that compiled (torch.compile graphs): 1, 3 graphs (2 with their kernels from the machine's inductor cache), 7.5 s of case time" in text


def test_the_budgets_decide_when_the_run_is_green(tmp_path):
    folder = _folder(tmp_path, ROWS, multi=GREEN)
    assert proof_report.report(folder, gpus=2, setup_s=30, pytest_s=240, total_s=330, marker="gpu2", **WORDS)[1]
    text, met = proof_report.report(folder, gpus=2, setup_s=30, pytest_s=241, total_s=330, marker="gpu2", **WORDS)
    assert not met and "pytest wall (gpu1 beside gpu2): 241 s of 240 s: OVER" in text
    text, met = proof_report.report(folder, gpus=2, setup_s=30, pytest_s=200, total_s=331, marker="gpu2", **WORDS)
    assert not met and "proof command end to end: 331 s of 330 s: OVER" in text


@pytest.mark.parametrize("gpus,budgets", [(1, {}), (2, {"pytest": 240.0, "total": 330.0}),
                                          (3, {"pytest": 240.0, "total": 330.0}),
                                          (4, {"pytest": 300.0, "total": 420.0}), (8, {"pytest": 300.0, "total": 420.0})])
def test_the_budgets_by_gpu_count_cover_both_tiers_and_none_on_one_gpu(gpus, budgets):
    assert proof_report.budgets_for(gpus) == budgets
    assert proof_report.overruns(gpus, 10_000, 10_000) == [f"{k} 10000 s > {v:.0f} s" for k, v in budgets.items()]


def test_the_junits_count_per_tier_and_together(tmp_path):
    folder = _folder(tmp_path, [])
    tiers = proof_report.tier_counts(folder, "gpu2")
    assert list(tiers) == ["gpu1", "gpu2", "gpu2: own launches"]
    assert (tiers["gpu1"]["passed"], tiers["gpu1"]["skipped"], tiers["gpu2"]["passed"], tiers["gpu2"]["failed"],
            tiers["gpu2: own launches"]["passed"]) == (2, 1, 1, 1, 1)
    assert proof_report.tier_junits(folder, "")["gpu1"].name == "junit-gpu1.xml"
    assert list(proof_report.tier_counts(folder, "")) == ["gpu1"]  # a 1-GPU host: gpu1 alone


def test_a_gpu1_failure_fails_the_proof_though_the_multi_gpu_tier_is_green(tmp_path):
    folder = _folder(tmp_path, [], gpu1=GPU1_FAILING, multi=GREEN)
    text, met = proof_report.report(folder, gpus=2, setup_s=30, pytest_s=200, total_s=260, marker="gpu2", **WORDS)
    assert not met and "NOT green (gpu1: 1 failed, 0 errors, 0 xpassed, 1 passed)" in text
    gate, passed = proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2")
    assert not passed and "- FAIL: not green: gpu1: 1 failed" in gate and "tiers: gpu1, gpu2" in gate


def test_a_tier_that_wrote_no_junit_fails_the_proof(tmp_path):
    folder = _folder(tmp_path, [], gpu1=None, multi=GREEN)
    text, _ = proof_report.report(folder, gpus=2, setup_s=30, pytest_s=200, total_s=260, marker="gpu2", **WORDS)
    assert "| passed | - | 2 | 1 | 3 |" in text
    gate, passed = proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2")
    assert not passed and "FAIL: not green: gpu1: no junit-gpu1.xml (the tier did not finish" in gate
    # the multi-GPU tests that start their own ranks: no junit of theirs fails the proof as well
    (folder / "junit-launch.xml").unlink()
    (folder / "junit-gpu1.xml").write_text(GPU1_JUNIT)
    gate, passed = proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2")
    assert not passed and "FAIL: not green: gpu2: own launches: no junit-launch.xml" in gate


def test_a_tier_cut_by_the_deadline_fails_the_proof_though_its_junit_is_green(tmp_path):
    """pytest writes its junit when the deadline interrupts it: the tests before the cut, all
    passed. The tier's exit status (timeout's 124, or 137 after the grace) says it was cut; any
    other status but 0 beside a green junit fails too (1x H200 at 55c8b1b: the gpu1 tier cut at
    88% reported green)."""
    folder = _folder(tmp_path, [], gpu1=GPU1_JUNIT, multi=GREEN)
    for status in (124, 137):
        text, met = proof_report.report(folder, gpus=2, setup_s=30, pytest_s=200, total_s=260, marker="gpu2",
                                        exits={"gpu1": status, "gpu2": 0}, **WORDS)
        assert not met and f"gpu1: cut by the proof's deadline (CPKIT_PROOF_TIMEOUT_S; exit {status}) after" in text
        gate, passed = proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2",
                                            exits={"gpu1": status})
        assert not passed and "- FAIL: not green: gpu1: cut by the proof's deadline" in gate
    gate, passed = proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2",
                                        exits={"gpu2: own launches": 2})
    assert not passed and "gpu2: own launches: pytest exit 2 (interrupted) though its junit has" in gate
    assert proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2",
                                exits={"gpu1": 0, "gpu2": 0, "gpu2: own launches": 0})[1]
    args = [str(folder), "--gpus", "2", "--marker", "gpu2", "--pytest-s", "200"]
    assert proof_report.main([*args, "--gpu1-exit", "0", "--pools-exit", "124", "--launches-exit", "0"]) == 1
    assert "gpu2: cut by the proof's deadline" in (folder / "README.md").read_text()
    assert proof_report.main([*args, "--gpu1-exit", "0", "--pools-exit", "0", "--launches-exit", "0"]) == 0


def test_a_dependency_skip_in_the_gpu1_tier_fails_the_proof_naming_the_part(tmp_path):
    te_skip = GPU1_JUNIT.replace('message="refused by design"', 'message="Transformer Engine is not importable"')
    folder = _folder(tmp_path, [], gpu1=te_skip, multi=GREEN)
    gate, passed = proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2")
    assert not passed and "Transformer Engine [te] is required: 1 test(s) skipped" in gate
    assert proof_report.verdict(folder, gpus=2, pytest_s=200, total_s=260, marker="gpu2", optional={"te"})[1]


def test_a_one_gpu_host_runs_gpu1_alone_with_no_budget(tmp_path, capsys):
    folder = _folder(tmp_path, [], multi=None)
    text, met = proof_report.report(folder, gpus=1, setup_s=30, pytest_s=400, total_s=500, marker="", gpu1_s=400,
                                    **WORDS)
    assert met and "Result: green" in text and "(1 xdist worker on 1 GPU, each worker pinned to one); no multi-GPU tier on 1 GPU" in text
    assert "| outcome | gpu1 | all |" in text and "| pytest (the gpu1 tier) | 400 |" in text
    assert "- none stated for a 1-GPU host; the walls above are reported" in text
    assert proof_report.main([str(folder), "--gpus", "1", "--marker", "", "--pytest-s", "400", "--gpu1-s", "400"]) == 0
    assert "- pass" in (folder / "README.md").read_text()


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
