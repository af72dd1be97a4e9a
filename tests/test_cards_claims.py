"""Measured claims as data (cpkit.cards.claims): what counts as a measured number in a card, a
skill or the README, when a claim backs it, the claim schema and its checks (evidence folder,
code it is about, unique ids, generated blocks), its freshness in `cpkit cards status` with and
without git history, and the repository's own cards, skills and README passing the check."""

from __future__ import annotations

import datetime as dt
import shutil
import textwrap
from pathlib import Path

import pytest

from cpkit.cards import CardError, load_card, load_cards, status_report
from cpkit.cards.check import check_cards, claim_problems
from cpkit.cards.claims import measured_numbers, render_claims, unbacked_numbers
from cpkit.cards.record import keep_snapshots
from cpkit.cards.render import render_files
from cpkit.cards.snapshot import find_snapshot
from cpkit.cli import main

from tests.test_cards_results import CARD, FIXTURES, ROOT, commit_all, git, needs_git

EVIDENCE = "evidence/2026-11-27-4xH200-abc1234"
CLAIM = f"""claims:
  - id: demo-speed
    value: "widgets build 1.07x faster than before (39.5 s against 42.3 s); 5 passed"
    command: python -m demo.bench
    evidence: {EVIDENCE}
    commit: abc1234
    machine: 4x H200
    date: '2026-11-27'
    about: [src/demo/core.py, tests/fixture_suite.py::test_fast]
"""


def texts(text: str) -> list[str]:
    return [m.text for m in measured_numbers(text)]


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("text, expected", [
    ("cpkit is 1.07x TE's speed", ["1.07x"]),
    ("it ran 2x faster", ["2x faster"]),
    ("8.3-20.9% of the tests", ["8.3-20.9%"]),
    ("took 39.5 s, then 100 ms", ["39.5 s", "100 ms"]),
    ("a median of 4 minutes", ["4 minutes"]),
    ("469.5/508.3/518.7 TFLOP/s per GPU", ["469.5/508.3/518.7 TFLOP/s"]),
    ("about 107 GB/s", ["107 GB/s"]),
    ("5 passed, 2 skipped", ["5 passed", "2 skipped"]),
    ("27 of 28 mutants killed", ["27 of 28"]),
    ("a ratio of 0.968", ["0.968"]),
    ("token fill 0.86-0.87", ["0.86-0.87"]),
    ("-0.4% to +4.2% against the previous ring", ["0.4%", "4.2%"]),
])
def test_a_measured_number_is_flagged(text, expected):
    assert texts(text) == expected


@pytest.mark.parametrize("text", [
    "cp=4 at 32K with 8 KV heads, hidden 4096, on 2 GPUs; a skill body of 500 lines",
    "on 4x H200 with torch 2.11, MCore 0.19.2 and cuDNN 9.19",
    "MCore 0.16 and the 0.19 line",
    "fp32 within 1e-5, bf16 within 5e-3; attention dropout 0.1",
    "local-only attention is > 20% off; the target is at least 1.8x; within 10%",
    "a timeout 600 s, or 600 s by default",
    "`1.07x` and `5 passed` in code",
    "evidence/2026-11-27-4xH200-5b27ec5/README.md at commit 452e484 and 0405c0d",
    "tests/test_x.py::test_y[nccl4-a2a+p2p-[2,2]] on 2026-11-27",
    "a 3 x 4 grid of 16 ranks",
])
def test_configuration_values_are_not_flagged(text):
    assert texts(text) == []


def test_fenced_blocks_and_comments_are_not_prose(tmp_path):
    (tmp_path / "README.md").write_text("```text\n5 passed in 39.5 s\n```\n<!-- 1.07x -->\nprose\n")
    assert unbacked_numbers(tmp_path, []) == []


# ----------------------------------------------------------------------------- backing


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    root = Path(shutil.copytree(FIXTURES / "repo", tmp_path / "repo"))
    card = root / CARD
    card.write_text(card.read_text() + CLAIM)
    (root / EVIDENCE).mkdir(parents=True)
    (root / EVIDENCE / "README.md").write_text("the run\n")
    return root


def problems_of(root: Path) -> list[str]:
    cards, problems = load_cards(root)
    assert problems == []
    return claim_problems(root, cards)


