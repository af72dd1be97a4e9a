"""Skill guides (`skills/<name>/SKILL.md` + `evals.json`): loading and checks.

`check_skills` verifies, for every skill folder: the frontmatter; that every repository anchor the
body names resolves; that every command the body tells an agent to run exists (a `cpkit`
subcommand and its flags, a pytest path, node id or marker, a `python -m cpkit.bench` benchmark);
and the shape of evals.json. What counts as an anchor and as a command is defined in
skills/README.md. Modules: `load` (SKILL.md and evals.json), `scan` (anchors and commands of a
body), `commands` (does a command exist).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cpkit.skills.commands import check_command
from cpkit.validation.anchors import resolve_anchor
from cpkit.validation.change_map import SKILL_TABLE_BEGIN, SKILL_TABLE_END, skill_table
from cpkit.skills.load import (
    EVAL_KEYS,
    FRONTMATTER_KEYS,
    MAX_BODY_LINES,
    MAX_DESCRIPTION_CHARS,
    Skill,
    SkillError,
    check_evals,
    load_skill,
    rel_path,
    skill_dirs,
)
from cpkit.skills.scan import SHELL_FENCES, body_anchors, body_commands

__all__ = [
    "FRONTMATTER_KEYS", "MAX_DESCRIPTION_CHARS", "MAX_BODY_LINES", "SHELL_FENCES", "EVAL_KEYS",
    "Skill", "SkillError", "load_skill", "skill_dirs", "body_anchors", "body_commands",
    "check_command", "check_evals", "check_skills",
]


def check_skills(root: str | Path, parser: argparse.ArgumentParser) -> list[str]:
    """Check every skill under `root/skills`; returns problems, one line each, empty when all hold.

    Per skill: frontmatter and body length (load_skill), anchors (body_anchors), commands
    (body_commands, check_command against `parser`, the CLI's) and evals.json (check_evals).
    Problems in the body name `SKILL.md:<line>`.
    """
    root = Path(root)
    if not (root / "skills").is_dir():
        return [f"{root / 'skills'}: no skills folder"]
    problems: list[str] = []
    for folder in skill_dirs(root):
        rel = rel_path(folder, root)
        if not (folder / "SKILL.md").is_file():
            problems.append(f"{rel}: missing SKILL.md")
            continue
        try:
            skill = load_skill(folder, root)
        except SkillError as exc:
            problems += exc.problems
            continue
        at = lambda n: f"{skill.path}:{skill.body_start_line + n}"  # noqa: E731
        for n, anchor in body_anchors(skill.body):
            if anchor.startswith("link:"):
                target = anchor[5:]
                resolved = (folder / target).resolve()
                inside = resolved.is_relative_to(root.resolve())
                if not inside or not resolved.exists():
                    problems.append(f"{at(n)}: link target {target!r} does not exist")
                continue
            reason = resolve_anchor(root, anchor)
            if reason:
                problems.append(f"{at(n)}: `{anchor}` {reason}")
        for n, argv in body_commands(skill.body):
            problems += [f"{at(n)}: {p}" for p in check_command(argv, root, parser)]
        for sibling in sorted(p for p in folder.glob("*.md") if p.name != "SKILL.md"):
            problems += _sibling_problems(sibling, root, parser)  # read on demand: held to the same checks
        problems += _generated_table_problems(skill)
        evals = folder / "evals.json"
        if evals.is_file():
            problems += check_evals(evals, skill.name, root)
        else:
            problems.append(f"{rel}: missing evals.json")
    return problems


def _generated_table_problems(skill: Skill) -> list[str]:
    """A body holding the change map's table must hold it exactly as
    src/cpkit/validation/change_map.py::skill_table renders it (so the table and the map cannot drift)."""
    if SKILL_TABLE_BEGIN not in skill.body:
        return []
    start = skill.body.index(SKILL_TABLE_BEGIN)
    end = skill.body.find(SKILL_TABLE_END, start)
    line = skill.body_start_line + skill.body[:start].count("\n")
    if end < 0:
        return [f"{skill.path}:{line}: generated table is not closed by {SKILL_TABLE_END!r}"]
    problems = []
    if skill.body[start:end + len(SKILL_TABLE_END)] != skill_table():
        problems.append(f"{skill.path}:{line}: the table differs from src/cpkit/validation/change_map.py::CHANGE_MAP; "
                        "replace it with the output of `python -m cpkit.validation.change_map`")
    copies = skill.body.count(SKILL_TABLE_END)
    if copies > 1:  # a regeneration that replaced the rows only leaves the old text and marker behind
        problems.append(f"{skill.path}:{line}: {SKILL_TABLE_END!r} appears {copies} times, once allowed: "
                        "delete what follows the first up to the last (leftovers of earlier tables)")
    return problems



def _sibling_problems(path: Path, root: Path, parser: argparse.ArgumentParser) -> list[str]:
    """Anchors and commands of a skill's sibling page (details SKILL.md links to), `file:<line>`."""
    at = lambda n: f"{rel_path(path, root)}:{n + 1}"  # noqa: E731
    text = path.read_text(encoding="utf-8")
    problems = []
    for n, anchor in body_anchors(text):
        if anchor.startswith("link:"):
            if not (path.parent / anchor[5:]).resolve().exists():
                problems.append(f"{at(n)}: link target {anchor[5:]!r} does not exist")
            continue
        reason = resolve_anchor(root, anchor)
        if reason:
            problems.append(f"{at(n)}: `{anchor}` {reason}")
    for n, argv in body_commands(text):
        problems += [f"{at(n)}: {p}" for p in check_command(argv, root, parser)]
    return problems
