"""cpkit.cards, cpkit.validation.anchors and `cpkit cards`, on the miniature repository in fixtures/cards/repo.

Each file in fixtures/cards/bad/ is the fixture card with one defect; each must be rejected with
an error that names the file, the key path and the problem.
"""

import datetime as dt
import json
import shutil
from pathlib import Path

import pytest

from cpkit.validation.anchors import resolve_anchor, split_anchor
from cpkit.cards import (
    CardError,
    ast_collect_node_ids,
    check_cards,
    format_status_table,
    load_card,
    node_matches,
    status_report,
)
from cpkit.cli import main
from cpkit.validation.strict_yaml import StrictYAMLError, load_strict_yaml

FIXTURES = Path(__file__).parent / "fixtures" / "cards"
CARD = "cards/demo-feature/card.yaml"
TODAY = dt.date(2025, 6, 1)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A private copy of the miniature repository (tests may edit it)."""
    # Its tests need no third-party pytest plugins; not loading them makes each subprocess 4x faster.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return Path(shutil.copytree(FIXTURES / "repo", tmp_path / "repo"))


def use_card(repo: Path, fixture: Path) -> None:
    shutil.copy(fixture, repo / CARD)


# ----------------------------------------------------------------------------- loading


def test_good_card_loads():
    card = load_card(FIXTURES / "repo" / CARD, FIXTURES / "repo", today=TODAY)
    assert card.feature == "demo-feature" and card.path == CARD
    assert card.validated_on == dt.date(2025, 1, 15)
    assert card.validation_status == "partial"
    assert [i.id for i in card.follow_up_validation] == ["builds", "all-params", "two-gpus", "multi-rank"]
    assert card.follow_up_validation[0].covered_by[1] == "tests/fixture_suite.py::test_param[2]"
    assert card.follow_up_validation[3].covered_by == ()  # open, nothing listed


BAD_CARDS = {
    "duplicate_key": "summary: duplicate key",
    "duplicate_nested_key": "follow_up_validation[0].id: duplicate key",
    "unknown_key": "owner: unknown key",
    "unknown_follow_up_key": "follow_up_validation[2].priority: unknown key",
    "anchor_alias": "known_constraints: YAML anchor &constraints is not allowed",
    "bad_date": "validated_on: '2025-02-30' is not a valid date",
    "date_not_iso": "validated_on: '15/01/2025' is not a date in YYYY-MM-DD form",
    "future_date": "validated_on: '2099-01-01' is in the future",
    "bad_validation_status": "validation_status: 'code_verified' is not one of verified_gpu, verified_cpu, partial, unverified",
    "bad_follow_up_status": "follow_up_validation[2].status: 'done' is not one of open, covered",
    "bad_needs": "follow_up_validation[3].needs: 'gpu8' is not one of unit, dist, gpu1, gpu2, gpu4",
    "wrong_type": "known_constraints: expected a list of strings, got str",
    "missing_key": "title: missing required key",
    "missing_follow_up_key": "follow_up_validation[3].text: missing required key",
    "not_a_mapping": "top level: expected a mapping",
    "missing_evidence_path": "evidence[0]: 'src/demo/missing.py' does not exist",
    "missing_symbol": "evidence[1]: 'src/demo/core.py::Widget.destroy' no symbol 'Widget.destroy'",
    "covered_without_tests": "follow_up_validation[3].covered_by: a covered item needs at least one pytest node id",
    "unknown_node_symbol": "covered_by[0]: 'tests/fixture_suite.py::test_on_eight_gpus' no symbol",
    "unknown_node_file": "covered_by[0]: 'tests/other_suite.py::test_on_two_gpus' does not exist",
    "verified_with_open_item": "validation_status: 'verified_cpu' claims verification but follow-ups are open (multi-rank)",
    "duplicate_follow_up_id": "follow_up_validation: duplicate follow-up ids: builds",
}


def test_every_bad_fixture_has_an_expectation():
    assert sorted(p.stem for p in (FIXTURES / "bad").glob("*.yaml")) == sorted(BAD_CARDS)


@pytest.mark.parametrize("name", sorted(BAD_CARDS))
def test_bad_card_is_rejected_with_file_and_key_path(repo, name):
    use_card(repo, FIXTURES / "bad" / f"{name}.yaml")
    problems = check_cards(repo, collect=ast_collect_node_ids, today=TODAY)
    assert problems, f"{name} was accepted"
    assert any(p.startswith(f"{CARD}: ") and BAD_CARDS[name] in p for p in problems), problems


def test_load_card_raises_with_every_problem(repo):
    text = (repo / CARD).read_text().replace("title: Demo feature\n", "").replace("validation_status: partial", "validation_status: done")
    (repo / CARD).write_text(text)
    with pytest.raises(CardError) as err:
        load_card(repo / CARD, repo, today=TODAY)
    assert len(err.value.problems) == 2
    assert all(p.startswith(f"{CARD}: ") for p in err.value.problems)


def test_strict_yaml_rejects_alias_with_key_path():
    with pytest.raises(StrictYAMLError) as err:
        load_strict_yaml("a: &x 1\nb:\n  - c: *x\n")
    assert str(err.value).startswith("a: YAML anchor &x")
    with pytest.raises(StrictYAMLError) as err:
        load_strict_yaml("a: 1\nb:\n  - c: *x\n")
    assert "b[0].c: YAML alias *x" in str(err.value)


def test_strict_yaml_keeps_dates_as_strings():
    assert load_strict_yaml("d: 2025-01-15\n") == {"d": "2025-01-15"}


# ----------------------------------------------------------------------------- anchors


@pytest.mark.parametrize(
    "anchor",
    [
        "src/demo/core.py",
        "src/demo/",
        "src/demo/core.py::Widget",
        "src/demo/core.py::Widget.build",
        "src/demo/core.py::Widget.build.inner",
        "src/demo/core.py::Widget.size",
        "src/demo/core.py::DEFAULT_SIZE",
        "src/demo/core.py::to_json",  # imported inside try:
        "tests/fixture_suite.py::TestGroup::test_member",
        "tests/fixture_suite.py::test_param[2]",
        "tests/*.py",
        "cards/<feature>/card.yaml",
    ],
)
def test_anchor_resolves(anchor):
    assert resolve_anchor(FIXTURES / "repo", anchor) is None


@pytest.mark.parametrize(
    ("anchor", "reason"),
    [
        ("src/demo/nope.py", "does not exist"),
        ("src/demo/core.py/", "is not a folder"),
        ("src/demo/core.py::Widget.nope", "no symbol 'Widget.nope'"),
        ("src/demo/core.py::Widget.build.local_value", "no symbol"),  # a local, not addressable
        ("src/demo/core.py::DEFAULT_SIZE.real", "no symbol"),
        ("src/demo/core.py::Widget()", "not a dotted Python name"),
        ("src/demo/::Widget", "needs a .py file"),
        ("../repo/src/demo/core.py", "relative to the repository root"),
        ("tests/*.txt", "matches no path"),
    ],
)
def test_anchor_does_not_resolve(anchor, reason):
    assert reason in (resolve_anchor(FIXTURES / "repo", anchor) or "")


def test_split_anchor_accepts_dotted_and_pytest_forms():
    assert split_anchor("a.py::A.b") == split_anchor("a.py::A::b[x-1]") == ("a.py", ["A", "b"])


# ----------------------------------------------------------------------------- checks


def test_good_repo_passes_with_real_pytest_collection(repo):
    notes = []
    assert check_cards(repo, notes=notes, today=TODAY) == []
    assert notes == []


def test_param_id_that_pytest_does_not_collect_is_rejected(repo):
    # The ast fallback would accept test_param[3]; only the real collection knows the parameters.
    use_card(repo, FIXTURES / "uncollected_param.yaml")
    assert check_cards(repo, today=TODAY) == [
        f"{CARD}: follow_up_validation[0].covered_by[1]: "
        "'tests/fixture_suite.py::test_param[3]' is not collected by pytest"
    ]


def test_collection_can_be_skipped_but_anchors_are_still_checked(repo):
    # `cpkit validate --changed` skips the collection when no test file or card changed.
    use_card(repo, FIXTURES / "uncollected_param.yaml")
    assert check_cards(repo, collect=None, today=TODAY) == []
    text = (repo / CARD).read_text().replace("tests/fixture_suite.py::test_param[3]", "tests/fixture_suite.py::test_gone")
    (repo / CARD).write_text(text)
    assert check_cards(repo, collect=None, today=TODAY) == [
        f"{CARD}: follow_up_validation[0].covered_by[1]: "
        "'tests/fixture_suite.py::test_gone' no symbol 'test_gone' in tests/fixture_suite.py"
    ]


def test_uncollectable_file_falls_back_to_ast_and_says_so(repo):
    (repo / "tests" / "broken_suite.py").write_text("import no_such_module_xyz\n\ndef test_a():\n    pass\n")
    text = (repo / CARD).read_text().replace(
        "covered_by: [tests/fixture_suite.py::test_on_two_gpus]", "covered_by: [tests/broken_suite.py::test_a]"
    )
    (repo / CARD).write_text(text)
    notes = []
    assert check_cards(repo, notes=notes, today=TODAY) == []
    assert len(notes) == 1 and "tests/broken_suite.py with ast" in notes[0] and "no_such_module_xyz" in notes[0]


def test_card_without_skill_or_yaml_is_reported(repo):
    shutil.rmtree(repo / "skills" / "demo-feature")
    (repo / "cards" / "Bad_Slug").mkdir()
    problems = check_cards(repo, collect=ast_collect_node_ids, today=TODAY)
    assert f"{CARD}: no matching skill skills/demo-feature/SKILL.md" in problems
    assert "cards/Bad_Slug: missing card.yaml" in problems
    assert any("'Bad_Slug' is not a kebab-case feature slug" in p for p in problems)


@pytest.mark.parametrize(
    ("entry", "node", "expected"),
    [
        ("t.py::test_a", "t.py::test_a", True),
        ("t.py::test_a", "t.py::test_a[1]", True),
        ("t.py::T", "t.py::T::test_a", True),
        ("t.py", "t.py::test_a", True),
        ("t.py::test_a", "t.py::test_ab", False),
        ("t.py::test_a[1]", "t.py::test_a[10]", False),
    ],
)
def test_node_matches(entry, node, expected):
    assert node_matches(entry, node) is expected


# ----------------------------------------------------------------------------- status


def test_status_without_run_lists_follow_ups():
    rows = status_report(FIXTURES / "repo")["rows"]
    assert [(r["id"], r["status"], r["needs"], r["result"]) for r in rows] == [
        ("builds", "covered", "unit", None),
        ("all-params", "covered", "unit", None),
        ("two-gpus", "covered", "gpu2", None),
        ("multi-rank", "open", "dist", None),
    ]
    assert [r["verdict"] for r in rows] == ["not run"] * 4  # a claim is not a result
    table = format_status_table(rows)
    assert table.splitlines()[0] == "demo-feature  [partial]"
    assert "  builds  claim: covered, needs unit" in table.splitlines()
    assert "tests/fixture_suite.py::TestGroup::test_member" in table


def test_status_run_reports_failures_and_writes_evidence(repo, tmp_path, capsys):
    use_card(repo, FIXTURES / "failing_test.yaml")
    out = tmp_path / "evidence" / "status.json"
    code = main(["cards", "status", "--root", str(repo), "--run", "--json", "--out", str(out)])
    assert code == 1
    printed = json.loads(capsys.readouterr().out)  # pytest's own output went to stderr
    report = json.loads(out.read_text())
    assert printed["rows"] == report["rows"]
    rows = {r["id"]: r for r in report["rows"]}
    assert rows["builds"]["result"] == "passed"
    assert rows["builds"]["results"]["tests/fixture_suite.py::test_param[2]"] == "passed"
    assert rows["all-params"]["results"] == {
        "tests/fixture_suite.py::test_param": "passed",
        "tests/fixture_suite.py::test_fails": "failed",
    }
    assert rows["all-params"]["result"] == "failed"
    assert rows["two-gpus"]["result"] == "needs gpu2"  # this machine has no GPUs
    assert rows["multi-rank"]["result"] == "no tests"
    assert report["pytest"]["exit_code"] == 1 and report["run"] is True


def test_status_run_passes_when_covering_tests_pass(repo, capsys):
    assert main(["cards", "status", "--root", str(repo), "--run", "--out", str(repo / "s.json")]) == 0
    table = capsys.readouterr().out
    assert "needs gpu2" in table and "passed" in table


def test_status_unknown_feature_is_a_usage_error(capsys):
    assert main(["cards", "status", "--root", str(FIXTURES / "repo"), "--feature", "nope"]) == 2
    assert "no card for feature 'nope'" in capsys.readouterr().err


def test_status_of_a_broken_card_fails(repo, capsys):
    use_card(repo, FIXTURES / "bad" / "bad_follow_up_status.yaml")
    assert main(["cards", "status", "--root", str(repo)]) == 1
    assert "follow_up_validation[2].status" in capsys.readouterr().out


def test_check_command_exit_codes(repo, capsys):
    use_card(repo, FIXTURES / "bad" / "bad_needs.yaml")
    assert main(["cards", "check", "--root", str(repo)]) == 1
    assert "'gpu8' is not one of" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["cards"])
    assert err.value.code == 2


def test_last_result_must_name_outcome_date_machine_and_commit():
    from cpkit.cards.schema import _check_follow_up

    item = {"id": "x", "text": "t", "status": "covered", "needs": "gpu4", "covered_by": ["tests/a.py::b", "tests/a.py::c"]}
    good = {"outcome": "passed", "date": "2026-11-22", "machine": "4x H200", "commit": "1ec52e4"}
    assert _check_follow_up({**item, "last_result": good}, "f", TODAY.replace(year=2027)) == []
    assert _check_follow_up({**item, "last_result": {**good, "detail": "3 of 3",
                                                     "tests": {"tests/a.py::b": "passed", "tests/a.py::c": "not run"}}},
                            "f", TODAY.replace(year=2027)) == []
    (old,) = _check_follow_up({**item, "last_result": "passed 2026-11-21 on 4x NVIDIA H200: 3 passed"}, "f")
    assert old.startswith("f.last_result: expected a mapping with keys outcome, date, machine, commit") and "got str" in old
    bad = {"outcome": "fine", "date": "2026-11-22", "machine": "4x H200", "commit": "HEAD~1",
           "tests": {"tests/a.py::zz": "passed", "tests/a.py::b": "ok"}, "by": "me"}
    assert sorted(_check_follow_up({**item, "last_result": bad}, "f", TODAY.replace(year=2027))) == sorted([
        "f.last_result.by: unknown key (allowed: outcome, date, machine, commit, detail, tests, evidence)",
        "f.last_result.outcome: 'fine' is not one of passed, failed, partial",
        "f.last_result.commit: 'HEAD~1' is not a git commit (7 to 40 hex digits)",
        "f.last_result.tests: 'tests/a.py::zz' is not a covered_by entry of this follow-up",
        "f.last_result.tests['tests/a.py::b']: 'ok' is not one of passed, failed, skipped, not run",
    ])
    missing = _check_follow_up({**item, "last_result": {"outcome": "passed", "date": "2030-01-01"}}, "f", TODAY)
    assert missing == ["f.last_result.date: '2030-01-01' is in the future", "f.last_result.machine: missing required key",
                       "f.last_result.commit: missing required key"]


def test_check_says_what_it_waits_on_before_collecting(repo, capsys):
    """pytest's collection is the slow part of `cpkit cards check`: a line on stderr says so
    before it starts, so that a newcomer does not look at a silent terminal."""
    assert main(["cards", "check", "--root", str(repo)]) == 0
    err = capsys.readouterr().err
    assert "cpkit cards check: collecting the covering tests of 1 test file with pytest ..." in err