def test_a_number_is_backed_only_beside_a_claim_that_holds_it(repo):
    (repo / "README.md").write_text(textwrap.dedent("""\
        # demo

        Widgets build 1.07x faster (claim `demo-speed`).

        - It took 39.5 s against 42.3 s (claim `demo-speed`), 5 passed.

        Widgets build 1.07x faster than last year.

        | case | result |
        |---|---|
        | build | 1.25x (claim `demo-speed`) |
        """))
    found = problems_of(repo)
    assert len(found) == 2, found
    assert found[0].startswith("README.md:7: measured number '1.07x faster' that no claim backs: "
                               "'Widgets build 1.07x faster than last year.'; fix: ")
    assert found[1].startswith("README.md:11: measured number '1.25x'")


def test_a_card_string_and_a_last_result_detail(repo):
    card = repo / CARD
    text = card.read_text()
    text = text.replace("known_limitations: []", "known_limitations:\n  - \"slow: 3.5% of the time (claim `demo-speed`)\"\n"
                        "  - \"builds 1.07x faster (claim `demo-speed`)\"")
    text = text.replace("    covered_by: [tests/fixture_suite.py::test_on_two_gpus]\n",
                        "    covered_by: [tests/fixture_suite.py::test_on_two_gpus]\n    last_result:\n"
                        "      outcome: passed\n      date: '2026-11-27'\n      machine: 4x H200\n      commit: abc1234\n"
                        "      detail: 2 passed in 12.5 s\n")
    card.write_text(text)
    found = problems_of(repo)
    # The counts of a recorded result are the result itself; its other numbers need its evidence.
    assert [p.split(": fix:")[0].split("that no claim backs")[0] for p in found] == [
        f"{CARD}:11: measured number '3.5%' ", f"{CARD}:43: measured number '12.5 s' "], found
    # A result that names its evidence folder is the record of that run.
    card.write_text(text.replace("      detail: 2 passed in 12.5 s\n",
                                 f"      detail: 2 passed in 12.5 s\n      evidence: {EVIDENCE}\n"))
    assert [p for p in problems_of(repo) if "3.5%" not in p] == []


def test_a_generated_block_backs_its_numbers_and_must_match_the_card(repo):
    skill = repo / "skills" / "demo-feature" / "SKILL.md"
    cards, _ = load_cards(repo)
    block = render_claims(cards[0])
    assert "`demo-speed`: widgets build 1.07x faster" in block and EVIDENCE in block
    skill.write_text(skill.read_text() + "\n## Measured\n\n" + block + "\n")
    assert problems_of(repo) == []
    skill.write_text(skill.read_text().replace("1.07x faster", "1.09x faster"))
    found = problems_of(repo)
    assert len(found) == 1 and "generated claims of cards/demo-feature/card.yaml differ from the card" in found[0]
    assert "python -m cpkit.cards.render" in found[0]
    assert render_files(repo) == ["skills/demo-feature/SKILL.md"]
    assert problems_of(repo) == [] and render_files(repo) == []


def test_a_missing_evidence_folder_and_code_that_is_not_there_fail(repo):
    shutil.rmtree(repo / EVIDENCE)
    card = repo / CARD
    card.write_text(card.read_text().replace("tests/fixture_suite.py::test_fast]", "src/demo/gone.py]"))
    found = problems_of(repo)
    assert f"{CARD}: claims[0] (demo-speed).evidence: '{EVIDENCE}' does not exist" in found[0]
    assert found[1] == f"{CARD}: claims[0] (demo-speed).about[1]: 'src/demo/gone.py' does not exist"
    assert len(found) == 2
    assert check_cards(repo, collect=None, today=dt.date(2026, 11, 28))[:2] == found


def test_claim_ids_are_unique_over_all_cards(repo):
    other = repo / "cards" / "other-feature"
    other.mkdir()
    (other / "card.yaml").write_text((repo / CARD).read_text())
    shutil.copytree(repo / "skills" / "demo-feature", repo / "skills" / "other-feature")
    found = [p for p in problems_of(repo) if "unique" in p]
    assert found == ["cards/other-feature/card.yaml: claims[0] (demo-speed): id 'demo-speed' is also a claim of "
                     f"{CARD}; claim ids are unique over all cards, as skills name them"]


def test_the_schema_holds_a_claim_to_its_keys(repo):
    card = repo / CARD
    text = card.read_text()
    bad = (text.replace("    commit: abc1234\n", "    commit: HEAD\n")
           .replace(f"    evidence: {EVIDENCE}\n", "    evidence: bench-results/x.json\n")
           .replace("    machine: 4x H200\n", "")
           .replace("- id: demo-speed", "- id: Demo Speed"))
    card.write_text(bad)
    with pytest.raises(CardError) as err:
        load_card(card, repo, today=dt.date(2026, 11, 28))
    assert sorted(p.split(": ", 1)[1] for p in err.value.problems) == sorted([
        "claims[0].machine: missing required key",
        "claims[0].id: 'Demo Speed' is not a kebab-case id (e.g. attention-cp4-vs-te)",
        "claims[0].commit: 'HEAD' is not a git commit (7 to 40 hex digits)",
        "claims[0].evidence: 'bench-results/x.json' is not under evidence/ (an evidence/<date>-<machine>-<commit> "
        "folder, or a file in one)",
    ])
    card.write_text(text.replace("    date: '2026-11-27'\n", "    date: '2026-12-30'\n"))
    with pytest.raises(CardError, match=r"claims\[0\].date: '2026-12-30' is in the future"):
        load_card(card, repo, today=dt.date(2026, 11, 28))


