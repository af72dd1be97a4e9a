"""`python -m cpkit.bench scheduler`: balance and speed of the dynamic-CP scheduler.

For two length mixes and N = 8, 64, 1024 DPxCP ranks (64, 512 and 4096 sequences per global
batch), schedules several random batches with `cpkit.dynamic.schedule` and reports, next to
static-CP packing of the same batches:

- median and p95 over micro-batches of max/mean load per rank (cpkit.dynamic.plan);
- ideal/actual critical path over all batches (sum of ideal / sum of actual);
- micro-batches per batch and their token fill (tokens held / (N * M), mean over micro-batches);
- the share of samples run on more ranks than they need
  ("expanded": the cost model ignores CP communication, so a static CP size that spans all
  ranks balances perfectly; this column shows what it pays for that);
- CPU time of one `schedule` call (process time, median over batches).

Static CP: every sequence at one CP size, the largest any sequence of the batch needs, packed
first-fit in data order into the N / cp groups, one group's bin per micro-batch slot.

Mixes (lengths capped at min(N, 64) * M tokens: 512K for M = 8192):
- lognormal: median 2048 tokens, sigma 1.0;
- long-tail: 90 % lognormal (median 1536, sigma 0.8), 10 % Pareto (alpha 1.2, scale 8192).

Targets (issue 6): median max/mean <= 1.05, ideal/actual >= 0.95, <= 50 ms for 4096 sequences
over 1024 ranks. Prints a table, writes JSON (bench-results/scheduler.json, or --out) and a PNG
of per-rank load for one batch when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

from cpkit.bench.common import DEFAULT_RESULTS_DIR, format_table, write_json
from cpkit.dynamic import Plan, schedule
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch
from cpkit.dynamic.registry import aligned_blocks
from cpkit.dynamic.scheduler import cp_size_for, largest_group_size
from cpkit.dynamic.workload import default_workload

__all__ = ["main", "static_cp_plan", "sample_lengths", "MIXES"]

NAME = "scheduler"
MIXES = ("lognormal", "long-tail")
SIZES = {8: 64, 64: 512, 1024: 4096}  # dp_cp_size -> sequences per global batch
TARGET_MEDIAN, TARGET_EFFICIENCY, TARGET_MS = 1.05, 0.95, 50.0


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


def static_cp_plan(lens, dp_cp_size: int, max_seq_len_per_rank: int, workload=default_workload) -> Plan:
    """Baseline: all sequences at the largest CP size any needs, packed first-fit in data order
    into bins of max_seq_len_per_rank tokens per rank; micro-batch m runs bins m*R..m*R+R-1 on
    the R aligned groups of that size."""
    M = max_seq_len_per_rank
    cp = max(cp_size_for(L, M, 1, dp_cp_size) for L in lens)
    firsts = [first for _, first in aligned_blocks(dp_cp_size, cp, cp)]
    bins: list[list] = []  # [tokens per rank, sample ids]
    for i, L in enumerate(lens):
        t = -(-L // cp)
        for b in bins:
            if b[0] + t <= M:
                b[0] += t
                b[1].append(i)
                break
        else:
            bins.append([t, [i]])
    slots = len(firsts)
    microbatches = []
    for m in range(0, len(bins), slots):
        groups = tuple(
            CPGroupAssignment(ranks=tuple(range(f, f + cp)), samples=tuple(b[1]), cp_size=cp)
            for f, b in zip(firsts, bins[m:m + slots])
        )
        microbatches.append(Microbatch(groups=groups))
    return Plan(
        microbatches=tuple(microbatches),
        seq_lens=tuple(lens),
        dp_cp_size=dp_cp_size,
        max_seq_len_per_rank=M,
        workloads=tuple(workload(L) for L in lens),
        needed_cp_sizes=tuple(cp_size_for(L, M, 1) for L in lens),
    )


def _p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]


def _summarize(plans: list[Plan]) -> dict:
    imbalance = [x for p in plans for x in p.stats.imbalance]
    ideal = sum(p.stats.ideal_critical_path for p in plans)
    actual = sum(p.stats.actual_critical_path for p in plans)
    samples = sum(len(p.seq_lens) for p in plans)
    return {
        "median_imbalance": statistics.median(imbalance),
        "p95_imbalance": _p95(imbalance),
        "critical_path_efficiency": ideal / actual,
        "microbatches_per_batch": statistics.mean(p.stats.num_microbatches for p in plans),
        "expanded_fraction": sum(p.stats.expanded_samples for p in plans) / samples,
        "max_tokens_per_rank": max(p.stats.max_tokens_per_rank for p in plans),
        "mean_token_fill": statistics.mean(p.stats.mean_token_fill for p in plans),
        "cp_sizes": sorted({g.cp_size for p in plans for mb in p.microbatches for g in mb.groups}),
    }


def _cpu_ms(lens, n, M, repeats: int) -> tuple[Plan, float]:
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        plan = schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M)
        times.append((time.process_time() - t0) * 1e3)
    return plan, statistics.median(times)


def _plot(path: Path, dynamic: Plan, static: Plan, title: str) -> str:
    """Per-rank load of every micro-batch, dynamic vs static; returns a note for the log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True, sharey=True)
    for ax, plan, label in ((axes[0], dynamic, "dynamic CP"), (axes[1], static, "static CP")):
        ranks = range(plan.dp_cp_size)
        for m in range(len(plan.microbatches)):
            ax.step(ranks, plan.rank_loads(m), where="mid", linewidth=0.8)
        s = plan.stats
        ax.set_title(f"{label}: {s.num_microbatches} micro-batches, median max/mean "
                     f"{s.median_imbalance:.3f}, ideal/actual {s.critical_path_efficiency:.3f}",
                     fontsize=9)
        ax.set_ylabel("load per rank")
    axes[1].set_xlabel("DPxCP rank (one line per micro-batch)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def _summary_cells(label: str, prefix: str, summary: dict, *, median_name: str, p95_name: str) -> dict:
    """Table cells of one plan summary (dynamic or static), column names prefixed."""
    return {
        (label, f"{prefix}mbs"): f"{summary['microbatches_per_batch']:.1f}",
        (label, f"{prefix}fill"): f"{100 * summary['mean_token_fill']:.0f}%",
        (label, f"{prefix}{median_name}"): f"{summary['median_imbalance']:.3f}",
        (label, f"{prefix}{p95_name}"): f"{summary['p95_imbalance']:.3f}",
        (label, f"{prefix}ideal/actual"): f"{summary['critical_path_efficiency']:.3f}",
        (label, f"{prefix}expanded"): f"{100 * summary['expanded_fraction']:.0f}%",
    }


def main(argv=None) -> int:
    """Run the benchmark; returns 0 (1 if a target is missed and --strict is given)."""
    parser = argparse.ArgumentParser(prog="python -m cpkit.bench scheduler",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one batch per row")
    parser.add_argument("--batches", type=int, default=None, help="batches per row (default 5, quick 1)")
    parser.add_argument("--max-seq-len-per-rank", type=int, default=8192, help="M (default 8192)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first batch")
    parser.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_RESULTS_DIR}/{NAME}.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    batches = args.batches or (1 if args.quick else 5)
    repeats = 3  # CPU time: median of 3 calls per batch (this machine may be shared)
    M = args.max_seq_len_per_rank

    rows, cells, results, plot_pair = [], {}, [], None
    for mix in MIXES:
        for n, count in SIZES.items():
            cap = min(largest_group_size(n), 64) * M
            dyn, stat, ms = [], [], []
            for b in range(batches):
                lens = sample_lengths(mix, count, cap, random.Random(args.seed + 1000 * b + n))
                plan, t = _cpu_ms(lens, n, M, repeats)
                dyn.append(plan)
                ms.append(t)
                stat.append(static_cp_plan(lens, n, M))
            if plot_pair is None and n == 64:
                plot_pair = (dyn[0], stat[0], f"{mix}, N={n}, {count} sequences, M={M}")
            d, s = _summarize(dyn), _summarize(stat)
            cpu = statistics.median(ms)
            label = f"{mix} N={n} ({count} seqs)"
            rows.append(label)
            cells.update(_summary_cells(label, "", d, median_name="med max/mean", p95_name="p95 max/mean"))
            cells[(label, "cpu ms")] = f"{cpu:.1f}"
            cells[(label, "static cp")] = "/".join(str(c) for c in s["cp_sizes"])
            cells.update(_summary_cells(label, "static ", s, median_name="med", p95_name="p95"))
            results.append({"mix": mix, "dp_cp_size": n, "sequences": count, "batches": batches,
                            "cpu_ms_median": cpu, "cpu_ms": ms, "dynamic": d, "static": s})

    columns = ["mbs", "fill", "med max/mean", "p95 max/mean", "ideal/actual", "expanded", "cpu ms",
               "static cp", "static mbs", "static fill", "static med", "static p95", "static ideal/actual",
               "static expanded"]
    print(f"dynamic-CP scheduler, M={M} tokens per rank, {batches} batch(es) per row")
    print(format_table(rows, columns, cells, corner="mix / DPxCP ranks"))

    checks = {
        f"median max/mean <= {TARGET_MEDIAN}": all(
            r["dynamic"]["median_imbalance"] <= TARGET_MEDIAN for r in results),
        f"ideal/actual >= {TARGET_EFFICIENCY}": all(
            r["dynamic"]["critical_path_efficiency"] >= TARGET_EFFICIENCY for r in results),
        f"<= {TARGET_MS:.0f} ms for 4096 sequences over 1024 ranks": all(
            r["cpu_ms_median"] <= TARGET_MS for r in results if r["dp_cp_size"] == 1024),
    }
    for name, ok in checks.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")

    path = write_json(NAME, {
        "benchmark": NAME, "max_seq_len_per_rank": M, "batches": batches, "quick": args.quick,
        "targets": {k: bool(v) for k, v in checks.items()}, "results": results,
    }, args.out)
    print(f"json: {path}")
    plot_path = Path(args.plot) if args.plot else path.with_suffix(".png")
    print(_plot(plot_path, *plot_pair))
    return 1 if args.strict and not all(checks.values()) else 0
