"""`cpkit schedule`: plan one global batch with dynamic CP, check it, and print it.

`--impl cpkit` (default) runs cpkit.dynamic.schedule; `--impl mcore` runs MCore's
BalancedCPScheduler through cpkit.dynamic.mcore; `--impl mlm` runs Megatron-LM's
DefaultDynamicCPScheduler from the checkout named by CPKIT_MLM_SRC (cpkit.dynamic.mlm; a call
that does not return within 5 s is reported as the violation `no-crash`). The plan is checked
against the invariants of cpkit.dynamic.invariants (and run twice for determinism) and timed by
the step-time model (cpkit.dynamic.cost) next to static CP and, with `--vs-mcore`, MCore's
plan (Megatron-LM's beside cpkit's and static CP's with --impl mlm). Planning imports no torch:
MCore's scheduler does (it is torch code), so it runs only for `--impl mcore` or `--vs-mcore`.
The model flags (`--hidden-size` ... `--swiglu`) describe the model the step time is modeled for,
field by field as cpkit.dynamic.cost.ModelDims (`model_dims_from_args`).

Text: a rank x micro-batch grid (cell "s3/cp4": rank runs sample 3 in a CP group of 4;
"s1,s5/cp2": samples 1 and 5 packed together; "-": idle; a cell with many samples wraps onto
more lines, none is left out), every sample with the CP size it needs
and the one it got, the modeled step times (each ratio worded: "cpkit 1.06x faster", "0.95x:
MCore faster", with the model's validated error band, cpkit.dynamic.candidates.error_band_text;
a header "static CP plan" when cpkit chose static CP), the model and where its calibration was
measured (host, torch, MCore), and the violations. A calibration with a "step" section
(`python -m cpkit.bench dynamic_step` writes one) times plans with the real-step model
(cpkit.dynamic.step_model.StepModel). `--json` prints
{"impl", "microbatches", "stats", "violations": [{"property", "detail"}]}.
Exit 0 for a valid plan, 1 when the implementation broke an invariant (a crash inside it is the
violation `no-crash`), 2 with one "error: ..." line per problem on stderr for invalid input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from cpkit.dynamic.cost import (COMM_TYPES, CostModel, ModelDims, load_calibration,
                                replay_check_line)
from cpkit.dynamic.invariants import PlanViolation, plan_violations
from cpkit.dynamic.plan import Plan
from cpkit.dynamic.scheduler import DEFAULT_BALANCE_TOLERANCE, needed_cp_sizes, schedule
from cpkit.dynamic.static import static_cp_plan
from cpkit.errors import CPConfigError

__all__ = ["add_parser", "run", "format_plan", "parse_seq_lens", "plan_report"]

_IDS_PER_LINE = 4  # sample ids per line of a grid cell; more wrap onto the next line
IMPLS = ("cpkit", "mcore", "mlm")
_MLM_TIMEOUT_S = 5.0  # a call takes milliseconds; with the worker's start, well under 30 s


def add_parser(sub) -> None:
    """Register `cpkit schedule`."""
    p = sub.add_parser("schedule", allow_abbrev=False, help="plan a global batch with dynamic CP; print the grid",
                       description=__doc__.splitlines()[0])
    p.add_argument("--dp-cp", type=int, required=True, help="size of the DPxCP group (ranks)")
    p.add_argument("--max-seq-len-per-rank", type=int, required=True,
                   help="most tokens one rank may hold in a micro-batch")
    p.add_argument("--impl", choices=IMPLS, default="cpkit",
                   help="scheduler: cpkit's (default), MCore's BalancedCPScheduler or "
                        "Megatron-LM's DefaultDynamicCPScheduler (needs CPKIT_MLM_SRC)")
    p.add_argument("--min-cp", type=int, default=1, help="smallest CP group size (power of two)")
    p.add_argument("--microbatch-group-size", type=int, default=None,
                   help="make the number of micro-batches a multiple of this: Megatron-LM's "
                        "microbatch_group_size_per_vp_stage, which defaults to the pipeline-parallel "
                        "size; with virtual pipeline stages (VPP) pass that value (pp unless set), "
                        "without VPP omit it")
    p.add_argument("--balance-tolerance", type=float, default=DEFAULT_BALANCE_TOLERANCE,
                   help=argparse.SUPPRESS)  # knob of the compute-only candidate, kept for old scripts
    model = p.add_argument_group("step-time model (cpkit.dynamic.cost)")
    model.add_argument("--hidden-size", type=int, default=4096, help="model width (default 4096)")
    model.add_argument("--num-heads", type=int, default=32, help="query heads (default 32)")
    model.add_argument("--num-kv-heads", type=int, default=8, help="KV heads / query groups (default 8)")
    model.add_argument("--head-dim", type=int, default=128, help="per-head dimension (default 128)")
    model.add_argument("--num-layers", type=int, default=32, help="transformer layers (default 32)")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 x hidden)")
    model.add_argument("--swiglu", action="store_true",
                       help="gated MLP (SwiGLU: two input projections of --ffn-hidden-size), as MCore's "
                            "gated_linear_unit; the H100 replay calibration's model uses it")
    model.add_argument("--bytes-per-element", type=int, default=2, help="activation bytes (default 2: bf16)")
    model.add_argument("--cp-comm-type", choices=COMM_TYPES, default="p2p")
    model.add_argument("--calibration", default=None,
                       help="calibration JSON (python -m cpkit.bench calibrate); default "
                            "$CPKIT_CALIBRATION, else the shipped H200 file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--seq-lens", help="comma-separated sample lengths, e.g. 4000,100,200")
    src.add_argument("--seq-lens-file",
                     help="file of sample lengths: a JSON list, or integers separated by commas, "
                          "spaces or newlines")
    p.add_argument("--vs-mcore", action="store_true",
                   help="also plan with MCore's BalancedCPScheduler and compare (imports megatron-core "
                        "and torch: seconds)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def model_dims_from_args(args: argparse.Namespace) -> ModelDims:
    """The ModelDims the model flags describe (raises CPConfigError for a bad size)."""
    return ModelDims(hidden_size=args.hidden_size, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                     head_dim=args.head_dim, num_layers=args.num_layers, ffn_hidden_size=args.ffn_hidden_size,
                     bytes_per_element=args.bytes_per_element, gated_linear_unit=args.swiglu)


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


def _cell(samples: tuple[int, ...], cp_size: int) -> list[str]:
    """A grid cell's lines: every sample id, _IDS_PER_LINE per line, "/cpN" after the last."""
    ids = [f"s{s}" for s in samples] or [""]
    lines = [",".join(ids[i:i + _IDS_PER_LINE]) for i in range(0, len(ids), _IDS_PER_LINE)]
    return [line + "," for line in lines[:-1]] + [f"{lines[-1]}/cp{cp_size}"]


