"""`python -m cpkit.bench dynamic_step`: dynamic CP in a real training step on N GPUs, measured.

Every plan family runs the same global batches (the replay's mixes, cpkit.bench.replay_plans, at
DPxCP N = the number of ranks): cpkit's plan, static CP with packing, MCore's
BalancedCPScheduler and Megatron-LM dev's scheduler (with CPKIT_MLM_SRC; skipped with the reason
without it). Each plan drives a real MCore GPTModel training step through cpkit's dynamic-CP
runtime (forward and backward with the per-micro-batch CP switch, the DPxCP gradient all-reduce,
the optimizer step) on N ranks over NCCL (`--device cpu`: gloo, a smoke run), spawned with
cpkit.launch.launch under a timeout. What each rank does: cpkit.bench.dynamic_step_rank.

Reported per batch and family: the median over `--iters` steps after `--warmup` of the step
time and of its forward + backward part (the slowest rank's), tokens per second, and beside
them the predictions for the same plan in the same run on the same machine: "replayed"
(`python -m cpkit.bench replay`'s machinery: rank 0's kernels measured, the ring modeled from
the link table measured on these ranks before the steps) and "modeled" (cpkit.dynamic.cost,
calibrated from the same kernels). Ratio columns: predicted / measured forward + backward (what
both predict: the layers and the ring; not the gradient all-reduce, the optimizer, the
embedding or the output layer, which the "step" column adds). Targets: replay and model within
10% per family (median over batches); cpkit at least as fast as static CP on every batch and as
MCore's and Megatron-LM's plans in the median. The link table is written too (`--link-out`,
what `replay --link FILE` reads); `--link-table` measures only it (cpkit.bench.link).

`--device cpu --quick`: tiny model, gloo, one shrunk batch, few iterations (CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from cpkit.bench.common import DEFAULT_RESULTS_DIR, format_table, machine_info, source_commit, write_json
from cpkit.bench.dynamic_step_rank import FAMILIES, StepSpec, run_rank
from cpkit.errors import CPConfigError, Violation

__all__ = ["TOLERANCE", "main", "summarize"]

NAME = "dynamic_step"
TOLERANCE = 0.10  # replay and model vs the real step, per family (median over batches)
SETS = ("mix", "mixlong", "long")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench dynamic_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, one shrunk batch, 1 warm-up + 2 steps")
    p.add_argument("--ranks", type=int, default=4, help="ranks = DPxCP size (GPUs with cuda)")
    p.add_argument("--layers", type=int, default=4,
                   help="layers of the replay's 4096-wide model (time and memory grow with it)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (not replayed: keep small)")
    p.add_argument("--sets", default="mix", help="replay sets: mix (default), mixlong, long")
    p.add_argument("--batches", type=int, default=1, help="batches per (mix, M) cell")
    p.add_argument("--max-batches", type=int, default=None, help="run only the first K batches")
    p.add_argument("--families", default=",".join(FAMILIES), help="cpkit,static,mcore,mlm")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--kernel-warmup", type=int, default=1, help="the replay's kernel timing")
    p.add_argument("--kernel-iters", type=int, default=3)
    p.add_argument("--link", default="measured",
                   help="measured (default: on these ranks), nvlink, ib or a link JSON")
    p.add_argument("--link-out", default=None,
                   help=f"where the measured link table goes (default {DEFAULT_RESULTS_DIR}/link.json)")
    p.add_argument("--link-table", action="store_true",
                   help="only measure the link table (python -m cpkit.bench link)")
    p.add_argument("--calibration", default=None,
                   help="the cost model's rates from this file (default: measured in this run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new batch after this many seconds (the rest is reported skipped)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="launch timeout (all ranks)")
    p.add_argument("--out", default=None, help=f"JSON (default {DEFAULT_RESULTS_DIR}/{NAME}.json)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p


def _validate(args) -> list[Violation]:
    """Every bad option at once."""
    bad = [Violation(f"--{n.replace('_', '-')}", getattr(args, n), f"must be >= {low}",
                     f"pass e.g. --{n.replace('_', '-')} {fix}")
           for n, low, fix in (("ranks", 2, 4), ("layers", 1, 4), ("vocab", 2, 1024), ("batches", 1, 1),
                               ("warmup", 0, 3), ("iters", 1, 10), ("kernel_warmup", 0, 1),
                               ("kernel_iters", 1, 3), ("timeout_s", 1, 600))
           if getattr(args, n) < low]
    for n in ("max_batches", "budget_s"):
        if getattr(args, n) is not None and getattr(args, n) <= 0:
            bad.append(Violation(f"--{n.replace('_', '-')}", getattr(args, n), "must be > 0",
                                 f"leave --{n.replace('_', '-')} out for no limit"))
    bad += [Violation("--sets", s, f"must be one of {', '.join(SETS)}", "pass e.g. --sets mix")
            for s in args.sets.split(",") if s.strip() not in SETS]
    bad += [Violation("--families", f, f"must be one of {', '.join(FAMILIES)}",
                      f"pass e.g. --families {','.join(FAMILIES)}")
            for f in args.families.split(",") if f.strip() not in FAMILIES]
    if args.link not in ("measured", "nvlink", "ib") and not Path(args.link).is_file():
        bad.append(Violation("--link", args.link, "must be measured, nvlink, ib or an existing JSON",
                             "pass --link measured"))
    if args.calibration and not Path(args.calibration).is_file():
        bad.append(Violation("--calibration", args.calibration, "must be an existing calibration file",
                             "leave --calibration out to measure one in this run"))
    if args.ranks >= 2 and args.ranks & (args.ranks - 1):
        bad.append(Violation("--ranks", args.ranks, "must be a power of two (aligned CP groups)",
                             "pass --ranks 4"))
    return bad


def _spec(args):
    from cpkit.bench.link import BYTES, QUICK_BYTES
    from cpkit.bench.replay import REPLAY_DIMS, TINY_DIMS
    from cpkit.bench.replay_plans import batches
    import dataclasses

    dims = TINY_DIMS if args.quick else dataclasses.replace(REPLAY_DIMS, num_layers=args.layers)
    todo = batches([s.strip() for s in args.sets.split(",")], args.batches, args.seed,
                   sizes=(args.ranks,), shrink=64 if args.quick else 1)
    limit = 1 if args.quick and args.max_batches is None else args.max_batches
    todo = todo[:limit] if limit else todo
    out = Path(args.out or f"{DEFAULT_RESULTS_DIR}/{NAME}.json")
    return StepSpec(
        dims=dims, vocab_size=128 if args.quick else args.vocab, batches=tuple(todo),
        families=tuple(f.strip() for f in args.families.split(",")),
        warmup=1 if args.quick else args.warmup, iters=2 if args.quick else args.iters,
        kernel_warmup=args.kernel_warmup, kernel_iters=args.kernel_iters, link=args.link,
        link_bytes=tuple(QUICK_BYTES if args.quick else BYTES), calibration=args.calibration,
        quick=args.quick, budget_s=args.budget_s,
        partial_path=str(out.with_suffix(".partial.json")), seed=args.seed), out


def _med(xs):
    return statistics.median(xs) if xs else None


def summarize(results: list[dict]) -> dict:
    """Per family: medians over batches of replayed / measured and modeled / measured (forward +
    backward and whole step), of the real step time ratio other / cpkit, and the loss spread."""
    out = {}
    for r in results:
        for fam, i in r["impl"].items():
            if "step_s" not in i:
                continue
            fb, step = _med(i["fwd_bwd_s"]), _med(i["step_s"])
            i.update(fwd_bwd_median_s=fb, step_median_s=step, tokens_per_s=r["tokens"] / step,
                     replay_over_fwd_bwd=i["replayed_s"] / fb, model_over_fwd_bwd=i["modeled_s"] / fb,
                     replay_over_step=i["replayed_s"] / step, model_over_step=i["modeled_s"] / step)
        ck = r["impl"].get("cpkit", {}).get("step_median_s")
        r["real_ratios"] = {f"{k}/cpkit": i["step_median_s"] / ck for k, i in r["impl"].items()
                            if ck and k != "cpkit" and "step_median_s" in i}
        losses = [i["loss"] for i in r["impl"].values() if "loss" in i]
        r["loss_spread"] = (max(losses) - min(losses)) / abs(statistics.mean(losses)) \
            if len(losses) > 1 else 0.0
    for fam in FAMILIES:
        rows = [r["impl"][fam] for r in results if "step_median_s" in r["impl"].get(fam, {})]
        if rows:
            out[fam] = {k: _med([i[k] for i in rows]) for k in (
                "replay_over_fwd_bwd", "model_over_fwd_bwd", "replay_over_step", "model_over_step",
                "tokens_per_s")}
            out[fam]["batches"] = len(rows)
    for key in sorted({k for r in results for k in r["real_ratios"]}):
        vals = [r["real_ratios"][key] for r in results if key in r["real_ratios"]]
        out[key] = {"median": _med(vals), "min": min(vals)}
    return out


def _targets(summary: dict) -> dict[str, bool]:
    checks = {}
    for fam in FAMILIES:
        if fam in summary:
            for what in ("replay", "model"):
                v = summary[fam][f"{what}_over_fwd_bwd"]
                checks[f"{fam}: {what} within {TOLERANCE:.0%} of the real forward+backward "
                       f"(median {what}/real {v:.3f})"] = abs(v - 1) <= TOLERANCE
    if "static/cpkit" in summary:
        v = summary["static/cpkit"]["min"]
        checks[f"real step: cpkit >= static on every batch (min static/cpkit {v:.3f})"] = v >= 1.0
    for other in ("mcore", "mlm"):
        if f"{other}/cpkit" in summary:
            v = summary[f"{other}/cpkit"]["median"]
            checks[f"real step: cpkit >= {other} (median {other}/cpkit {v:.3f})"] = v >= 1.0
    return checks


def _table(results: list[dict]) -> str:
    rows, cells, notes = [], {}, []
    cols = ["step ms", "tok/s", "fwd+bwd ms", "replayed", "replay/real", "modeled", "model/real",
            "ring ms", "prep ms", "ar+opt ms", "cp", "mbs", "loss"]
    for r in results:
        for fam, i in r["impl"].items():
            row = f"{r['label']} {fam}"
            rows.append(row)
            if "replayed_s" in i:
                cells[(row, "replayed")] = f"{i['replayed_s'] * 1e3:.1f}"
                cells[(row, "modeled")] = f"{i['modeled_s'] * 1e3:.1f}"
                cells[(row, "ring ms")] = f"{i['replayed_comm_s'] * 1e3:.1f}"
                cells[(row, "cp")] = "/".join(map(str, i["cp_sizes"]))
                cells[(row, "mbs")] = str(i["microbatches"])
            if "step_median_s" not in i:
                cells[(row, "step ms")] = "n/a"
                notes.append(f"{row}: {i.get('error', 'not run')}")
                continue
            cells[(row, "step ms")] = f"{i['step_median_s'] * 1e3:.1f}"
            cells[(row, "tok/s")] = f"{i['tokens_per_s']:.0f}"
            cells[(row, "fwd+bwd ms")] = f"{i['fwd_bwd_median_s'] * 1e3:.1f}"
            cells[(row, "replay/real")] = f"{i['replay_over_fwd_bwd']:.3f}"
            cells[(row, "model/real")] = f"{i['model_over_fwd_bwd']:.3f}"
            cells[(row, "prep ms")] = f"{_med(i['prep_s']) * 1e3:.1f}"
            cells[(row, "ar+opt ms")] = f"{_med(i['reduce_opt_s']) * 1e3:.1f}"
            cells[(row, "loss")] = f"{i['loss']:.4f}"
    return "\n".join([format_table(rows, cols, cells, corner="batch / plan")] + notes)


def _link_only(args) -> int:
    from cpkit.bench import link

    argv = ["--device", args.device, "--ranks", str(args.ranks), "--timeout-s", str(args.timeout_s)]
    argv += ["--quick"] if args.quick else []
    argv += ["--out", args.link_out] if args.link_out else []
    argv += ["--calibration", args.calibration] if args.calibration else []
    return link.main(argv)


def main(argv=None) -> int:
    """Run the bench; 0 (1: a rank failed, or --strict and a target missed; 2: too few GPUs)."""
    from cpkit.launch import RankFailure, launch

    argv = list(sys.argv[2:] if argv is None else argv)
    args = _parser().parse_args(argv)
    bad = _validate(args)
    if bad:
        raise CPConfigError(bad)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"error: --ranks {args.ranks} needs {args.ranks} GPUs, {torch.cuda.device_count()} "
              "visible; use --device cpu --quick for a smoke run", file=sys.stderr)
        return 2
    if args.link_table:
        return _link_only(args)
    spec, out = _spec(args)
    print(f"dynamic_step: {len(spec.batches)} batches x {len(spec.families)} plan families on "
          f"{args.ranks} ranks ({args.device}), {spec.dims.num_layers} layers of "
          f"{spec.dims.hidden_size}, {spec.warmup} warm-up + {spec.iters} steps each", flush=True)
    try:
        res = launch(run_rank, args.ranks, backend="nccl" if args.device == "cuda" else "gloo",
                     timeout=args.timeout_s, args=(spec,))[0]
    except RankFailure as err:
        print(f"error: {err}\npartial results: {spec.partial_path}", file=sys.stderr)
        partial = Path(spec.partial_path)
        if partial.is_file():  # the batches that finished before the failure
            done = json.loads(partial.read_text())["results"]
            summarize(done)
            print(f"the {len(done)} batches that finished (partial):\n{_table(done)}")
        return 1
    results = res["results"]
    summary = summarize(results)
    link = res["link"]
    print(f"dynamic CP, real training step on {args.ranks} x {res['device']}: "
          f"{spec.dims.num_layers} layers, hidden {spec.dims.hidden_size}, heads "
          f"{spec.dims.num_heads}/{spec.dims.num_kv_heads}, ffn {spec.dims.ffn_hidden_size}, vocab "
          f"{spec.vocab_size}; link {link['name']} ({link['latency_s'] * 1e6:.1f} us + "
          f"{link['bandwidth_GBps']:.1f} GB/s); {res['shapes_measured']} kernel shapes replayed "
          f"(calibration {res['calibration_s']:.0f} s); run {res['wall_s']:.0f} s")
    print("measured: median of the slowest rank over the steps; replayed / modeled: predicted "
          "forward+backward (ms); x/real = predicted / measured forward+backward")
    print(_table(results))
    for fam in FAMILIES:
        if fam in summary:
            s = summary[fam]
            print(f"{fam} ({s['batches']} batches): median replay/real {s['replay_over_fwd_bwd']:.3f}, "
                  f"model/real {s['model_over_fwd_bwd']:.3f} (of the whole step: replay "
                  f"{s['replay_over_step']:.3f}, model {s['model_over_step']:.3f}); "
                  f"{s['tokens_per_s']:.0f} tokens/s")
    for r in results:
        if r["real_ratios"]:
            print(f"{r['label']}: real step " + ", ".join(f"{k} {v:.3f}" for k, v in r["real_ratios"].items())
                  + f"; loss spread over plans {r['loss_spread']:.2e}")
    ph = res["phases"]
    print(f"wall: link {ph['link_s']:.0f} s, model build {ph['build_s']:.0f} s, calibration "
          f"{res['calibration_s']:.0f} s; per batch: " + ", ".join(
              f"plans+replay {r['predict_wall_s']:.0f} s + steps {r['steps_wall_s']:.0f} s"
              for r in results))
    if res["skipped"]:
        print(f"skipped (--budget-s): {', '.join(res['skipped'])}")
    checks = _targets(summary)
    for name, ok in checks.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    if res["link_table"] is not None:
        from cpkit.bench.link import format_link

        print(format_link(res["link_table"]))
        lpath = Path(args.link_out or f"{DEFAULT_RESULTS_DIR}/link.json")
        lpath.parent.mkdir(parents=True, exist_ok=True)
        lpath.write_text(json.dumps(res["link_table"], indent=2) + "\n")
        print(f"link table: {lpath} (python -m cpkit.bench replay --link {lpath})")
    path = write_json(NAME, {
        "benchmark": NAME, "commit": source_commit(), "device": res["device"], "ranks": args.ranks,
        "machine": machine_info(), "dims": vars(spec.dims), "vocab_size": spec.vocab_size,
        "warmup": spec.warmup, "iters": spec.iters, "link": link, "link_table": res["link_table"],
        "calibration": res["calibration"], "summary": summary, "skipped": res["skipped"],
        "targets": {k: bool(v) for k, v in checks.items()}, "results": results,
        "command": "python -m cpkit.bench dynamic_step " + " ".join(argv), "wall_s": res["wall_s"],
    }, str(out))
    print(f"json: {path}")
    return 1 if args.strict and not all(checks.values()) else 0
