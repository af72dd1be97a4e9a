"""What a card's follow-ups last measured, apart from what the card claims: `last_result` with its
commit, staleness by git and the change map (cpkit.cards.freshness), `cpkit cards record` from a
pytest junit file (cpkit.cards.record, cpkit.validation.junit), and the cards modules importing only
downward (one module owns the node-id matcher)."""

from __future__ import annotations

import datetime as dt
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cpkit.cards import LastResult, load_card, record_junit, status_report, write_last_result
from cpkit.cards.check import check_cards
from cpkit.cli import main
from cpkit.validation.import_graph import cpkit_imports, imports, package_modules
from cpkit.validation.junit import read_junit

FIXTURES = Path(__file__).parent / "fixtures" / "cards"
ROOT = Path(__file__).resolve().parents[1]
CARD = "cards/demo-feature/card.yaml"
ATTENTION = "cards/context-parallel-attention/card.yaml"
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(root), "PATH": "/usr/bin:/bin:/usr/local/bin"}
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True, env=env).stdout.strip()


def commit_all(root: Path) -> str:
    git(root, "add", "-A")
    git(root, "commit", "-qm", "snapshot")
    return git(root, "rev-parse", "--short=12", "HEAD")


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return Path(shutil.copytree(FIXTURES / "repo", tmp_path / "repo"))


def result(commit: str, **extra) -> LastResult:
    return LastResult("passed", dt.date(2026, 11, 22), "4x H200", commit, **extra)


def rows_by_id(root: Path, feature: str | None = None) -> dict[str, dict]:
    return {r["id"]: r for r in status_report(root, feature)["rows"]}


# ----------------------------------------------------------------------------- staleness


@needs_git
def test_a_result_goes_stale_when_code_under_its_tests_changes_and_not_for_docs(repo):
    git(repo, "init", "-q")
    first = commit_all(repo)
    write_last_result(repo / CARD, "two-gpus", result(first))
    commit_all(repo)  # a card edit is no code under the test
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["state"] == "fresh" and row["verdict"] == "passed"
    (repo / "NOTES.md").write_text("docs only\n")
    commit_all(repo)
    assert rows_by_id(repo)["two-gpus"]["freshness"]["state"] == "fresh"
    core = repo / "src" / "demo" / "core.py"
    core.write_text(core.read_text() + "\n# changed, not committed\n")
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["state"] == "stale" and row["freshness"]["changed"] == ["src/demo/core.py"]
    assert row["verdict"] == "passed, stale"
    assert row["measured"]["tests/fixture_suite.py::test_on_two_gpus"]["freshness"]["state"] == "stale"
    table = main(["cards", "status", "--root", str(repo)])
    assert table == 0