def _grid_lines(rows: list[list[list[str]]], widths: list[int]) -> list[str]:
    """Rows of multi-line cells, each row as many lines as its tallest cell."""
    out = []
    for row in rows:
        for k in range(max(len(cell) for cell in row)):
            out.append("  ".join((cell[k] if k < len(cell) else "").ljust(w)
                                 for cell, w in zip(row, widths)).rstrip())
    return out


def _seconds(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


_NAMES = {"cpkit": "cpkit", "mcore": "MCore", "mlm": "Megatron-LM"}


def _versus(this: str, other: str, ratio: float | None) -> str:
    """How this plan compares with `other`, given ratio = other's modeled time / this one's, so
    that it reads right either way: "cpkit 1.06x faster", "0.95x: MCore faster"."""
    if not ratio:
        return ""
    from cpkit.dynamic.candidates import error_band_text

    band = error_band_text()
    if f"{ratio:.2f}" == "1.00":
        return f" (1.00x: the same modeled time as {this}; {band})"
    return f" ({this} {ratio:.2f}x faster; {band})" if ratio > 1 else f" ({ratio:.2f}x: {other} faster; {band})"


def _step_time_line(stats: dict, impl: str) -> str:
    """The modeled step times of this plan, static CP and MCore (where it is another plan), each
    ratio worded; says when cpkit chose static CP and which dynamic candidate it chose else."""
    this = _NAMES.get(impl, impl)
    line = f"modeled step time: {this} {_seconds(stats.get('modeled_step_time_s'))}"
    candidate = stats.get("candidate") if impl == "cpkit" else None
    if candidate == "static":
        line += ", static CP chosen (no dynamic candidate was modeled faster)"
    else:
        if candidate:
            line += f" ({candidate} candidate)"
        line += (f"; static CP {_seconds(stats.get('static_step_time_s'))}"
                 + _versus(this, "static CP", stats.get("speedup_vs_static")))
    if impl != "mcore" and stats.get("mcore_compared") is False:
        line += "; MCore not compared (--vs-mcore)"
    elif impl != "mcore":
        line += f"; MCore {_seconds(stats.get('mcore_step_time_s'))}"
        if stats.get("speedup_vs_mcore"):
            line += _versus(this, "MCore", stats["speedup_vs_mcore"])
        elif stats.get("mcore_error"):
            line += f" ({stats['mcore_error']})"
    if "cpkit_step_time_s" in stats:
        line += (f"; cpkit {_seconds(stats['cpkit_step_time_s'])}"
                 + _versus(this, "cpkit", stats.get("speedup_vs_cpkit")))
    return line


def format_plan(plan: Plan, stats: dict, violations: list[PlanViolation], impl: str) -> str:
    """The text report: header (dynamic or static CP, which implementation), grid, per-sample
    CP sizes, modeled step times with each ratio worded, violations."""
    n, mbs = plan.dp_cp_size, plan.microbatches
    kind = "static CP" if stats.get("candidate") == "static" else "dynamic CP"
    lines = [
        f"{kind} plan ({impl}): {len(plan.seq_lens)} samples over dp_cp_size={n}, "
        f"max_seq_len_per_rank={plan.max_seq_len_per_rank}: {len(mbs)} micro-batches",
        "",
    ]
    header = ["rank"] + [f"mb{m}" for m in range(len(mbs))]
    rows = []
    slots = [[None] * n for _ in mbs]
    for m, mb in enumerate(mbs):
        for g in mb.groups:
            for r in g.ranks:
                if 0 <= r < n:
                    slots[m][r] = g
    for r in range(n):
        rows.append([[str(r)]] + [["-"] if slots[m][r] is None else
                                  _cell(slots[m][r].samples, slots[m][r].cp_size)
                                  for m in range(len(mbs))])
    widths = [max(len(header[c]), *(len(line) for row in rows for line in row[c])) for c in range(len(header))]
    lines += _grid_lines([[[h] for h in header], [["-" * w] for w in widths]] + rows, widths)
    placed = {}
    for m, mb in enumerate(mbs):
        for g in mb.groups:
            for s in g.samples:
                placed.setdefault(s, (m, g.cp_size))
    lines += ["", "sample  length  needs cp  got cp  micro-batch"]
    for s, L in enumerate(plan.seq_lens):
        m, got = placed.get(s, ("-", "-"))
        lines.append(f"s{s:<6d} {L:7d}  {plan.needed_cp_sizes[s]:8d}  {got!s:>6}  {m!s:>11}")
    lines += [
        "",
        _step_time_line(stats, impl),
        f"  model: {stats['model']}",
    ] + ([f"  replay: {stats['replay_check']}"] if stats.get("replay_check") else [])
    if violations:
        lines += ["", f"{len(violations)} invariant(s) broken:"]
        lines += [f"  {v.property}: {v.detail}" for v in violations]
    return "\n".join(lines)


def _fail(messages: list[str]) -> int:
    for msg in messages:
        print(f"error: {msg}", file=sys.stderr)
    return 2


def _read_lens(args) -> list[int]:
    if args.seq_lens is not None:
        return parse_seq_lens(args.seq_lens, "--seq-lens")
    try:
        with open(args.seq_lens_file, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"--seq-lens-file {args.seq_lens_file}: {err.strerror}") from None
    return parse_seq_lens(text, f"--seq-lens-file {args.seq_lens_file}")


def _run_impl(impl: str, lens, args, model: CostModel):
    """(plan or None, violations) of one implementation, run twice for determinism."""
    from cpkit.dynamic.mcore import SchedulerCrash, mcore_schedule
    from cpkit.dynamic.mlm import MLMCheckoutError, mlm_schedule

    def once():
        if impl == "mcore":
            return mcore_schedule(lens, dp_cp_size=args.dp_cp,
                                  max_seq_len_per_rank=args.max_seq_len_per_rank)
        if impl == "mlm":
            try:
                return mlm_schedule(lens, args.dp_cp, args.max_seq_len_per_rank,
                                    microbatch_group_size=args.microbatch_group_size,
                                    min_cp_size=args.min_cp, timeout_s=_MLM_TIMEOUT_S)
            except MLMCheckoutError as err:
                raise ValueError(f"--impl mlm: {err}") from None
        return schedule(lens, dp_cp_size=args.dp_cp, max_seq_len_per_rank=args.max_seq_len_per_rank,
                        min_cp_size=args.min_cp, microbatch_group_size=args.microbatch_group_size,
                        balance_tolerance=args.balance_tolerance, cost_model=model)

    try:
        plan = once()
        again = once()
    except SchedulerCrash as err:
        return None, [PlanViolation("no-crash", err.detail)]
    violations = plan_violations(plan, args.microbatch_group_size,
                                 full_group_fallback=impl == "mlm")
    if json.dumps(plan.to_dict()) != json.dumps(again.to_dict()):
        violations.append(PlanViolation("deterministic", "two runs on the same input gave "
                                                         "different plans"))
    return plan, violations


def calibration_origin(calibration) -> str:
    """Where a calibration was measured: device, host, torch and MCore versions (what it has)."""
    src = calibration.source
    machine = src.get("machine") or {}
    parts = [str(src.get("device", "?")).split(";")[0]]
    parts += [f"{k} {machine[m]}" for k, m in (("host", "host"), ("torch", "torch"),
                                               ("megatron-core", "megatron_core")) if machine.get(m)]
    return ", ".join(parts)


def plan_report(impl: str, lens, args, model: CostModel) -> tuple[Plan | None, dict, list]:
    """(plan, stats, violations) of `impl` on `lens`, stats with the modeled step times of the
    plan, static CP and the other implementation (cpkit.dynamic.cost)."""
    needs = needed_cp_sizes(lens, dp_cp_size=args.dp_cp,
                            max_seq_len_per_rank=args.max_seq_len_per_rank,
                            min_cp_size=args.min_cp,
                            microbatch_group_size=args.microbatch_group_size)
    plan, violations = _run_impl(impl, lens, args, model)
    static = static_cp_plan(lens, needs, dp_cp_size=args.dp_cp,
                            max_seq_len_per_rank=args.max_seq_len_per_rank, cost_model=model,
                            min_cp_size=args.min_cp, microbatch_group_size=args.microbatch_group_size)
    static_time = model.step_time(static)
    other = "cpkit" if impl == "mcore" else "mcore"
    compared = impl == "mcore" or getattr(args, "vs_mcore", False)
    other_plan, other_violations = _run_impl(other, lens, args, model) if compared else (None, [])
    stats = dict(plan.stats.to_dict()) if plan is not None else {}
    step = model.step_time(plan) if plan is not None else None
    mcore_plan = plan if impl == "mcore" else other_plan
    mcore_time = model.step_time(mcore_plan) if mcore_plan is not None else None
    d = model.dims
    if impl == "mlm":  # cpkit's plan beside Megatron-LM's
        cpkit_plan, _ = _run_impl("cpkit", lens, args, model)
        cpkit_time = model.step_time(cpkit_plan)
        stats.update({
            "cpkit_step_time_s": cpkit_time,
            "speedup_vs_cpkit": cpkit_time / step if step else None,
            "mlm_step_time_s": step,
            "mlm_error": next((v.detail for v in violations if v.property == "no-crash"), None),
        })
    stats.update({
        "modeled_step_time_s": step,
        "static_step_time_s": static_time,
        "speedup_vs_static": static_time / step if step else None,
        "mcore_step_time_s": mcore_time,
        "speedup_vs_mcore": mcore_time / step if step and mcore_time else None,
        "mcore_error": next((v.detail for v in (violations if impl == "mcore" else other_violations)
                             if v.property == "no-crash"), None),
        "mcore_compared": compared,
        "replay_check": replay_check_line(model.calibration),
        "model": (f"{'real-step' if 'step' in model.calibration.source else 'kernels-only'} model, "
                  f"hidden {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads} x {d.head_dim}, "
                  f"{'SwiGLU ' if d.gated_linear_unit else ''}MLP {d.ffn_hidden_size or 4 * d.hidden_size}, "
                  f"{d.num_layers} layers, {model.comm_type}, calibration "
                  f"{calibration_origin(model.calibration)}"),
    })
    if plan is not None and plan.candidate:
        stats["candidate"] = plan.candidate
    return plan, stats, violations


def run(args) -> int:
    """Handler of `cpkit schedule`; returns the exit code."""
    try:
        lens = _read_lens(args)
        if args.impl == "mcore" and (args.min_cp != 1 or args.microbatch_group_size):
            raise ValueError("--impl mcore: MCore's BalancedCPScheduler has no min_cp_size or "
                             "microbatch_group_size; drop --min-cp and --microbatch-group-size")
        dims = model_dims_from_args(args)
        calibration = load_calibration(args.calibration)
        if "step" in calibration.source:  # the real-step model's host costs (dynamic_step's file)
            from cpkit.dynamic.step_model import StepModel

            model = StepModel(dims, calibration, args.cp_comm_type)
        else:
            model = CostModel(dims, calibration, args.cp_comm_type)
        plan, stats, violations = plan_report(args.impl, lens, args, model)
    except CPConfigError as err:
        return _fail([v.message for v in err.violations])
    except ValueError as err:
        return _fail([str(err)])
    if args.json:
        out = {"impl": args.impl,
               "microbatches": [mb.to_dict() for mb in plan.microbatches] if plan else [],
               "stats": stats,
               "violations": [v.to_dict() for v in violations]}
        print(json.dumps(out, indent=2))
    elif plan is None:
        print(f"{args.impl}: no plan")
        for v in violations:
            print(f"  {v.property}: {v.detail}")
    else:
        print(format_plan(plan, stats, violations, args.impl))
    return 1 if violations else 0
