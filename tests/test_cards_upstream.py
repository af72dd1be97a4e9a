"""cpkit.cards.upstream and `cpkit cards status --upstream`, on the miniature repository of
tests/fixtures/cards/repo with an upstream.yaml, and a stand-in upstream checkout whose card is in
Megatron-Bridge's format (follow_up_validation: a list of sentences)."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from cpkit.cards import check_cards, upstream_status
from cpkit.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "cards"
ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_CARD = "skills/demo/card.yaml"
MAP = textwrap.dedent("""
    project: Demo-Upstream
    card: skills/demo/card.yaml
    follow_ups:
      - text: Add a test that builds a widget.
        answered_by: [builds]
      - text: >-
          Run every
          parameter.
        answered_by: [all-params, two-gpus]
""")


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    root = Path(shutil.copytree(FIXTURES / "repo", tmp_path / "repo"))
    (root / "cards" / "demo-feature" / "upstream.yaml").write_text(MAP)
    return root


@pytest.fixture
def upstream(tmp_path):
    checkout = tmp_path / "upstream"
    (checkout / "skills" / "demo").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    (checkout / UPSTREAM_CARD).write_text(textwrap.dedent("""
        title: demo
        follow_up_validation:
          - Add a test that builds a widget.
          - Run every parameter.
    """))
    return checkout


def test_each_upstream_item_shows_the_follow_ups_and_tests_that_answer_it(repo, upstream):
    report = upstream_status(repo, upstream)
    (card,) = report["cards"]
    assert (card["project"], card["feature"]) == ("Demo-Upstream", "demo-feature")
    assert [i["answered_by"] for i in card["items"]] == [["builds"], ["all-params", "two-gpus"]]
    assert card["items"][0]["follow_ups"][0]["covered_by"][0] == "tests/fixture_suite.py::test_fast"
    # "covered" is the card's claim, shown apart; the result is what the tests showed: nothing yet.
    assert card["items"][0]["result"] == "not run (claim: covered)"


def test_the_card_file_itself_may_be_given(repo, upstream):
    assert upstream_status(repo, upstream / UPSTREAM_CARD)["cards"][0]["feature"] == "demo-feature"


def test_a_card_path_is_taken_without_a_checkout_marker_or_copied_elsewhere(repo, upstream, tmp_path, capsys):
    """Bridge's card in a tree with no .git or pyproject.toml (a copied skills/ folder), and the
    card copied under another name: the first by its path, the second by its items."""
    (upstream / "pyproject.toml").unlink()
    card = upstream / UPSTREAM_CARD
    (report_card,) = upstream_status(repo, card)["cards"]
    assert report_card["checkout"] == str(upstream.resolve())
    elsewhere = tmp_path / "loose" / "their-card.yaml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(card.read_text())
    assert main(["cards", "status", "--root", str(repo), "--upstream", str(elsewhere)]) == 0
    assert "1. Add a test that builds a widget." in capsys.readouterr().out
    other = tmp_path / "loose" / "other.yaml"
    other.write_text("follow_up_validation:\n  - Something else entirely.\n")
    assert main(["cards", "status", "--root", str(repo), "--upstream", str(other)]) == 1


def test_run_gives_each_item_the_worst_result_and_a_later_status_shows_it(repo, upstream, capsys):
    out = repo / "upstream-status.json"
    assert main(["cards", "status", "--root", str(repo), "--upstream", str(upstream), "--run",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    items = report["cards"][0]["items"]
    assert items[0]["result"] == "passed (claim: covered)"
    assert items[1]["result"] == "passed, not run (needs gpu2) (claim: covered)"  # this machine has no GPUs
    capsys.readouterr()
    assert main(["cards", "status", "--root", str(repo), "--upstream", str(upstream), "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    # The copy is no git checkout: that run's staleness cannot be known, and says so.
    assert "builds (claim: covered, needs unit): passed (last run here), staleness unknown" in shown
    assert f"last run here: passed at {report['generated_at']}" in shown


def test_an_upstream_item_without_an_answer_fails_the_command(repo, upstream, capsys):
    card = upstream / UPSTREAM_CARD
    card.write_text(card.read_text() + "  - Validate something new.\n")
    assert main(["cards", "status", "--root", str(repo), "--upstream", str(upstream)]) == 1
    out = capsys.readouterr().out
    assert "3. Validate something new." in out and "result: not mapped" in out


def test_a_path_with_no_mapped_card_names_what_the_maps_expect(repo, tmp_path, capsys):
    assert main(["cards", "status", "--root", str(repo), "--upstream", str(tmp_path)]) == 1
    assert "skills/demo/card.yaml (Demo-Upstream, cards/demo-feature)" in capsys.readouterr().out


def test_check_reports_an_answer_that_is_not_a_follow_up_of_the_card(repo):
    path = repo / "cards" / "demo-feature" / "upstream.yaml"
    path.write_text(MAP.replace("[builds]", "[builds, no-such-id]"))
    assert check_cards(repo, collect=None) == [
        "cards/demo-feature/upstream.yaml: follow_ups[0].answered_by: 'no-such-id' is not a follow-up id "
        "of cards/demo-feature/card.yaml"]
    path.write_text(MAP + "unknown: 1\n")
    assert check_cards(repo, collect=None) == [
        "cards/demo-feature/upstream.yaml: unknown: unknown key (allowed: project, card, src_env, follow_ups)"]


def test_the_repository_answers_every_item_of_bridges_hcp_card_it_records(tmp_path):
    """The hierarchical card's upstream.yaml maps the four items of Megatron-Bridge's card (as
    of 067f987, copied here as a stand-in: CI has no Bridge checkout) to covered follow-ups."""
    checkout = tmp_path / "bridge"
    card = checkout / "skills" / "nemo-mbridge-perf-hierarchical-context-parallel" / "card.yaml"
    card.parent.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    card.write_text(textwrap.dedent("""
        follow_up_validation:
          - Add a positive Bridge functional test that completes at least one HCP training step.
          - Add Bridge-side validation that rejects HCP-looking config on use_decentralized_pg=true.
          - Add a checked-in Bridge recipe or example for a2a+p2p.
          - Validate model-family-specific HCP correctness beyond group initialization.
    """))
    (hcp,) = upstream_status(ROOT, checkout)["cards"]
    assert hcp["feature"] == "hierarchical-context-parallel"
    # Bridge's card path itself, as the help says, also in a copied tree with no checkout marker.
    (checkout / "pyproject.toml").unlink()
    (by_path,) = upstream_status(ROOT, card)["cards"]
    assert by_path["checkout"] == str(checkout.resolve()) and by_path["items"] == hcp["items"]
    assert [i["result"] != "not mapped" for i in hcp["items"]] == [True] * 4
    # Claims, apart from results; a GPU result, where recorded, is never shown as "covered".
    assert [i["result"].split(" (claim: ")[1] for i in hcp["items"]] == ["covered, open)", "covered)", "covered)",
                                                                         "covered)"]
    assert all("covered" not in i["result"].split(" (claim: ")[0] for i in hcp["items"])
    # The GPU follow-up's verdict is its recorded run (fresh or stale), never a claim.
    gpu4 = next(f for f in hcp["items"][0]["follow_ups"] if f["id"] == "bridge-hcp-gpu4")
    recorded = next(f for f in yaml.safe_load((ROOT / "cards" / hcp["feature"] / "card.yaml").read_text())
                    ["follow_up_validation"] if f["id"] == "bridge-hcp-gpu4").get("last_result")
    if recorded is None:
        assert gpu4["verdict"] == "not run" and gpu4["last_result"] is None
    else:
        assert gpu4["verdict"].split(",")[0] == recorded["outcome"] and gpu4["last_result"] == recorded