@needs_git
def test_a_commit_this_clone_lacks_or_no_git_is_unknown_never_fresh(repo, capsys):
    git(repo, "init", "-q")
    commit_all(repo)
    write_last_result(repo / CARD, "two-gpus", result("1ec52e4"))
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["state"] == "unknown" and "1ec52e4 is not in this clone" in row["freshness"]["why"]
    assert row["verdict"] == "passed, staleness unknown"
    shutil.rmtree(repo / ".git")
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["state"] == "unknown"
    assert row["freshness"]["why"] == "no git checkout here and no snapshot of 1ec52e4 under cards/_snapshots"
    assert main(["cards", "status", "--root", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "last result: passed on 4x H200 at 1ec52e4, 2026-11-22: staleness unknown" in out
    assert "staleness unknown: no git checkout here and no snapshot of 1ec52e4" in out


@needs_git
def test_the_attention_cards_gpu_results_go_stale_after_a_change_to_src_cpkit_attention(tmp_path, capsys):
    """The repository's own attention card in a fresh git copy, its recorded commits pointed at
    that copy's first commit: fresh; then one line added to an attention module: every GPU result
    is stale and names the file, in the report, the table and cpkit validate's card row. (The
    copy leaves out the snapshots: only the rewritten results are judged, by git.)"""
    root = tmp_path / "cpkit"
    for part in ("src", "tests", "functional", "cards", "pyproject.toml"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, root / part,
             **({"ignore": shutil.ignore_patterns("__pycache__", "_snapshots")} if part != "pyproject.toml" else {}))
    git(root, "init", "-q")
    first = commit_all(root)
    card = root / ATTENTION
    gpu = [i for i in load_card(card, root).follow_up_validation if i.needs.startswith("gpu") and i.last_result]
    assert len(gpu) >= 5
    for item in gpu:
        old = item.last_result
        write_last_result(card, item.id, LastResult(old.outcome, old.date, old.machine, first, old.detail, old.tests))
    commit_all(root)
    rows = rows_by_id(root, "context-parallel-attention")
    assert {rows[i.id]["freshness"]["state"] for i in gpu} == {"fresh"}
    for name in ("p2p.py", "a2a.py", "kernels.py", "te.py"):
        module = root / "src" / "cpkit" / "attention" / name
        saved = module.read_text()
        module.write_text(saved + "\n# a change\n")
        rows = rows_by_id(root, "context-parallel-attention")
        for item in gpu:
            assert rows[item.id]["freshness"]["state"] == "stale", (name, item.id)
            assert f"src/cpkit/attention/{name}" in rows[item.id]["freshness"]["changed"]
            assert rows[item.id]["verdict"] == f"{item.last_result.outcome}, stale"
        module.write_text(saved)
    # A new module under attention/ that nothing imports yet: the attention tests of the change
    # map's row cover it (the throughput bench reaches attention by imports only, so not it).
    (root / "src" / "cpkit" / "attention" / "new_kernel.py").write_text("X = 1\n")
    git(root, "add", "-A")
    rows = rows_by_id(root, "context-parallel-attention")
    assert [i.id for i in gpu if rows[i.id]["freshness"]["state"] != "stale"] == ["throughput-vs-te"]
    p2p = root / "src" / "cpkit" / "attention" / "p2p.py"
    p2p.write_text(p2p.read_text() + "\n# a change\n")
    assert main(["cards", "status", "--root", str(root), "--feature", "context-parallel-attention"]) == 0
    out = capsys.readouterr().out
    blocks = re.split(r"\n  (?=\S)", out)  # one block per follow-up
    for item in gpu:
        (block,) = [b for b in blocks if b.startswith(f"{item.id}  claim: ")]
        text = " ".join(block.split())
        assert f"at {first}, {item.last_result.date}: STALE" in text, text
        assert "under its tests changed since" in text and "src/cpkit/attention/p2p.py" in text
    from cpkit.commands.validate import _card_rows

    (row,) = [r for r in _card_rows(root) if r["feature"] == "context-parallel-attention"]
    assert f"{len(gpu)} stale" in row["result"]
    stale = [n for n in row["notes"] if n.startswith("last result stale: ")]
    assert len(stale) == len(gpu) and all("src/cpkit/attention/p2p.py" in n for n in stale), row["notes"]


# ----------------------------------------------------------------------------- junit and record

JUNIT = textwrap.dedent("""\
    <?xml version="1.0" encoding="utf-8"?>
    <testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="6" timestamp="2026-11-26T10:00:00.1">
    <testcase classname="functional.test_attention" name="test_cp_attention_matches_full_attention[nccl2-a2a+p2p-[2,1]-bf16]" time="1"/>
    <testcase classname="functional.test_attention" name="test_cp_attention_matches_full_attention[nccl4-a2a-thd]" time="1"><failure message="dq">x</failure></testcase>
    <testcase classname="functional.test_te_backend" name="test_te_hierarchical_cp[nccl4-a2a+p2p-[2,2]]" time="1"><skipped type="pytest.skip" message="no TE">s</skipped></testcase>
    <testcase classname="functional.test_dynamic_p2p_shapes" name="test_x[nccl4]" time="1"><skipped type="pytest.xfail" message="upstream">s</skipped></testcase>
    <testcase classname="tests.test_layout.TestThing" name="test_y" time="1"><error message="setup">e</error></testcase>
    <testcase classname="functional.test_attention" name="test_cp_attention_matches_full_attention[nccl2-a2a+p2p-[2,1]-bf16]" time="1"/>
    </testsuite></testsuites>
""")


def test_junit_node_ids_are_rebuilt_with_parameters_classes_and_outcomes(tmp_path):
    path = tmp_path / "gpu.xml"
    path.write_text(JUNIT)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_layout.py").write_text("")
    outcomes, stamp = read_junit(path, tmp_path)
    assert stamp.startswith("2026-11-26")
    assert outcomes == {
        "functional/test_attention.py::test_cp_attention_matches_full_attention[nccl2-a2a+p2p-[2,1]-bf16]": "passed",
        "functional/test_attention.py::test_cp_attention_matches_full_attention[nccl4-a2a-thd]": "failed",
        "functional/test_te_backend.py::test_te_hierarchical_cp[nccl4-a2a+p2p-[2,2]]": "skipped",
        "functional/test_dynamic_p2p_shapes.py::test_x[nccl4]": "xfailed",
        "tests/test_layout.py::TestThing::test_y": "error",
    }
    path.write_text("<html/>")
    with pytest.raises(ValueError, match="not a junit XML file"):
        read_junit(path)


def run_fixture_suite(repo: Path, junit: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fixture_suite.py",
                    f"--junitxml={junit}", *args], cwd=repo, capture_output=True, timeout=120)


def test_record_writes_each_covering_tests_outcome_from_a_pytest_junit_file(repo, capsys):
    shutil.copy(FIXTURES / "failing_test.yaml", repo / CARD)
    junit = repo / "run.xml"
    run_fixture_suite(repo, junit, "-k", "not two_gpus")
    before = (repo / CARD).read_text()
    assert main(["cards", "record", "--root", str(repo), "--junit", str(junit), "--machine", "4x H100",
                 "--commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert f"{CARD}: all-params: failed at abc1234 (1 passed, 1 failed)" in out
    card = load_card(repo / CARD, repo)
    last = {i.id: i.last_result for i in card.follow_up_validation}
    assert last["builds"].outcome == "passed" and last["builds"].machine == "4x H100"
    assert last["builds"].commit == "abc1234" and last["builds"].date == dt.date.today()
    assert dict(last["builds"].tests) == {"tests/fixture_suite.py::test_fast": "passed",
                                          "tests/fixture_suite.py::test_param[2]": "passed",
                                          "tests/fixture_suite.py::TestGroup::test_member": "passed"}
    assert dict(last["all-params"].tests) == {"tests/fixture_suite.py::test_param": "passed",
                                              "tests/fixture_suite.py::test_fails": "failed"}
    assert last["two-gpus"] is None and last["multi-rank"] is None  # deselected: not run, nothing written
    # Only last_result blocks were added: every line of the card before is still there, in order.
    after = (repo / CARD).read_text().splitlines()
    assert [ln for ln in after if ln in before.splitlines()] == before.splitlines()
    assert check_cards(repo, collect=None, today=dt.date.today()) == []
    # The status shows each covering test's own result, the failing one never as "covered".
    assert main(["cards", "status", "--root", str(repo), "--feature", "demo-feature"]) == 0
    table = capsys.readouterr().out
    assert "tests/fixture_suite.py::test_fails  (failed at abc1234, staleness unknown)" in table
    assert "last result: failed on 4x H100 at abc1234" in table


def test_a_later_record_replaces_the_last_result_and_a_partial_run_says_what_did_not_run(repo):
    junit = repo / "run.xml"
    run_fixture_suite(repo, junit)
    record_junit(repo, [junit], "1x H100", "abc1234", dt.date(2026, 11, 1))
    run_fixture_suite(repo, junit, "-k", "test_fast")
    (only,) = record_junit(repo, [junit], "4x H100", "def5678", dt.date(2026, 11, 2))
    assert only.id == "builds" and only.result.outcome == "passed"
    assert dict(only.result.tests)["tests/fixture_suite.py::test_param[2]"] == "not run"
    assert "2 of 3 covering entries not in it" in only.result.detail
    last = {i.id: i.last_result for i in load_card(repo / CARD, repo).follow_up_validation}
    assert (last["builds"].commit, last["all-params"].commit, last["two-gpus"].commit) == ("def5678", "abc1234", "abc1234")
    assert (repo / CARD).read_text().count("last_result:") == 3


def test_record_without_a_commit_outside_git_asks_for_one(repo, capsys):
    junit = repo / "run.xml"
    run_fixture_suite(repo, junit)
    assert main(["cards", "record", "--root", str(repo), "--junit", str(junit), "--machine", "4x H100"]) == 2
    assert "pass --commit SHA" in capsys.readouterr().err


# ----------------------------------------------------------------------------- layering


def test_the_cards_modules_import_only_downward():
    """schema, nodes, snapshot, claim_scope -> freshness, evidence -> record -> status -> upstream -> claims -> bench_pointers -> check -> render:
    each imports only modules listed before it (no circle; one module owns the shared matcher)."""
    order = ["schema", "nodes", "snapshot", "claim_scope", "freshness", "evidence", "record", "status", "upstream", "claims", "bench_pointers", "check",
             "render"]
    src = ROOT / "src"
    modules = package_modules(src)
    for i, name in enumerate(order):
        path = modules[f"cpkit.cards.{name}"]
        cards = {m.rsplit(".", 1)[1] for m in cpkit_imports(imports(path, src), modules) if m.startswith("cpkit.cards.")}
        assert cards <= set(order[:i]), f"cpkit.cards.{name} imports {sorted(cards - set(order[:i]))}"
    assert {m for m in modules if m.startswith("cpkit.cards.")} == {f"cpkit.cards.{n}" for n in order}


def test_a_run_that_only_skipped_a_follow_ups_tests_leaves_its_last_result(repo):
    """A CPU run skips the GPU tests: their recorded GPU result must stay, not turn partial."""
    write_last_result(repo / CARD, "two-gpus", result("abc1234"))
    junit = repo / "run.xml"
    run_fixture_suite(repo, junit)
    tree = ET.parse(junit)
    for case in tree.getroot().iter("testcase"):
        if case.get("name") == "test_on_two_gpus":
            ET.SubElement(case, "skipped", type="pytest.skip", message="needs 2 CUDA devices, found 0")
    tree.write(junit)
    recorded = {r.id for r in record_junit(repo, [junit], "2-core CPU", "def5678", dt.date(2026, 11, 2))}
    assert "two-gpus" not in recorded and "builds" in recorded
    last = {i.id: i.last_result for i in load_card(repo / CARD, repo).follow_up_validation}
    assert last["two-gpus"] == result("abc1234")
