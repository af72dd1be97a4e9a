"""`cpkit cards check`, `cpkit cards status [--feature F] [--run] [--json] [--out PATH] [--upstream PATH]`
and `cpkit cards record --junit PATH --machine M [--commit SHA]`."""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path

from cpkit.commands import print_problems, repo_root
from cpkit.cards.check import collect_node_ids
from cpkit.cards import (
    FAILING_RESULTS,
    CardError,
    check_cards,
    format_upstream_table,
    upstream_status,
    format_status_table,
    record_evidence,
    record_junit,
    status_report,
    write_report,
)

__all__ = ["add_parser", "DEFAULT_OUT"]

DEFAULT_OUT = "bench-results/cards-status.json"
DEFAULT_UPSTREAM_OUT = "bench-results/cards-upstream-status.json"


def add_parser(sub) -> None:
    """Register `cpkit cards` and its subcommands."""
    p = sub.add_parser("cards", allow_abbrev=False, help="check feature cards and show their follow-up validation status")
    cards_sub = p.add_subparsers(dest="cards_command", required=True)

    check = cards_sub.add_parser("check", allow_abbrev=False, help="schema, evidence anchors and covering pytest node ids")
    check.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    check.set_defaults(func=run_check)

    status = cards_sub.add_parser("status", allow_abbrev=False, help="per card, follow-ups and the tests that cover them")
    status.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    status.add_argument("--feature", help="only this card (its folder name)")
    status.add_argument("--run", action="store_true",
                        help="run the covering tests that fit this machine and write a JSON evidence file")
    status.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    status.add_argument("--out", type=Path, default=None,
                        help=f"evidence file written with --run (default: <root>/{DEFAULT_OUT})")
    status.add_argument("--upstream", type=Path, default=None, metavar="PATH",
                        help="an upstream checkout (or one of its cards, e.g. Megatron-Bridge's): per item of "
                             "its card's follow_up_validation, the cpkit follow-ups and tests that answer it "
                             "(cards/<feature>/upstream.yaml)")
    status.set_defaults(func=run_status)

    record = cards_sub.add_parser(
        "record", allow_abbrev=False,
        help="write a junit file's or an evidence folder's outcomes into the last_result of the follow-ups they cover",
        description="Write the outcomes of pytest junit files (pytest --junitxml PATH, e.g. a GPU run) or of "
                    "committed evidence folders (their junit files and python -m cpkit.cluster log) into "
                    "the last_result of every card follow-up whose covering tests they ran: per covering test "
                    "passed, failed, skipped or not run, with the machine, the commit and the date.")
    source = record.add_mutually_exclusive_group(required=True)
    source.add_argument("--junit", type=Path, action="append", metavar="PATH",
                        help="a junit XML file written by pytest --junitxml (repeat for several)")
    source.add_argument("--evidence", type=Path, action="append", metavar="DIR",
                        help="an evidence folder evidence/<YYYY-MM-DD>-<machine>-<commit> (repeat for several; "
                             "date, machine and commit come from its name; a newer result is kept)")
    record.add_argument("--machine", help='where the tests ran, e.g. "4x H100 (torch 2.11, MCore 0.19.2)" '
                                          "(required with --junit; with --evidence it replaces the folder's short form)")
    record.add_argument("--commit", default=None,
                        help="the commit the tests ran at (default: this checkout's HEAD)")
    record.add_argument("--date", type=_dt.date.fromisoformat, default=None,
                        help="YYYY-MM-DD of the run (default: the junit file's timestamp, else today)")
    record.add_argument("--feature", help="only this card (its folder name)")
    record.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    record.set_defaults(func=run_record)


