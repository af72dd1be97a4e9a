"""The repository's own cards/ and skills/ hold: every anchor resolves, every command exists, every
covering node id is collected. A stale anchor or a removed command fails CI here.

One test per skill, so a failure names the skill. The cards are checked in ONE test, because that
check runs a `pytest --collect-only` subprocess over the covering test files (it imports torch and
MCore); a module-scoped fixture would run it once per xdist worker.
"""

import warnings
from pathlib import Path

import pytest

from cpkit.cards import check_cards
from cpkit.cli import build_parser
from cpkit.skills import check_skills, skill_dirs
from cpkit.validation.change_map import SKILL_TABLE_BEGIN

ROOT = Path(__file__).resolve().parents[1]
SKILLS = [d.name for d in skill_dirs(ROOT)]


@pytest.fixture(scope="module")
def skill_problems():
    return check_skills(ROOT, build_parser())


def test_repo_has_the_cross_cutting_skill():
    assert "validating-context-parallel-changes" in SKILLS


def test_validating_skill_shows_the_generated_change_map_table():
    # check_skills compares the table with the map; this makes sure the table is there to compare.
    assert SKILL_TABLE_BEGIN in (ROOT / "skills/validating-context-parallel-changes/SKILL.md").read_text()


@pytest.mark.parametrize("name", SKILLS)
def test_skill_is_valid(name, skill_problems):
    mine = [p for p in skill_problems if p.startswith((f"skills/{name}/", f"skills/{name}:"))]
    assert mine == [], "\n".join(mine)


def test_no_skill_problems_outside_skill_folders(skill_problems):
    stray = [p for p in skill_problems if not p.startswith(tuple(f"skills/{n}" for n in SKILLS))]
    assert stray == [], "\n".join(stray)


def test_cards_are_valid():
    notes: list[str] = []
    problems = check_cards(ROOT, notes=notes)
    for note in notes:  # pytest could not collect a file; it was checked with ast instead
        warnings.warn(f"cards check: {note}", stacklevel=1)
    assert problems == [], "\n".join(problems)
