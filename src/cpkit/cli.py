"""The `cpkit` command. Each subcommand lives in cpkit.commands.<name> and exposes
`add_parser(subparsers)`, which registers it and sets `func(args) -> int` as the handler."""

from __future__ import annotations

import argparse
import importlib
import sys

from cpkit import __version__
from cpkit.notices import quiet_closed_stdout, quiet_known_notices
from cpkit.validation.repo import NotARepositoryError

# Order = order in `cpkit --help`.
COMMAND_MODULES = ["validate", "layout", "plan", "schedule", "cards", "skills"]

DESCRIPTION = """\
Check and plan context parallelism (CP) for megatron-core: validate a change with the tests that
cover it, check a parallel layout, plan eval-time CP, preview the dynamic-CP schedule of a batch,
and see what each feature's card proves."""

EPILOG = """\
examples:
  cpkit validate --changed          run the tests that cover what changed since main
  cpkit layout check --world-size 8 --tp 2 --cp 4 --seq-length 4096 --num-heads 8
  cpkit cards status                what each feature has proven, test by test
run `cpkit <command> --help` for a command's options."""


def build_parser() -> argparse.ArgumentParser:
    """The full `cpkit` parser; every handler finds it as `args.cli_parser` (the skills check
    validates commands against it)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="cpkit", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for name in COMMAND_MODULES:
        importlib.import_module(f"cpkit.commands.{name}").add_parser(sub)
    parser.set_defaults(cli_parser=parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one `cpkit` command; its exit code (2 when it needs a repository and has none)."""
    quiet_known_notices()  # before a command imports megatron-core
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except NotARepositoryError as exc:
        print(f"cpkit {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`cpkit cards status | head`): not an error
        quiet_closed_stdout()
        return 0
    except KeyboardInterrupt:  # Ctrl-C: say so, no traceback; what was running has no result
        print(f"\ncpkit {args.command}: interrupted (Ctrl-C); the test or check that was running has no "
              "result, it is not counted as a failure", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
