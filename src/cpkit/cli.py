"""The `cpkit` command. Each subcommand lives in cpkit.commands.<name> and exposes
`add_parser(subparsers)`, which registers it and sets `func(args) -> int` as the handler."""

from __future__ import annotations

import argparse
import importlib
import sys

# Order = order in `cpkit --help`.
COMMAND_MODULES = ["validate", "layout", "plan", "schedule", "cards", "skills"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"cpkit.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
