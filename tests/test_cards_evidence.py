"""Results that need no git history and evidence that is not lost: content snapshots of recorded
commits (cpkit.cards.snapshot) judge freshness in a copy without .git, and evidence folders
(cpkit.cards.evidence), cluster logs included, are recorded with `cpkit cards record --evidence`
or listed by `cpkit cards status` as "evidence not recorded"."""

from __future__ import annotations

import datetime as dt
import gzip
import shutil
import subprocess
from pathlib import Path

import pytest

from cpkit.cards import LastResult, load_card, status_report, write_last_result
from cpkit.cards.check import check_cards
from cpkit.cards.evidence import EvidenceRun, parse_folder_name, read_cluster_log, read_evidence, unrecorded_evidence
from cpkit.cards.freshness import GIT_DIFF, SNAPSHOT
from cpkit.cards.record import keep_snapshots
from cpkit.cards.snapshot import SNAPSHOT_DIR, blob_id, changed_on_disk, find_snapshot
from cpkit.cli import main

from tests.test_cards_results import CARD, FIXTURES, ROOT, commit_all, git, needs_git, rows_by_id

CLUSTER_LOG = """cpkit.cluster: smoke, attention on 4 rank(s), 1 node(s), nccl
smoke: pass (8.7 s)
INFO:cpkit.parallel.groups:PROCESS_GROUPS rank=0 world_size=4
attention: FAIL (11.4 s)
attention: pass (1.0 s)
"""
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" timestamp="{stamp}">
<testcase classname="tests.fixture_suite" name="test_on_two_gpus" time="1"/>
<testcase classname="tests.fixture_suite" name="test_fast" time="1"/>
</testsuite></testsuites>
"""


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return Path(shutil.copytree(FIXTURES / "repo", tmp_path / "repo"))


def test_blob_id_is_gits_own():
    proc = subprocess.run(["git", "hash-object", "--stdin"], input=b"hello\n", capture_output=True) \
        if shutil.which("git") else None
    expected = proc.stdout.decode().strip() if proc else "ce013625030ba8dba906f756967f9e9ca394464a"
    assert blob_id(b"hello\n") == expected[:12] == "ce013625030b"


@needs_git
def test_a_copy_without_history_names_stale_results_by_file(repo, capsys):
    """Recording writes the commit's snapshot; with .git gone the result is fresh, then stale
    naming the edited, added and deleted files under its tests, and fresh again for docs."""
    (repo / ".gitignore").write_text(".venv/\n")
    git(repo, "init", "-q")
    first = commit_all(repo)
    write_last_result(repo / CARD, "two-gpus", LastResult("passed", dt.date(2026, 11, 22), "4x H200", first))
    assert keep_snapshots(repo) == []
    assert find_snapshot(repo, first[:7]) is not None  # a short form of the commit finds it
    shutil.rmtree(repo / ".git")
    (repo / ".venv" / "lib").mkdir(parents=True)
    (repo / ".venv" / "lib" / "x.py").write_text("ignored by .gitignore\n")
    (repo / "NOTES.md").write_text("docs\n")
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["state"] == "fresh" and row["verdict"] == "passed"
    core = repo / "src" / "demo" / "core.py"
    core.write_text(core.read_text() + "\n# edited in the copy\n")
    (repo / "src" / "demo" / "extra.py").write_text("x = 1\n")
    (repo / "src" / "demo" / "__init__.py").unlink()
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["state"] == "stale" and row["freshness"]["basis"] == SNAPSHOT
    assert row["freshness"]["changed"] == ["src/demo/__init__.py", "src/demo/core.py", "src/demo/extra.py"]
    assert main(["cards", "status", "--root", str(repo)]) == 0
    assert f"stale: 3 files under its tests changed since {first} (by {SNAPSHOT})" in capsys.readouterr().out


@needs_git
def test_a_depth_1_clone_judges_a_result_by_its_snapshot_and_says_so(repo, tmp_path, capsys):
    """`git clone --depth 1` (CI's default) lacks the result's commit: git cannot diff against
    it, the snapshot the checkout carries can; with the full history both are read."""
    (repo / ".gitignore").write_text(".venv/\n")
    git(repo, "init", "-q")
    first = commit_all(repo)
    write_last_result(repo / CARD, "two-gpus", LastResult("passed", dt.date(2026, 11, 22), "4x H200", first))
    assert keep_snapshots(repo) == []
    commit_all(repo)  # the result and its snapshot
    (repo / "NOTES.md").write_text("docs\n")
    commit_all(repo)
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(clone))
    assert git(clone, "rev-parse", "--is-shallow-repository") == "true"
    row = rows_by_id(clone)["two-gpus"]
    assert row["freshness"]["state"] == "fresh" and row["freshness"]["basis"] == SNAPSHOT
    for root in (clone, repo):
        core = root / "src" / "demo" / "core.py"
        core.write_text(core.read_text() + "\n# edited\n")
    row = rows_by_id(clone)["two-gpus"]
    assert row["freshness"]["state"] == "stale" and row["freshness"]["changed"] == ["src/demo/core.py"]
    assert row["freshness"]["basis"] == SNAPSHOT
    assert main(["cards", "status", "--root", str(clone)]) == 0
    assert f"changed since {first} (by {SNAPSHOT})" in capsys.readouterr().out
    row = rows_by_id(repo)["two-gpus"]
    assert row["freshness"]["changed"] == ["src/demo/core.py"]
    assert row["freshness"]["basis"] == f"{SNAPSHOT} and {GIT_DIFF}"


@needs_git
def test_the_snapshot_agrees_with_git_diff_on_this_repository():
    """For every commit the cards name that this clone has, the files changed on disk per its
    snapshot are git's own diff (evidence/ and cards/ left out), plus files git does not track
    yet. A shallow clone or a copy without .git has none of them: it skips, saying which."""
    if subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True,
                      text=True).stdout.strip() != str(ROOT):
        pytest.skip(f"{ROOT} is not a git checkout (a copied tree): freshness there is judged by the snapshots alone")
    untracked = set(subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.split())
    snapshots = sorted((ROOT / SNAPSHOT_DIR).glob("*.json"))
    assert snapshots, f"no snapshots under {SNAPSHOT_DIR}: run cpkit cards record"
    present = [f.stem for f in snapshots
               if subprocess.run(["git", "cat-file", "-e", f"{f.stem}^{{commit}}"], cwd=ROOT).returncode == 0]
    if not present:
        pytest.skip(f"this clone has none of the {len(snapshots)} recorded commits (a shallow clone): git cannot "
                    "diff against them, and freshness is judged by the snapshots alone")
    for commit in present:
        diff = subprocess.run(["git", "diff", "--name-only", "--no-renames", commit, "--"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split()
        by_git = {p for p in diff if not p.startswith(("evidence/", "cards/"))} | {
            p for p in untracked if not p.startswith(("evidence/", "cards/"))}
        assert set(changed_on_disk(ROOT, find_snapshot(ROOT, commit))) == by_git, commit


def test_every_commit_a_card_names_has_its_snapshot():
    """A copy without history judges freshness only from snapshots: `cpkit cards record` keeps
    one per commit a result or a measured claim names and none besides; a claim's commit that
    git no longer has (the run's tree was never committed) has none, and its staleness is unknown."""
    from cpkit.cards.schema import load_cards

    cards, problems = load_cards(ROOT)
    assert problems == []
    results = {i.last_result.commit for c in cards for i in c.follow_up_validation if i.last_result}
    claims = {claim.commit for c in cards for claim in c.claims}
    have = {p.stem for p in (ROOT / SNAPSHOT_DIR).glob("*.json")}
    assert results <= have and have <= results | claims
    if shutil.which("git") and (ROOT / ".git").exists():
        unknown = {c for c in claims - have
                   if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT).returncode != 0}
        assert claims - have == unknown, "write their snapshots with cpkit.cards.record.keep_snapshots(root)"


def test_cluster_log_and_evidence_folder_are_read(tmp_path):
    root = tmp_path
    (root / "tests").mkdir()
    (root / "tests" / "fixture_suite.py").write_text("")
    folder = root / "evidence" / "2026-11-26-4xH100-a107ba0"
    folder.mkdir(parents=True)
    (folder / "cluster.log").write_text(CLUSTER_LOG)
    (folder / "junit.xml.gz").write_bytes(gzip.compress(JUNIT.format(stamp="2026-11-26T10:00:00").encode()))
    # A junit of another commit kept for comparison is not this run's.
    (folder / "junit-cf8feac-before.xml").write_text(JUNIT.replace("/>", "><failure>x</failure></testcase>")
                                                     .format(stamp="2026-11-26T09:00:00"))
    assert read_cluster_log(folder / "cluster.log") == {"cluster:smoke": "passed", "cluster:attention": "failed"}
    run = read_evidence("evidence/2026-11-26-4xH100-a107ba0", root)
    assert (run.date, run.machine, run.commit, run.gpus) == (dt.date(2026, 11, 26), "4xH100", "a107ba0", 4)
    assert run.files == ("junit.xml.gz", "cluster.log") and run.stamp == "2026-11-26T10:00:00"
    assert run.outcomes["tests/fixture_suite.py::test_on_two_gpus"] == "passed"
    with pytest.raises(ValueError, match="is not named <YYYY-MM-DD>-<machine>-<commit>"):
        parse_folder_name("latest-run")
    (root / "evidence" / "2026-11-27-cpu-abc1234").mkdir()
    with pytest.raises(ValueError, match="holds no junit file"):
        read_evidence(root / "evidence" / "2026-11-27-cpu-abc1234", root)


@pytest.mark.parametrize("machine,gpus,fits_one", [("cpu", 0, False), ("CPU", 0, False), ("1xH100", 1, True),
                                                   ("4xH200", 4, True), ("laptop", None, True)])
def test_a_folders_machine_says_how_many_gpus_ran(machine, gpus, fits_one):
    """A CPU folder ran no GPU: it never records a GPU follow-up (a machine the name does not
    count is not held against the follow-up)."""
    run = EvidenceRun(f"evidence/2026-11-27-{machine}-abc1234", dt.date(2026, 11, 27), machine, "abc1234")
    assert run.gpus == gpus and run.fits(1) is fits_one and run.fits(0)


def _evidence(repo: Path, name: str, stamp: str, log: str | None = None) -> Path:
    folder = repo / "evidence" / name
    folder.mkdir(parents=True)
    (folder / "junit.xml").write_text(JUNIT.format(stamp=stamp))
    if log:
        (folder / "cluster.log").write_text(log)
    return folder


def test_evidence_is_recorded_or_listed_as_not_recorded(repo, capsys):
    """A newer evidence folder covering a GPU follow-up is listed until recorded; recording
    takes date, machine and commit from its name, never replaces a newer result, and a machine
    with fewer GPUs than the follow-up needs neither counts nor records."""
    _evidence(repo, "2026-11-20-1xH100-1111111", "2026-11-20T10:00:00")
    _evidence(repo, "2026-11-24-4xH100-2222222", "2026-11-24T10:00:00")
    write_last_result(repo / CARD, "two-gpus", LastResult("passed", dt.date(2026, 11, 22), "4x H200", "abc1234"))
    row = status_report(repo)["rows"]
    by_id = {r["id"]: r for r in row}
    assert by_id["two-gpus"]["unrecorded_evidence"] == ["evidence/2026-11-24-4xH100-2222222"]
    assert by_id["builds"]["unrecorded_evidence"] == []  # a unit follow-up runs here
    assert main(["cards", "status", "--root", str(repo)]) == 0
    assert ("evidence not recorded: evidence/2026-11-24-4xH100-2222222 (cpkit cards record --evidence"
            in capsys.readouterr().out)
    assert main(["cards", "record", "--root", str(repo), "--evidence", "evidence/2026-11-20-1xH100-1111111"]) == 0
    last = {i.id: i.last_result for i in load_card(repo / CARD, repo).follow_up_validation}
    assert last["two-gpus"].commit == "abc1234"  # older, and a 1-GPU machine: kept
    assert last["builds"].commit == "1111111" and last["builds"].evidence == "evidence/2026-11-20-1xH100-1111111"
    assert main(["cards", "record", "--root", str(repo), "--evidence", "evidence/2026-11-24-4xH100-2222222",
                 "--machine", "4x H100 (torch 2.11)"]) == 0
    two = {i.id: i.last_result for i in load_card(repo / CARD, repo).follow_up_validation}["two-gpus"]
    assert (two.commit, two.date, two.machine, two.evidence) == (
        "2222222", dt.date(2026, 11, 24), "4x H100 (torch 2.11)", "evidence/2026-11-24-4xH100-2222222")
    assert {r["id"]: r for r in status_report(repo)["rows"]}["two-gpus"]["unrecorded_evidence"] == []
    assert check_cards(repo, collect=None, today=dt.date(2026, 11, 27)) == []


def test_a_same_day_run_is_listed_only_when_later_than_the_recorded_folder():
    from cpkit.cards.evidence import EvidenceRun

    node = "functional/test_x.py::test_y"
    early = EvidenceRun("evidence/2026-11-27-4xH100-aaaaaaa", dt.date(2026, 11, 27), "4xH100", "aaaaaaa",
                        {node: "passed"}, ("junit.xml",), "2026-11-27T01:00:00")
    late = EvidenceRun("evidence/2026-11-27-4xH100-0000000", dt.date(2026, 11, 27), "4xH100", "0000000",
                       {node: "passed"}, ("junit.xml",), "2026-11-27T05:00:00")
    recorded = LastResult("passed", dt.date(2026, 11, 27), "4x H100", "aaaaaaa", evidence=early.folder)
    assert unrecorded_evidence((node,), recorded, [early, late], 4) == [late.folder]
    assert unrecorded_evidence((node,), recorded, [early, late], 8) == []
    unnamed = LastResult("passed", dt.date(2026, 11, 27), "4x H100", "aaaaaaa")
    assert unrecorded_evidence((node,), unnamed, [early, late], 4) == []


def test_cluster_entries_are_checked_against_the_cluster_checks(repo):
    text = (repo / CARD).read_text().replace(
        "covered_by: [tests/fixture_suite.py::test_on_two_gpus]",
        "covered_by: [tests/fixture_suite.py::test_on_two_gpus, cluster:smoke, cluster:smoek]")
    (repo / CARD).write_text(text)
    problems = check_cards(repo, collect=None)
    assert len(problems) == 1 and "'cluster:smoek' names no check of python -m cpkit.cluster" in problems[0]
    assert "e.g. cluster:smoke" in problems[0]


def test_record_arguments_are_refused_with_the_fix(repo, capsys):
    _evidence(repo, "2026-11-24-4xH100-2222222", "2026-11-24T10:00:00")
    assert main(["cards", "record", "--root", str(repo), "--junit", "x.xml"]) == 2
    assert "--junit needs --machine" in capsys.readouterr().err
    assert main(["cards", "record", "--root", str(repo), "--evidence", "evidence/2026-11-24-4xH100-2222222",
                 "--commit", "abc1234"]) == 2
    assert "drop --commit/--date" in capsys.readouterr().err
    assert main(["cards", "record", "--root", str(repo), "--evidence", "evidence/nope"]) == 2
    assert "no such evidence folder" in capsys.readouterr().err
