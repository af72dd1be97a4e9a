"""`python -m cpkit.bench scheduler`: modeled step time of dynamic CP against static CP and MCore.

For two length mixes and DPxCP sizes 8 to 1024 (8 sequences per rank... see SIZES), schedules
random global batches three ways and times every plan with the same step-time model
(cpkit.dynamic.cost: linear layers and attention at their measured efficiency for the chunk
lengths they run, plus the exposed CP communication of the ring):

- cpkit: `cpkit.dynamic.schedule` (the faster of its earliest-finish plan and static CP);
- MCore: megatron-core's BalancedCPScheduler (cpkit.dynamic.mcore), its groups' samples run one
  after another with a barrier after every micro-batch, as MCore's schedule runs them; its
  invariant violations are counted (a plan with violations is still timed);
- Megatron-LM (when CPKIT_MLM_SRC names a checkout): its DefaultDynamicCPScheduler
  (cpkit.dynamic.mlm), groups packed as cpkit's are; same lengths, same model; its violations
  are counted (the whole DPxCP group is its documented fallback, not one);
- static CP: every sample at the CP size the longest needs, DP replicas balanced by modeled time
  (cpkit.dynamic.static.static_cp_plan); it pays its slowest replica.

Columns: median modeled step time (ms) of the three, the ratios static / cpkit and MCore /
cpkit (median over batches; > 1: cpkit faster), how many batches static CP won inside cpkit's
scheduler (then the ratio is 1.00 by construction), MCore violations, and the CPU time of one
`schedule` call (process time, median; the first call of the process fills the model's caches
and is reported separately).

Mixes (lengths capped at min(N, 64) * M tokens: 512K for M = 8192):
- lognormal: median 2048 tokens, sigma 1.0;
- long-tail: 90 % lognormal (median 1536, sigma 0.8), 10 % Pareto (alpha 1.2, scale 8192).

Targets: cpkit >= 1.15x static CP (median over rows) and >= 0.95x on every row; >= 1.05x MCore
(median over rows); <= 50 ms for 4096 sequences over 1024 ranks on one CPU core. Prints a table,
writes JSON (bench-results/scheduler.json, or --out) and a PNG of step time per row for the three
(matplotlib: `pip install matplotlib, or pip install -e '.[plot]' in a checkout`).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

from cpkit.bench.common import DEFAULT_RESULTS_DIR, PLOT_SKIPPED, format_table, pyplot, write_json
from cpkit.dynamic import schedule
from cpkit.dynamic.cost import CostModel, load_calibration
from cpkit.dynamic.invariants import plan_violations
from cpkit.dynamic.mcore import SchedulerCrash, mcore_schedule
from cpkit.dynamic.mlm import checkout_commit, mlm_schedule, mlm_src
from cpkit.dynamic.scheduler import largest_group_size, needed_cp_sizes
from cpkit.dynamic.static import static_cp_plan

__all__ = ["main", "sample_lengths", "MIXES", "SIZES"]

NAME = "scheduler"
MIXES = ("lognormal", "long-tail")
SIZES = {8: 64, 32: 256, 64: 512, 256: 1024, 1024: 4096}  # dp_cp_size -> sequences per batch
TARGET_STATIC_MEDIAN, TARGET_STATIC_MIN, TARGET_MCORE_MEDIAN, TARGET_MS = 1.15, 0.95, 1.05, 50.0


def sample_lengths(mix: str, count: int, cap: int, rng: random.Random) -> list[int]:
    """`count` sequence lengths of one mix, each in [1, cap]."""
    out = []
    for _ in range(count):
        if mix == "lognormal":
            L = rng.lognormvariate(math.log(2048), 1.0)
        elif rng.random() < 0.9:
            L = rng.lognormvariate(math.log(1536), 0.8)
        else:
            L = rng.paretovariate(1.2) * 8192
        out.append(max(1, min(int(L), cap)))
    return out


def _cpu_ms(lens, n, M, model, repeats: int):
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        plan = schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M, cost_model=model)
        times.append((time.process_time() - t0) * 1e3)
    return plan, statistics.median(times)


def _one_batch(lens, n, M, model, repeats) -> dict:
    plan, ms = _cpu_ms(lens, n, M, model, repeats)
    needs = needed_cp_sizes(lens, dp_cp_size=n, max_seq_len_per_rank=M)
    static = static_cp_plan(lens, needs, dp_cp_size=n, max_seq_len_per_rank=M, cost_model=model)
    out = {"cpkit_s": plan.step_time_s, "static_s": model.step_time(static), "cpu_ms": ms,
           "candidate": plan.candidate, "static_cp": static.microbatches[0].groups[0].cp_size,
           "cp_sizes": sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})}
    try:
        mplan = mcore_schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M, timeout_s=120)
        out["mcore_s"] = model.step_time(mplan)
        out["mcore_violations"] = [v.to_dict() for v in plan_violations(mplan)]
    except SchedulerCrash as err:
        out["mcore_s"], out["mcore_violations"] = None, [{"property": "no-crash",
                                                          "detail": err.detail}]
    if mlm_src() is not None:
        try:
            lplan = mlm_schedule(lens, n, M, timeout_s=120)
            out["mlm_s"] = model.step_time(lplan)
            out["mlm_violations"] = [v.to_dict() for v in
                                     plan_violations(lplan, full_group_fallback=True)]
        except SchedulerCrash as err:
            out["mlm_s"], out["mlm_violations"] = None, [{"property": "no-crash",
                                                          "detail": err.detail}]
    return out


def _plot(path: Path, rows: list[dict]) -> str:
    """Grouped bars: median modeled step time per row for cpkit, MCore and static CP."""
    plt = pyplot()
    if plt is None:
        return PLOT_SKIPPED
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.27
    xs = range(len(rows))
    for k, (key, label) in enumerate((("cpkit_ms", "cpkit"), ("mcore_ms", "MCore"),
                                      ("static_ms", "static CP"))):
        ax.bar([x + (k - 1) * width for x in xs], [r[key] or 0.0 for r in rows], width, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['mix']}\nN={r['dp_cp_size']}" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("modeled step time (ms, log)")
    ax.set_title("dynamic CP: modeled step time per mix (median over batches)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def main(argv=None) -> int:
    """Run the benchmark; returns 0 (1 if a target is missed and --strict is given)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench scheduler",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one batch per row, N <= 64")
    parser.add_argument("--batches", type=int, default=None, help="batches per row (default 3, quick 1)")
    parser.add_argument("--max-seq-len-per-rank", type=int, default=8192, help="M (default 8192)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first batch")
    parser.add_argument("--calibration", default=None,
                        help="calibration JSON (default $CPKIT_CALIBRATION, else the shipped one)")
    parser.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_RESULTS_DIR}/{NAME}.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    batches = args.batches or (1 if args.quick else 3)
    M = args.max_seq_len_per_rank
    model = CostModel(calibration=load_calibration(args.calibration))
    sizes = {n: c for n, c in SIZES.items() if not args.quick or n <= 64}

    t0 = time.process_time()
    schedule(sample_lengths("lognormal", 64, 8 * M, random.Random(-1)), dp_cp_size=8,
             max_seq_len_per_rank=M, cost_model=model)
    first_call_ms = (time.process_time() - t0) * 1e3

    rows, cells, results = [], {}, []
    for mix in MIXES:
        for n, count in sizes.items():
            cap = min(largest_group_size(n), 64) * M
            label = f"{mix} N={n} ({count} seqs)"
            per_batch = [_one_batch(sample_lengths(mix, count, cap, random.Random(args.seed + 1000 * b + n)),
                                    n, M, model, repeats=3) for b in range(batches)]
            med = lambda key: statistics.median(x[key] for x in per_batch)  # noqa: E731
            mcore = [x["mcore_s"] for x in per_batch if x["mcore_s"]]
            row = {
                "mix": mix, "dp_cp_size": n, "sequences": count, "batches": batches,
                "cpkit_ms": 1e3 * med("cpkit_s"), "static_ms": 1e3 * med("static_s"),
                "mcore_ms": 1e3 * statistics.median(mcore) if mcore else None,
                "vs_static": statistics.median(x["static_s"] / x["cpkit_s"] for x in per_batch),
                "vs_mcore": statistics.median(x["mcore_s"] / x["cpkit_s"] for x in per_batch
                                              if x["mcore_s"]) if mcore else None,
                "static_won": sum(x["candidate"] == "static" for x in per_batch),
                "mcore_violations": sum(len(x["mcore_violations"]) for x in per_batch),
                "cpu_ms_median": med("cpu_ms"), "per_batch": per_batch,
            }
            if mlm_src() is not None:
                mlm = [x for x in per_batch if x["mlm_s"]]
                row.update({
                    "mlm_ms": 1e3 * statistics.median(x["mlm_s"] for x in mlm) if mlm else None,
                    "vs_mlm": statistics.median(x["mlm_s"] / x["cpkit_s"] for x in mlm)
                    if mlm else None,
                    "mlm_violations": sum(len(x["mlm_violations"]) for x in per_batch),
                })
                cells.update({
                    (label, "MLM ms"): "crash" if row["mlm_ms"] is None else f"{row['mlm_ms']:.0f}",
                    (label, "MLM/cpkit"): "-" if row["vs_mlm"] is None else f"{row['vs_mlm']:.2f}",
                    (label, "MLM violations"): str(row["mlm_violations"]),
                })
            results.append(row)
            rows.append(label)
            cells.update({
                (label, "cpkit ms"): f"{row['cpkit_ms']:.0f}",
                (label, "MCore ms"): "crash" if row["mcore_ms"] is None else f"{row['mcore_ms']:.0f}",
                (label, "static ms"): f"{row['static_ms']:.0f}",
                (label, "static/cpkit"): f"{row['vs_static']:.2f}",
                (label, "MCore/cpkit"): "-" if row["vs_mcore"] is None else f"{row['vs_mcore']:.2f}",
                (label, "static won"): f"{row['static_won']}/{batches}",
                (label, "static cp"): "/".join(sorted({str(x["static_cp"]) for x in per_batch})),
                (label, "cpkit cp sizes"): "/".join(str(c) for c in sorted(
                    {c for x in per_batch for c in x["cp_sizes"]})),
                (label, "MCore violations"): str(row["mcore_violations"]),
                (label, "cpu ms"): f"{row['cpu_ms_median']:.1f}",
            })

    columns = ["cpkit ms", "MCore ms", "static ms", "static/cpkit", "MCore/cpkit", "static won",
               "static cp", "cpkit cp sizes", "MCore violations", "cpu ms"]
    mlm_commit = checkout_commit() if mlm_src() is not None else None
    if mlm_commit is not None:
        columns[2:2] = ["MLM ms"]
        columns[5:5] = ["MLM/cpkit"]
        columns.append("MLM violations")
    print(f"dynamic-CP scheduler, modeled step time ({model.dims.num_layers} layers, hidden "
          f"{model.dims.hidden_size}, {model.comm_type}), M={M} tokens per rank, {batches} "
          f"batch(es) per row; first schedule() call of the process {first_call_ms:.0f} ms")
    if mlm_commit is not None:
        print(f"Megatron-LM (MLM): DefaultDynamicCPScheduler of {mlm_src()} at {mlm_commit}")
    print(format_table(rows, columns, cells, corner="mix / DPxCP ranks"))

    vs_static = [r["vs_static"] for r in results]
    vs_mcore = [r["vs_mcore"] for r in results if r["vs_mcore"] is not None]
    checks = {
        f"cpkit >= {TARGET_STATIC_MEDIAN}x static CP (median over rows: "
        f"{statistics.median(vs_static):.2f})": statistics.median(vs_static) >= TARGET_STATIC_MEDIAN,
        f"cpkit >= {TARGET_STATIC_MIN}x static CP on every row (min {min(vs_static):.2f})":
            min(vs_static) >= TARGET_STATIC_MIN,
        f"cpkit >= {TARGET_MCORE_MEDIAN}x MCore (median over rows: "
        f"{statistics.median(vs_mcore) if vs_mcore else float('nan'):.2f})":
            bool(vs_mcore) and statistics.median(vs_mcore) >= TARGET_MCORE_MEDIAN,
    }
    big = [r["cpu_ms_median"] for r in results if r["dp_cp_size"] == 1024]
    if big:
        checks[f"<= {TARGET_MS:.0f} ms for 4096 sequences over 1024 ranks "
               f"(max {max(big):.1f})"] = max(big) <= TARGET_MS
    for name, ok in checks.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")

    path = write_json(NAME, {
        "benchmark": NAME, "max_seq_len_per_rank": M, "batches": batches, "quick": args.quick,
        "model": {"dims": vars(model.dims), "comm_type": model.comm_type,
                  "calibration": model.calibration.source},
        "first_call_ms": first_call_ms, "mlm_commit": mlm_commit,
        "targets": {k: bool(v) for k, v in checks.items()}, "results": results,
    }, args.out)
    print(f"json: {path}")
    plot_path = Path(args.plot) if args.plot else path.with_suffix(".png")
    print(_plot(plot_path, results))
    return 1 if args.strict and not all(checks.values()) else 0
