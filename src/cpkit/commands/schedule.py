"""`cpkit schedule`: plan one global batch with dynamic CP and print it.

Prints a rank x micro-batch grid (cell "s3/cp4": rank runs sample 3 in a CP group of 4;
"s1,s5/cp2": samples 1 and 5 packed together; "-": idle) and the balance figures: max/mean load
per micro-batch and the ideal/actual critical path (cpkit.dynamic.plan). `--json` prints
plan.to_dict() instead. Exit 0, or 2 with one "error: ..." line per problem on stderr.
"""

from __future__ import annotations

import json
import re
import sys

from cpkit.dynamic.plan import Plan
from cpkit.dynamic.scheduler import DEFAULT_BALANCE_TOLERANCE, schedule
from cpkit.errors import CPConfigError

__all__ = ["add_parser", "run", "format_plan", "parse_seq_lens"]

_MAX_IDS = 3  # sample ids shown per cell before "+k"


def add_parser(sub) -> None:
    """Register `cpkit schedule`."""
    p = sub.add_parser("schedule", help="plan a global batch with dynamic CP; print the grid",
                       description=__doc__.splitlines()[0])
    p.add_argument("--dp-cp", type=int, required=True, help="size of the DPxCP group (ranks)")
    p.add_argument("--max-seq-len-per-rank", type=int, required=True,
                   help="most tokens one rank may hold in a micro-batch")
    p.add_argument("--min-cp", type=int, default=1, help="smallest CP group size (power of two)")
    p.add_argument("--microbatch-group-size", type=int, default=None,
                   help="make the number of micro-batches a multiple of this (e.g. VPP stages)")
    p.add_argument("--balance-tolerance", type=float, default=DEFAULT_BALANCE_TOLERANCE,
                   help="a group may cost up to (1 + this) x the mean load per rank before it "
                        "is merged (default %(default)s)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--seq-lens", help="comma-separated sample lengths, e.g. 4000,100,200")
    src.add_argument("--seq-lens-file",
                     help="file of sample lengths: a JSON list, or integers separated by commas, "
                          "spaces or newlines")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def parse_seq_lens(text: str, source: str) -> list[int]:
    """Lengths from "100,200 300" or a JSON list; raises ValueError naming the bad item."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: not a JSON list of integers ({err.msg})") from None
        if not isinstance(items, list):
            raise ValueError(f"{source}: expected a JSON list of integers")
    else:
        items = [x for x in re.split(r"[,\s]+", text) if x]
    lens = []
    for k, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ValueError(f"{source}: item {k} ({item!r}) is not an integer")
        try:
            lens.append(int(item))
        except ValueError:
            raise ValueError(f"{source}: item {k} ({item!r}) is not an integer") from None
    if not lens:
        raise ValueError(f"{source}: no sequence lengths given")
    return lens


def _cell(samples: tuple[int, ...], cp_size: int) -> str:
    ids = ",".join(f"s{s}" for s in samples[:_MAX_IDS])
    more = f",+{len(samples) - _MAX_IDS}" if len(samples) > _MAX_IDS else ""
    return f"{ids}{more}/cp{cp_size}"


def format_plan(plan: Plan) -> str:
    """The text report: header, rank x micro-batch grid, balance table, critical path."""
    n, mbs = plan.dp_cp_size, plan.microbatches
    s = plan.stats
    lines = [
        f"dynamic CP plan: {len(plan.seq_lens)} samples over dp_cp_size={n}, "
        f"max_seq_len_per_rank={plan.max_seq_len_per_rank}: {len(mbs)} micro-batches",
        "",
    ]
    header = ["rank"] + [f"mb{m}" for m in range(len(mbs))]
    rows = []
    for r in range(n):
        row = [str(r)]
        for m in range(len(mbs)):
            g = plan.assignment_for_rank(r, m)
            row.append("-" if g is None else _cell(g.samples, g.cp_size))
        rows.append(row)
    widths = [max(len(x[c]) for x in [header] + rows) for c in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + rows:
        lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    lines += ["", "micro-batch  groups  max load    mean load   max/mean  max tokens/rank"]
    for m, mb in enumerate(mbs):
        lines.append(
            f"mb{m:<10d} {len(mb.groups):6d}  {s.max_load[m]:10.4g}  {s.mean_load[m]:10.4g}  "
            f"{s.imbalance[m]:8.3f}  {max(plan.rank_tokens(m)):15d}"
        )
    lines += [
        "",
        f"critical path: ideal {s.ideal_critical_path:.4g} (total work / {n} ranks), "
        f"actual {s.actual_critical_path:.4g} (sum of per-micro-batch max), "
        f"ideal/actual {s.critical_path_efficiency:.3f}",
        f"median max/mean {s.median_imbalance:.3f}; {s.expanded_samples} of {len(plan.seq_lens)} "
        f"samples run on more ranks than they need; idle rank slots {s.idle_rank_slots}",
    ]
    return "\n".join(lines)


def _fail(messages: list[str]) -> int:
    for msg in messages:
        print(f"error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    """Handler of `cpkit schedule`; returns the exit code."""
    try:
        if args.seq_lens is not None:
            lens = parse_seq_lens(args.seq_lens, "--seq-lens")
        else:
            try:
                with open(args.seq_lens_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as err:
                return _fail([f"--seq-lens-file {args.seq_lens_file}: {err.strerror}"])
            lens = parse_seq_lens(text, f"--seq-lens-file {args.seq_lens_file}")
        plan = schedule(
            lens,
            dp_cp_size=args.dp_cp,
            max_seq_len_per_rank=args.max_seq_len_per_rank,
            min_cp_size=args.min_cp,
            microbatch_group_size=args.microbatch_group_size,
            balance_tolerance=args.balance_tolerance,
        )
    except CPConfigError as err:
        return _fail([v.message for v in err.violations])
    except ValueError as err:
        return _fail([str(err)])
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
