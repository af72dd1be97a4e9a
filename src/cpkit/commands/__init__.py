"""One module per `cpkit` subcommand; see cpkit.cli."""

from __future__ import annotations

import sys

__all__ = ["print_problems"]


def print_problems(what: str, problems: list[str]) -> int:
    """Print each problem on stdout and `<what>: N problem(s)` on stderr; 0 when there are none, else 1."""
    for problem in problems:
        print(problem)
    print(f"{what}: {len(problems)} problem{'s' * (len(problems) != 1)}", file=sys.stderr)
    return 1 if problems else 0