# ----------------------------------------------------------------------------- freshness


@needs_git
def test_cards_status_shows_a_claim_fresh_then_stale_with_or_without_git(repo, capsys):
    (repo / ".gitignore").write_text(".venv/\n")
    git(repo, "init", "-q")
    first = commit_all(repo)
    card = repo / CARD
    # Quoted, as `cpkit cards record` writes it: a short hash of digits only is an int in YAML.
    card.write_text(card.read_text().replace("commit: abc1234", f"commit: '{first[:7]}'")
                    .replace("2026-11-27-4xH200-abc1234", f"2026-11-27-4xH200-{first[:7]}"))
    (repo / EVIDENCE).rename(repo / f"evidence/2026-11-27-4xH200-{first[:7]}")
    assert keep_snapshots(repo) == [] and find_snapshot(repo, first[:7]) is not None
    claim = status_report(repo)["claims"][0]
    assert (claim["id"], claim["freshness"]["state"], claim["evidence_exists"]) == ("demo-speed", "fresh", True)
    assert main(["cards", "status", "--root", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "measured claim demo-speed: fresh" in out and f"measured at {first[:7]}, 2026-11-27, on 4x H200" in out
    shutil.rmtree(repo / ".git")
    (repo / "NOTES.md").write_text("docs\n")
    assert status_report(repo)["claims"][0]["freshness"]["state"] == "fresh"
    core = repo / "src" / "demo" / "core.py"
    core.write_text(core.read_text() + "\n# edited in the copy\n")
    fresh = status_report(repo)["claims"][0]["freshness"]
    assert fresh["state"] == "stale" and fresh["changed"] == ["src/demo/core.py"]
    assert fresh["why"] == f"1 file under its code changed since {first[:7]}"
    assert main(["cards", "status", "--root", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "measured claim demo-speed: STALE" in out and "stale: 1 file under its code changed since" in out


def test_a_claim_whose_commit_nothing_knows_is_of_unknown_staleness(repo):
    claim = status_report(repo)["claims"][0]
    assert claim["freshness"]["state"] == "unknown"


# ----------------------------------------------------------------------------- this repository


def test_the_repositorys_cards_skills_and_readme_quote_no_unbacked_number():
    cards, problems = load_cards(ROOT)
    assert problems == []
    found = claim_problems(ROOT, cards)
    assert found == [], "\n".join(found)


def test_every_card_quotes_its_measurements_as_claims():
    cards, _ = load_cards(ROOT)
    assert all(card.claims for card in cards), [c.feature for c in cards if not c.claims]


def test_the_step_models_validated_error_is_the_real_step_claims():
    from cpkit.dynamic.candidates import validated_band

    error, where = validated_band()
    cards, _ = load_cards(ROOT, "dynamic-context-parallel")
    claim = next(c for c in cards[0].claims if c.id == "dynamic-real-step")
    assert f"{error:.1%}" in claim.value and claim.evidence in where


def test_the_render_command_rewrites_a_stale_block(repo):
    import subprocess
    import sys

    skill = repo / "skills" / "demo-feature" / "SKILL.md"
    cards, _ = load_cards(repo)
    skill.write_text(skill.read_text() + "\n" + render_claims(cards[0]).replace("1.07x", "9.99x") + "\n")
    proc = subprocess.run([sys.executable, "-m", "cpkit.cards.render", str(repo)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "rewrote the generated claims in skills/demo-feature/SKILL.md\n"
    assert "9.99x" not in skill.read_text() and problems_of(repo) == []


def test_a_commit_of_digits_only_must_be_quoted_and_the_error_says_so(repo):
    card = repo / CARD
    card.write_text(card.read_text().replace("    commit: abc1234\n", "    commit: 2729491\n"))
    with pytest.raises(CardError, match=r"claims\[0\]\.commit: expected a non-empty string, got the number "
                                        r"2729491: quote it \('2729491'\)"):
        load_card(card, repo, today=dt.date(2026, 11, 28))
