"""One module per `cpkit` subcommand; see cpkit.cli."""

from __future__ import annotations

import sys
from pathlib import Path

from cpkit.validation.repo import NotARepositoryError, find_repo_root, is_repo_root

__all__ = ["print_problems", "repo_root"]


def repo_root(given: Path | None) -> Path:
    """The repository a command works on: `--root` when given (it must be one), else the one
    around the current directory. Raises NotARepositoryError naming what is missing."""
    if given is None:
        return find_repo_root()
    if not is_repo_root(given):
        raise NotARepositoryError(f"--root {given} is not a cpkit repository (it needs pyproject.toml "
                                  "next to cards/ or skills/)")
    return Path(given).resolve()


def print_problems(what: str, problems: list[str]) -> int:
    """Print each problem on stdout and `<what>: N problem(s)` on stderr; 0 when there are none, else 1."""
    for problem in problems:
        print(problem)
    print(f"{what}: {len(problems)} problem{'s' * (len(problems) != 1)}", file=sys.stderr)
    return 1 if problems else 0
