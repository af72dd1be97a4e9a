"""`cpkit plan eval-cp`: evaluation work at the training and at the eval CP degree, and the speedup.

Exit 0 with the plan (text, or `--json`: {"train": {...}, "eval": {...}, "speedup_estimate",
"warnings": [...], "inputs": {...}}); exit 2 with one `error:` line per violated constraint on
stderr when the sizes are invalid (the CPLayout rules for both layouts, and the planner's own).
The arithmetic and the speedup model are in cpkit.eval_cp.plan.
"""

from __future__ import annotations

import argparse
import json
import sys

from cpkit.errors import CPConfigError
from cpkit.eval_cp.plan import EvalPlan, plan_eval_cp

__all__ = ["add_parser", "eval_cp"]

_COLUMNS = (
    ("layout", None),
    ("cp", "cp"),
    ("dp", "dp"),
    ("micro-batches/rank", "micro_batches_per_rank"),
    ("sample-steps", "sample_steps"),
    ("redundancy", "redundancy"),
    ("activation memory", "activation_memory_ratio"),
    ("est. time (model units)", "time_units"),
)


def add_parser(sub) -> None:
    """Register `cpkit plan` and its `eval-cp` subcommand."""
    p = sub.add_parser("plan", allow_abbrev=False, help="plan CP features before running them (eval-cp)",
                       description="Plan CP features before running them.")
    plan_sub = p.add_subparsers(dest="plan_command", required=True)
    e = plan_sub.add_parser(
        "eval-cp", allow_abbrev=False, help="evaluation work and estimated speedup at another CP degree",
        description=("For the training layout and the eval layout (same world, tp and pp, CP "
                     "changed, dp follows): dp, micro-batches per rank to fill the pipeline, "
                     "sample-steps, redundancy, activation memory and the estimated speedup of "
                     "evaluate(); warns where eval CP is slower (short sequences at PP=1)."))
    e.add_argument("--world-size", type=int, required=True, help="number of ranks")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    e.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    e.add_argument("--cp-train", type=int, default=1, help="CP size of training")
    e.add_argument("--cp-eval", type=int, required=True, help="CP size for evaluation")
    e.add_argument("--eval-samples", type=int, required=True, help="samples in the validation set")
    e.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch")
    e.add_argument("--seq-length", type=int, required=True, help="full sequence length")
    e.add_argument("--num-layers", type=int, default=None, help="transformer layers (checked against pp)")
    e.add_argument("--hidden-size", type=int, default=None,
                   help="hidden size (moves the attention cost crossover; default 4096)")
    e.add_argument("--json", action="store_true", help="print the plan as JSON")
    e.set_defaults(func=eval_cp)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _text(plan: EvalPlan) -> str:
    i = plan.inputs
    lines = [
        f"eval-CP plan: world {i['world_size']}, tp {i['tp']}, pp {i['pp']}, cp {i['cp_train']} -> "
        f"{i['cp_eval']}, {i['eval_samples']} samples, micro-batch {i['micro_batch_size']}, "
        f"seq {i['seq_length']}",
    ]
    rows = [[name for name, _ in _COLUMNS]]
    for label, est in (("train", plan.train), ("eval", plan.eval)):
        values = vars(est)
        row = [label]
        for _, key in _COLUMNS[1:]:
            v = values[key]
            row.append(f"{v:.2f}x" if key in ("redundancy", "activation_memory_ratio") else _cell(v))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(r[c].ljust(widths[c]) if c == 0 else r[c].rjust(widths[c])
                               for c in range(len(r))).rstrip())
    lines.append(f"estimated speedup of evaluate(): {plan.speedup_estimate:.2f}x "
                 "(model and calibration: cpkit.eval_cp.plan)")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def eval_cp(args: argparse.Namespace) -> int:
    """Handler of `cpkit plan eval-cp`: 0 with the plan, 2 for invalid sizes."""
    try:
        plan = plan_eval_cp(
            world_size=args.world_size, tp=args.tp, pp=args.pp, cp_train=args.cp_train,
            cp_eval=args.cp_eval, eval_samples=args.eval_samples,
            micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            num_layers=args.num_layers, hidden_size=args.hidden_size,
        )
    except CPConfigError as exc:
        if args.json:
            print(json.dumps({"valid": False, "errors": [v.to_dict() for v in exc.violations]}, indent=2))
        for v in exc.violations:
            print(f"error: {v.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(_text(plan))
    return 0