def run_check(args) -> int:
    """Print every card problem; 0 when there are none, else 1."""
    root = repo_root(args.root)
    notes: list[str] = []

    def collect(root_, files):
        # pytest's collection of every covering file is the slow part (tens of seconds on 2 cores).
        print(f"cpkit cards check: collecting the covering tests of {len(files)} test file{'s' * (len(files) != 1)} with pytest ...",
              file=sys.stderr, flush=True)
        return collect_node_ids(root_, files)

    problems = check_cards(root, collect=collect, notes=notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return print_problems("cards check", problems)


def run_status(args) -> int:
    """Print the status table (or JSON); with --run also write the evidence file.
    0 when all run tests pass, 1 on failures or unloadable cards, 2 for an unknown feature."""
    root = repo_root(args.root)
    if args.upstream is not None:
        return _run_upstream_status(root, args)
    try:
        report = status_report(root, args.feature, args.run)
    except KeyError as exc:
        print(f"cpkit cards status: {exc.args[0]}", file=sys.stderr)
        return 2
    except CardError as exc:
        print("\n".join(exc.problems))
        return 1
    if args.run:
        out = write_report(report, args.out or Path(root) / DEFAULT_OUT)
        print(f"evidence written to {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_status_table(report["rows"], claims=report.get("claims")))
    failed = [r for r in report["rows"] if r["result"] in FAILING_RESULTS]
    return 1 if failed else 0


def _run_upstream_status(root, args) -> int:
    """`cpkit cards status --upstream PATH`: 0 when every upstream item is answered (and, with
    --run, no answering test failed), 1 otherwise; 2 when PATH does not exist."""
    if not Path(args.upstream).exists():
        print(f"cpkit cards status: --upstream {args.upstream}: no such file or folder "
              "(give an upstream checkout, e.g. Megatron-Bridge's, or one of its cards)", file=sys.stderr)
        return 2
    try:
        report = upstream_status(root, args.upstream, args.run,
                                 last_report=args.out or Path(root) / DEFAULT_UPSTREAM_OUT)
    except CardError as exc:
        print("\n".join(exc.problems))
        return 1
    if args.run:
        out = write_report(report, args.out or Path(root) / DEFAULT_UPSTREAM_OUT)
        print(f"evidence written to {out}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_upstream_table(report))
    items = [i for card in report["cards"] for i in card["items"]]
    bad = [i for i in items if i["result"] == "not mapped"
           or any(f["result"] in FAILING_RESULTS for f in i["follow_ups"])]
    return 1 if bad else 0


def run_record(args) -> int:
    """Write the junit outcomes into the cards; print one line per follow-up written.
    0 when at least one follow-up was written, 1 when none of the junit's tests cover one or a
    card does not load, 2 for an unreadable junit file or no commit."""
    root = repo_root(args.root)
    if args.junit and not args.machine:
        print('cpkit cards record: --junit needs --machine, e.g. --machine "4x H100 (torch 2.11, MCore 0.19.2)"',
              file=sys.stderr)
        return 2
    if args.evidence and (args.commit or args.date):
        print("cpkit cards record: --evidence takes commit and date from the folder's name; drop --commit/--date",
              file=sys.stderr)
        return 2
    try:
        if args.junit:
            recorded = record_junit(root, args.junit, args.machine, args.commit, args.date, args.feature)
        else:
            recorded = [r for folder in sorted(args.evidence, key=lambda f: f.name)
                        for r in record_evidence(root, folder, args.machine, args.feature)]
    except ValueError as exc:
        if isinstance(exc, CardError):
            print("\n".join(exc.problems))
            return 1
        print(f"cpkit cards record: {exc}", file=sys.stderr)
        return 2
    for r in recorded:
        tests = dict(r.result.tests)
        counts = ", ".join(f"{sum(v == o for v in tests.values())} {o}" for o in dict.fromkeys(tests.values()))
        print(f"{r.card}: {r.id}: {r.result.outcome} at {r.result.commit} ({counts})")
    if not recorded:
        print(f"cpkit cards record: no follow-up's covering tests are in {', '.join(map(str, args.junit or args.evidence))}"
              " (or every follow-up they cover has a newer result)",
              file=sys.stderr)
        return 1
    print(f"recorded {len(recorded)} follow-up{'s' * (len(recorded) != 1)}; check with: cpkit cards check",
          file=sys.stderr)
    return 0
