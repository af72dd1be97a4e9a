"""`cpkit skills check`: frontmatter, anchors, commands and evals of every skill."""

from __future__ import annotations

from pathlib import Path

from cpkit.commands import print_problems, repo_root
from cpkit.skills import check_skills

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register `cpkit skills` and its subcommands."""
    p = sub.add_parser("skills", allow_abbrev=False, help="check the skill guides under skills/")
    skills_sub = p.add_subparsers(dest="skills_command", required=True)
    check = skills_sub.add_parser("check", allow_abbrev=False, help="frontmatter, anchors, commands and evals.json of every skill")
    check.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    check.set_defaults(func=run_check)


def run_check(args) -> int:
    """Print every skill problem; 0 when there are none, else 1."""
    problems = check_skills(repo_root(args.root), args.cli_parser)
    return print_problems("skills check", problems)
