"""`python -m cpkit.bench replay`: dynamic-CP plans replayed on one GPU, every rank's work measured.

For each global batch (cpkit.bench.dynamic.replay_plans: the scheduler bench's mixes at 4K-8K tokens per
rank, a long-context set at 16K-32K, or `--seq-lens-file`), the plans of every implementation
(cpkit, static CP with packing, MCore's BalancedCPScheduler, Megatron-LM's with CPKIT_MLM_SRC)
are translated into each rank's work (cpkit.bench.dynamic.replay_work: local tokens and the p2p ring's
THD attention calls, as cpkit's runtime makes them) and each distinct piece of work is run for
real on this device (cpkit.bench.dynamic.replay_kernels: one layer's GEMMs and cpkit's attention kernels,
forward and backward, CUDA events, warm-up, median, cached by shape), times the model's layers.

Replayed step time (cpkit.bench.dynamic.replay_timing, cpkit.dynamic.step_rules):
- a group's pass = measured compute (GEMMs + per ring step the slowest rank's attention call)
  + exposed ring communication modeled from a link table (`--link nvlink`, the 4x H200
  evidence, default; `--link ib`, CP across nodes, assumed; or a JSON of [bytes, seconds]);
- PP = 1 ("free", cpkit's runtime): a group starts when its last member is free; MCore's plans
  run lockstep (its schedule waits after every micro-batch); `--pp P` > 1: every plan lockstep,
  micro-batches end together, (sum_m T_m + (P - 1) max_m T_m) / P.

The cost model (cpkit.dynamic.cost) is calibrated first from the same kernels on this machine
(cpkit.bench.dynamic.replay_calibration; `--calibration FILE` uses a file instead, `--write-calibration
FILE` keeps it), cpkit's scheduler plans with it, and its modeled step time is compared with the
replayed one for every plan.

Output per batch: replayed step time per implementation (compute and communication apart),
static / cpkit and the others / cpkit, token fill, the area bound (the least busy rank-seconds
of any plan / (N x PP): no plan of these can end sooner), the model's error; medians and minimums per
set; targets; JSON (bench-results/replay.json or --out) and a PNG when matplotlib is installed.
`--device cpu --tiny` is a smoke run (tiny model, CPU kernels), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cpkit.bench.common import (DEFAULT_RESULTS_DIR, PLOT_SKIPPED, format_table, machine_info, pyplot,
                               source_commit, write_json)
from cpkit.bench.dynamic.replay_calibration import calibration_from_timer
from cpkit.bench.dynamic.replay_kernels import KernelTimer
from cpkit.bench.dynamic.replay_plans import Batch, batches, plans, read_seq_lens_file
from cpkit.bench.dynamic.replay_timing import LinkTable, Timer, link_table, pass_time
from cpkit.bench.dynamic.replay_work import plan_work
from cpkit.dynamic.cost import Calibration, CostModel, ModelDims, load_calibration
from cpkit.dynamic.step_rules import step_end
from cpkit.errors import CPConfigError, Violation

__all__ = ["REPLAY_DIMS", "TINY_DIMS", "main", "replay_plan", "summarize"]

NAME = "replay"
#: The replayed model: 4096 wide, 32 layers, 32 query / 8 KV heads of 128, SwiGLU MLP of 14336.
REPLAY_DIMS = ModelDims(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        num_layers=32, ffn_hidden_size=14336, gated_linear_unit=True)
TINY_DIMS = ModelDims(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2,
                      ffn_hidden_size=128, gated_linear_unit=True)
TARGETS = {"mix": 1.10, "mixlong": 1.25, "long": 1.25}  # median static / cpkit per set
MODEL_MEDIAN, MODEL_MAX = 0.10, 0.20  # the model's relative error: median, every batch


def replay_plan(plan, timer: Timer, link: LinkTable, dims: ModelDims, rule: str,
                pp_size: int) -> dict:
    """Replayed seconds of one plan: {"step_s", "compute_step_s", "comm_s", "busy_s"}.

    compute_step_s: the step with communication left out; comm_s = step_s - compute_step_s
    (what the exposed ring transfers add); busy_s: rank-seconds of all passes."""
    kv_bytes = 2 * dims.num_kv_heads * dims.head_dim * dims.bytes_per_element
    work = plan_work(plan)
    rule = rule if plan.packed else "lockstep"
    full, compute, busy = [], [], 0.0
    for mb, groups in zip(plan.microbatches, work):
        f_mb, c_mb = [], []
        for g, passes in zip(mb.groups, groups):
            times = [pass_time(p, timer, link, num_layers=dims.num_layers,
                               kv_bytes_per_token=kv_bytes) for p in passes]
            total = sum(t.total_s for t in times)
            f_mb.append((g.ranks, total))
            c_mb.append((g.ranks, sum(t.compute_s for t in times)))
            busy += total * len(g.ranks)
        full.append(f_mb)
        compute.append(c_mb)
    step = step_end(full, plan.dp_cp_size, rule, pp_size)
    comp = step_end(compute, plan.dp_cp_size, rule, pp_size)
    return {"step_s": step, "compute_step_s": comp, "comm_s": step - comp, "busy_s": busy}


def _one_batch(batch: Batch, model: CostModel, timer: Timer, link: LinkTable, dims: ModelDims,
               rule: str, pp: int) -> dict:
    out = {"set": batch.set, "label": batch.label, "dp_cp_size": batch.dp_cp_size,
           "max_seq_len_per_rank": batch.max_seq_len_per_rank, "sequences": len(batch.seq_lens),
           "tokens": sum(batch.seq_lens), "impl": {}}
    t0 = time.process_time()
    made = plans(batch, model, rule, pp)
    out["plan_cpu_s"] = time.process_time() - t0
    for name, plan in made.items():
        if isinstance(plan, str):
            out["impl"][name] = {"error": plan}
            continue
        r = replay_plan(plan, timer, link, dims, rule, pp)
        r["modeled_s"] = model.step_time(plan, rule, pp)
        r["model_error"] = r["modeled_s"] / r["step_s"] - 1.0
        r["token_fill"] = plan.stats.mean_token_fill
        r["microbatches"] = len(plan.microbatches)
        r["cp_sizes"] = sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})
        if name == "cpkit":
            r["candidate"] = plan.candidate
        out["impl"][name] = r
    busy = [r["busy_s"] for r in out["impl"].values() if "busy_s" in r]
    out["area_bound_s"] = min(busy) / (batch.dp_cp_size * pp)  # a stage holds 1/pp of the layers
    ck = out["impl"]["cpkit"]["step_s"]
    out["ratios"] = {f"{k}/cpkit": r["step_s"] / ck for k, r in out["impl"].items()
                     if k != "cpkit" and "step_s" in r}
    out["bound/cpkit"] = out["area_bound_s"] / ck
    return out


def summarize(results: list[dict]) -> dict:
    """Per set: median and min of every ratio, the model's median and max |error| (cpkit's
    plans), median token fill per implementation."""
    summary = {}
    for s in sorted({r["set"] for r in results}):
        rows = [r for r in results if r["set"] == s]
        entry = {"batches": len(rows)}
        for key in sorted({k for r in rows for k in r["ratios"]} | {"bound/cpkit"}):
            vals = [r["ratios"][key] if key in r["ratios"] else r.get(key) for r in rows]
            vals = [v for v in vals if v is not None]
            if vals:
                entry[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        errs = [abs(r["impl"]["cpkit"]["model_error"]) for r in rows]
        all_errs = [abs(i["model_error"]) for r in rows for i in r["impl"].values()
                    if "model_error" in i]
        entry["model_error_cpkit"] = {"median": statistics.median(errs), "max": max(errs)}
        entry["model_error_all"] = {"median": statistics.median(all_errs), "max": max(all_errs)}
        entry["token_fill"] = {k: statistics.median(r["impl"][k]["token_fill"] for r in rows
                                                    if "token_fill" in r["impl"].get(k, {}))
                               for k in ("cpkit", "static", "mcore", "mlm")
                               if any("token_fill" in r["impl"].get(k, {}) for r in rows)}
        summary[s] = entry
    return summary


def _targets(summary: dict, results: list[dict]) -> dict[str, bool]:
    checks = {}
    every = [r["ratios"]["static/cpkit"] for r in results]
    checks[f"cpkit >= static on every batch (min static/cpkit {min(every):.3f})"] = min(every) >= 1.0
    for s, want in TARGETS.items():
        if s in summary:
            med = summary[s]["static/cpkit"]["median"]
            checks[f"{s}: median static/cpkit >= {want} ({med:.3f})"] = med >= want
    for other in ("mcore", "mlm"):
        vals = [r["ratios"][f"{other}/cpkit"] for r in results if f"{other}/cpkit" in r["ratios"]]
        if vals:
            checks[f"cpkit >= {other} on every batch (min {other}/cpkit {min(vals):.3f})"] = \
                min(vals) >= 1.0
    errs = [abs(r["impl"]["cpkit"]["model_error"]) for r in results]
    med = statistics.median(errs)
    checks[f"model within {MODEL_MEDIAN:.0%} of the replay (median |error| {med:.1%})"] = \
        med <= MODEL_MEDIAN
    checks[f"model within {MODEL_MAX:.0%} on every batch (max |error| {max(errs):.1%})"] = \
        max(errs) <= MODEL_MAX
    return checks


def _plot(path: Path, results: list[dict]) -> str:
    plt = pyplot()
    if plt is None:
        return PLOT_SKIPPED
    fig, ax = plt.subplots(figsize=(12, 4.5))
    xs = range(len(results))
    for key, marker in (("static/cpkit", "o"), ("mcore/cpkit", "s"), ("mlm/cpkit", "^")):
        pts = [(x, r["ratios"][key]) for x, r in zip(xs, results) if key in r["ratios"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=key)
    ax.plot(list(xs), [r["bound/cpkit"] for r in results], "_", label="area bound/cpkit")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["label"] for r in results], rotation=90, fontsize=6)
    ax.set_ylabel("replayed step time / cpkit's (> 1: cpkit faster)")
    ax.set_title("dynamic CP replayed on one GPU: step time ratios per batch", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench replay",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke runs)")
    p.add_argument("--sets", default="mix,mixlong,long",
                   help="built-in batch sets: mix, mixlong, long (default all)")
    p.add_argument("--batches", type=int, default=2, help="batches per (mix, N, M) cell")
    p.add_argument("--sizes", default=None, help="DPxCP sizes of the built-in sets, e.g. 8,16")
    p.add_argument("--quick", action="store_true", help="N = 8 only, 1 batch per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-lens-file", default=None, help="one batch of lengths per line (or JSON)")
    p.add_argument("--dp-cp-size", type=int, default=8, help="N for --seq-lens-file")
    p.add_argument("--max-seq-len-per-rank", type=int, default=8192, help="M for --seq-lens-file")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (> 1: lockstep)")
    p.add_argument("--link", default="nvlink", help="nvlink (default), ib, or a JSON file")
    p.add_argument("--calibration", default=None, help="use this calibration instead of "
                                                        "measuring one from the replay's kernels")
    p.add_argument("--write-calibration", default=None, help="write the measured calibration here")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=None, help=f"JSON (default {DEFAULT_RESULTS_DIR}/{NAME}.json)")
    p.add_argument("--plot", default=None, help="PNG (default: the JSON path with .png)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new batch after this many seconds (the rest is reported skipped)")
    return p


def main(argv=None) -> int:
    """Run the replay; returns 0 (1 with --strict when a target is missed, 2 without CUDA)."""
    argv = list(sys.argv[2:] if argv is None else argv)
    args = _parser().parse_args(argv)
    bad = [Violation(f"--{name.replace('_', '-')}", getattr(args, name), f"must be an int >= {low}",
                     f"pass e.g. --{name.replace('_', '-')} {max(low, 1)}")
           for name, low in (("pp", 1), ("batches", 1), ("iters", 1), ("warmup", 0),
                             ("dp_cp_size", 1), ("max_seq_len_per_rank", 1))
           if getattr(args, name) < low]
    bad += [Violation("--sets", s, "must be mix, mixlong or long", "pass e.g. --sets mix,long")
            for s in args.sets.split(",") if s.strip() and s.strip() not in ("mix", "mixlong", "long")]
    if bad:
        raise CPConfigError(bad)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device; use --device cpu --tiny for a smoke run")
        return 2
    device = torch.device(args.device)
    dims = TINY_DIMS if args.tiny else REPLAY_DIMS
    link = link_table(args.link)
    timer = KernelTimer(dims, device, warmup=args.warmup, iters=args.iters)
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (smoke run)"
    t0 = time.perf_counter()
    if args.calibration:
        cal = load_calibration(args.calibration)
    else:
        data = calibration_from_timer(timer, dims, link, device=dev_name, quick=args.tiny,
                                      origin=f"python -m cpkit.bench replay, commit {source_commit()}")
        if args.write_calibration:
            Path(args.write_calibration).parent.mkdir(parents=True, exist_ok=True)
            Path(args.write_calibration).write_text(json.dumps(data, indent=2) + "\n")
        cal = Calibration.from_dict(data)
    model = CostModel(dims=dims, calibration=cal)
    calib_s = time.perf_counter() - t0
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    todo = read_seq_lens_file(args.seq_lens_file, args.dp_cp_size, args.max_seq_len_per_rank) \
        if args.seq_lens_file else []
    sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else None
    todo += batches([s for s in sets if s in ("mix", "mixlong", "long")], 1 if args.quick else args.batches,
                    args.seed, args.quick, sizes, 64 if args.tiny else 1) if not args.seq_lens_file else []
    rule = "free" if args.pp == 1 else "lockstep"
    results, skipped = [], []
    partial = Path(args.out or f"{DEFAULT_RESULTS_DIR}/{NAME}.json").with_suffix(".partial.json")
    for batch in todo:
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            skipped.append(batch.label)
            continue
        results.append(_one_batch(batch, model, timer, link, dims, rule, args.pp))
        r = results[-1]
        print(f"  {r['label']}: " + ", ".join(f"{k} {v['step_s'] * 1e3:.0f} ms" for k, v in
              r["impl"].items() if "step_s" in v) + f" ({timer.measured} shapes measured)",
              flush=True)
        write_json(NAME, {"results": results}, str(partial))  # survives a timeout
    if skipped:
        print(f"skipped (--budget-s): {', '.join(skipped)}")
    summary = summarize(results)
    impls = ["cpkit", "static", "mcore", "mlm"]
    rows, cells = [], {}
    for r in results:
        label = r["label"]
        rows.append(label)
        for k in impls:
            i = r["impl"].get(k)
            if i is None:
                continue
            cells[(label, f"{k} ms")] = (f"{i['step_s'] * 1e3:.0f}" if "step_s" in i
                                         else i["error"][:12])
        c = r["impl"]["cpkit"]
        cells[(label, "comm ms")] = f"{c['comm_s'] * 1e3:.1f}"
        for key, v in r["ratios"].items():
            cells[(label, key)] = f"{v:.2f}"
        cells[(label, "bound/cpkit")] = f"{r['bound/cpkit']:.2f}"
        cells[(label, "fill cpkit/static")] = (f"{c['token_fill']:.2f}/"
                                               f"{r['impl']['static']['token_fill']:.2f}")
        cells[(label, "model err")] = f"{c['model_error']:+.1%}"
        cells[(label, "chose")] = c.get("candidate") or "-"
    ratio_cols = sorted({k for r in results for k in r["ratios"]})
    columns = [f"{k} ms" for k in impls if any(k in r["impl"] for r in results)] + \
        ["comm ms"] + ratio_cols + ["bound/cpkit", "fill cpkit/static", "model err", "chose"]
    print(f"dynamic CP replayed on {dev_name}: {dims.num_layers} layers, hidden "
          f"{dims.hidden_size}, heads {dims.num_heads}/{dims.num_kv_heads}, ffn "
          f"{dims.ffn_hidden_size}{' SwiGLU' if dims.gated_linear_unit else ''}; step rule "
          f"{rule}, PP={args.pp}; link {link.name} ({link.bandwidth / 1e9:.0f} GB/s, "
          f"{link.latency_s * 1e6:.0f} us, modeled); {timer.measured} shapes measured "
          f"(calibration {calib_s:.0f} s)")
    print("replayed step time (ms; compute measured, ring communication modeled); "
          "model err = modeled / replayed - 1 (cpkit's plan)")
    print(format_table(rows, columns, cells, corner="batch"))
    for s, e in summary.items():
        parts = [f"{k} median {v['median']:.2f} min {v['min']:.2f}" for k, v in e.items()
                 if isinstance(v, dict) and "median" in v and "/" in k]
        print(f"{s} ({e['batches']} batches): " + "; ".join(parts) +
              f"; model |error| median {e['model_error_cpkit']['median']:.1%} max "
              f"{e['model_error_cpkit']['max']:.1%}; token fill " +
              ", ".join(f"{k} {v:.2f}" for k, v in e["token_fill"].items()))
    checks = _targets(summary, results)
    errs = [abs(r["impl"]["cpkit"]["model_error"]) for r in results]
    errs_all = [abs(i["model_error"]) for r in results for i in r["impl"].values()
                if "model_error" in i]
    replay_check = {
        "what": "the model's step time against the replay's: |modeled / replayed - 1|",
        "cpkit_median": statistics.median(errs) if errs else None,
        "cpkit_max": max(errs) if errs else None,
        "all_plans_median": statistics.median(errs_all) if errs_all else None,
        "all_plans_max": max(errs_all) if errs_all else None,
        "batches": len(results), "device": dev_name, "commit": source_commit(), "link": link.name,
        "command": "python -m cpkit.bench replay " + " ".join(argv or []),
    }
    if args.write_calibration and not args.calibration:
        data["replay_check"] = replay_check
        Path(args.write_calibration).write_text(json.dumps(data, indent=2) + "\n")
    for name, ok in checks.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    path = write_json(NAME, {
        "benchmark": NAME, "commit": source_commit(), "device": dev_name, "machine": machine_info(),
        "dims": vars(dims), "link": link.to_dict(), "step_rule": rule, "pp": args.pp,
        "warmup": args.warmup, "iters": args.iters, "shapes_measured": timer.measured,
        "calibration": cal.source, "summary": summary, "skipped": skipped,
        "replay_check": replay_check,
        "targets": {k: bool(v) for k, v in checks.items()}, "results": results,
    }, args.out)
    print(f"json: {path}")
    print(_plot(Path(args.plot) if args.plot else path.with_suffix(".png"), results))
    return 1 if args.strict and not all(checks.values()) else 0
