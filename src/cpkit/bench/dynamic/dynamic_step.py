"""`python -m cpkit.bench dynamic_step`: dynamic CP in a real training step on N GPUs, measured
against the step model's prediction.

Every plan family runs the same global batches (the replay's mixes, cpkit.bench.dynamic.replay_plans, at
DPxCP N = the number of ranks): cpkit's plan (cpkit.dynamic.schedule with the step model and
MCore's and Megatron-LM's plans as references), static CP with packing, MCore's
BalancedCPScheduler and Megatron-LM dev's scheduler (with CPKIT_MLM_SRC; skipped with the reason
without it). Each plan drives a real MCore GPTModel training step through cpkit's dynamic-CP
runtime (forward and backward with the per-micro-batch CP switch, the DPxCP gradient all-reduce,
the optimizer step) on N ranks over NCCL (`--device cpu`: gloo, a smoke run), spawned with
cpkit.harness.launch.launch under a timeout. What each rank does: cpkit.bench.dynamic.dynamic_step_rank.

The prediction is the step model's (cpkit.dynamic.step_model: kernels, counted host ops, syncs,
memory-bound work, preparation, gradient reduce and optimizer), calibrated from micro-benchmarks
only (cpkit.bench.dynamic.dynamic_step_calibrate), never from these steps; the calibration is cached in
a JSON file per GPU, ranks, torch, MCore and model shape (`--calibration`, default under
bench-results/dynamic_step-calibration/) and measured in the run when the file is missing
(`--recalibrate`: always). Reported per batch and family (cpkit.bench.dynamic.dynamic_step_report):
real vs predicted step and forward + backward (median over `--iters` steps after `--warmup`,
slowest rank), the error of each, per-rank forward + backward, the full plan (JSON), and the
targets: every error within 10%, the predicted order of the families right where they differ
by more than 5%, cpkit no slower than MCore's and Megatron-LM's plans, 1.2x faster than static
CP on the lognormal batches. `--replay` adds the replay's prediction (slow).

Per family and batch also one extra step with every micro-batch marked (host times and CUDA
events, no sync added: cpkit.dynamic.microbatch_timeline), its terms against the model's
(cpkit.bench.dynamic.dynamic_step_breakdown): which of micro-batches, the time between them, the
preparation or the reduce and optimizer misses. `--hidden`, `--ffn`, `--heads`, `--kv-heads`,
`--layers` set the model's shape (the calibration cache is per shape).

`--device cpu --quick`: tiny model, gloo, one shrunk batch, few iterations (CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cpkit.bench.common import DEFAULT_RESULTS_DIR, machine_info, write_json
from cpkit.bench.dynamic.dynamic_step_breakdown import breakdown_table
from cpkit.bench.dynamic.dynamic_step_rank import FAMILIES, StepSpec, run_rank
from cpkit.bench.dynamic.dynamic_step_report import TOLERANCE, cpkit_source, summarize, table, targets
from cpkit.errors import CPConfigError, Violation

__all__ = ["TOLERANCE", "main", "summarize"]

NAME = "dynamic_step"
SETS = ("mix", "mixlong", "long")
CALIBRATION_DIR = f"{DEFAULT_RESULTS_DIR}/dynamic_step-calibration"
#: (option, default, what): the model's shape; head dim = hidden / heads
MODEL_OPTIONS = (("--hidden", 4096, "hidden size"), ("--ffn", 14336, "SwiGLU FFN size"),
                 ("--heads", 32, "query heads"), ("--kv-heads", 8, "KV heads (GQA groups)"),
                 ("--layers", 4, "layers (time and memory grow with them)"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench dynamic_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, one shrunk batch, 1 warm-up + 2 steps")
    p.add_argument("--ranks", type=int, default=4, help="ranks = DPxCP size (GPUs with cuda)")
    model = p.add_argument_group("model shape (default: the replay's layer, 4 layers; --quick: a tiny model)")
    for flag, default, what in MODEL_OPTIONS:
        model.add_argument(flag, type=int, default=None, help=f"{what} (default {default})")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (not replayed: keep small)")
    p.add_argument("--sets", default="mix", help="replay sets: mix (default), mixlong, long")
    p.add_argument("--batches", type=int, default=1, help="batches per (mix, M) cell")
    p.add_argument("--max-batches", type=int, default=None, help="run only the first K batches")
    p.add_argument("--families", default=",".join(FAMILIES), help="cpkit,static,mcore,mlm")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--kernel-warmup", type=int, default=1, help="the replay's kernel timing")
    p.add_argument("--kernel-iters", type=int, default=3)
    p.add_argument("--link", default="measured",
                   help="measured (default: on these ranks), nvlink, ib or a link JSON")
    p.add_argument("--link-out", default=None,
                   help=f"where the measured link table goes (default {DEFAULT_RESULTS_DIR}/link.json)")
    p.add_argument("--link-table", action="store_true",
                   help="only measure the link table (python -m cpkit.bench link)")
    p.add_argument("--calibration", default=None,
                   help="calibration JSON: read when it exists, else measured and written there "
                        f"(default {CALIBRATION_DIR}/<GPU, ranks, torch, MCore, model>.json)")
    p.add_argument("--recalibrate", action="store_true", help="measure the calibration even if cached")
    p.add_argument("--replay", action="store_true",
                   help="also the replay's prediction (rank 0 times every plan's kernels: slow)")
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
           for n, low, fix in (("ranks", 2, 4), ("vocab", 2, 1024), ("batches", 1, 1),
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
    if args.calibration and Path(args.calibration).is_dir():
        bad.append(Violation("--calibration", args.calibration, "must be a file path, not a folder",
                             f"pass e.g. --calibration {args.calibration.rstrip('/')}/calibration.json"))
    if args.ranks >= 2 and args.ranks & (args.ranks - 1):
        bad.append(Violation("--ranks", args.ranks, "must be a power of two (aligned CP groups)",
                             "pass --ranks 4"))
    return bad + _shape_violations(_shape(args))


def _shape(args) -> dict[str, int]:
    """{option: value} of the model's shape: the options given, else --quick's tiny model's or
    MODEL_OPTIONS' defaults."""
    from cpkit.bench.dynamic.replay import TINY_DIMS

    tiny = {"--hidden": TINY_DIMS.hidden_size, "--ffn": TINY_DIMS.ffn_hidden_size,
            "--heads": TINY_DIMS.num_heads, "--kv-heads": TINY_DIMS.num_kv_heads,
            "--layers": TINY_DIMS.num_layers}
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in MODEL_OPTIONS}
    return {flag: given[flag] if given[flag] is not None else (tiny[flag] if args.quick else default)
            for flag, default, _ in MODEL_OPTIONS}


def _fitting_shape(hidden: int, heads: int, kv_heads: int) -> tuple[int, int, int]:
    """(hidden, heads, kv heads) that pass _shape_violations, keeping the query heads: hidden
    the nearest multiple of 2 x heads (an even head dim), the most KV heads up to `kv_heads`
    that divide the heads."""
    step = 2 * heads
    hidden = max(step, step * round(hidden / step))
    kv_heads = max(k for k in range(1, min(heads, kv_heads) + 1) if heads % k == 0)
    return hidden, heads, kv_heads


def _shape_violations(shape: dict[str, int]) -> list[Violation]:
    """Every constraint the model's shape breaks, each with one fix that passes them all."""
    bad = [Violation(flag, v, "must be an int >= 1", f"pass e.g. {flag} {default}")
           for (flag, default, _), v in zip(MODEL_OPTIONS, shape.values()) if v < 1]
    if bad:
        return bad
    hidden, heads, kv = shape["--hidden"], shape["--heads"], shape["--kv-heads"]
    fix_h, fix_q, fix_kv = _fitting_shape(hidden, heads, kv)
    fix = f"pass --hidden {fix_h} --heads {fix_q} --kv-heads {fix_kv}"
    if hidden % heads:
        bad.append(Violation("--hidden", hidden, f"must be divisible by --heads {heads} (head dim = "
                             "hidden / heads)", fix))
    elif (hidden // heads) % 2:
        bad.append(Violation("--heads", heads, f"gives an odd head dim {hidden} / {heads} = "
                             f"{hidden // heads}; it must be even (RoPE rotates pairs)", fix))
    if heads % kv:
        bad.append(Violation("--kv-heads", kv, f"must divide --heads {heads} (each KV head serves "
                             "a group of query heads)", fix))
    return bad


def _spec(args):
    from cpkit.bench.dynamic.link import BYTES, QUICK_BYTES
    from cpkit.bench.dynamic.replay import REPLAY_DIMS, TINY_DIMS
    from cpkit.bench.dynamic.replay_plans import batches
    import dataclasses

    shape = _shape(args)
    dims = dataclasses.replace(TINY_DIMS if args.quick else REPLAY_DIMS, hidden_size=shape["--hidden"],
                               ffn_hidden_size=shape["--ffn"], num_heads=shape["--heads"],
                               num_kv_heads=shape["--kv-heads"], head_dim=shape["--hidden"] // shape["--heads"],
                               num_layers=shape["--layers"])
    todo = batches([s.strip() for s in args.sets.split(",")], args.batches, args.seed,
                   sizes=(args.ranks,), shrink=64 if args.quick else 1)
    limit = 1 if args.quick and args.max_batches is None else args.max_batches
    todo = todo[:limit] if limit else todo
    out = Path(args.out or f"{DEFAULT_RESULTS_DIR}/{NAME}.json")
    vocab = 128 if args.quick else args.vocab
    return StepSpec(
        dims=dims, vocab_size=vocab, batches=tuple(todo), recalibrate=args.recalibrate,
        replay=args.replay,
        families=tuple(f.strip() for f in args.families.split(",")),
        warmup=1 if args.quick else args.warmup, iters=2 if args.quick else args.iters,
        kernel_warmup=args.kernel_warmup, kernel_iters=args.kernel_iters, link=args.link,
        link_bytes=tuple(QUICK_BYTES if args.quick else BYTES), calibration=args.calibration or "",
        calibration_dir=CALIBRATION_DIR,
        quick=args.quick, budget_s=args.budget_s,
        partial_path=str(out.with_suffix(".partial.json")), seed=args.seed), out


def _link_only(args) -> int:
    from cpkit.bench.dynamic import link

    argv = ["--device", args.device, "--ranks", str(args.ranks), "--timeout-s", str(args.timeout_s)]
    argv += ["--quick"] if args.quick else []
    argv += ["--out", args.link_out] if args.link_out else []
    argv += ["--calibration", args.calibration] if args.calibration else []
    return link.main(argv)


def _partial(spec) -> None:
    partial = Path(spec.partial_path)
    if partial.is_file():  # the batches that finished before the failure
        done = json.loads(partial.read_text())["results"]
        summarize(done)
        print(f"the {len(done)} batches that finished (partial):\n{table(done)}")
        where = breakdown_table(done)
        if where:
            print(where)


def _print_calibration(res: dict) -> None:
    step = res["calibration"]["step"]
    how = "measured in this run" if res["calibrated_here"] else "read from the cache"
    print(f"calibration ({how}): {res['calibration_path']}")
    ops = step["ops"]["per_cp"]
    print("  counted per micro-batch fwd+bwd: " + "; ".join(
        f"cp {c}: {v[0]:.0f} ops + {v[1]:.0f} per sample, {v[2]:.0f} syncs {v[3]:+.1f} per sample"
        for c, v in ops.items()) + f" ({step['ops']['source']})")
    print(f"  host {step['host_op_s'] * 1e6:.1f} us/op (per-sample ops {step['sample_op_s'] * 1e6:.1f} us), "
          f"sync {step['sync_s'] * 1e6:.1f} us, memory-bound "
          f"{step['mem_s_per_token'] * 1e9:.2f} ns/token/layer, overlap loss {step['overlap_loss']:.2f}, "
          f"residual per micro-batch " + ", ".join(f"cp {c} {v * 1e3:.2f} ms" for c, v in step["residual_s"].items())
          + ("" if step["source"].get("residual_identified") else " (cp 1 held at 0: no second model size)")
          + f", call gap {step.get('call_gap_s', 0.0) * 1e3:.2f} ms once per forward-backward call, idle slot {step['idle_s'] * 1e3:.2f} ms, prep {step['prep_mb_s'] * 1e3:.2f} ms/mb + "
          f"{step['prep_sample_s'] * 1e3:.2f} ms/sample, reduce+opt {step['reduce_opt_s'] * 1e3:.1f} ms")
    fit = step["source"].get("fit_errors", {})
    print("  fit on the micro-benchmarks (predicted/measured - 1): " + "; ".join(
        f"cp {c}: " + ", ".join(f"{e:+.0%}" for e in v) for c, v in fit.items()))


def main(argv=None) -> int:
    """Run the bench; 0 (1: a rank failed, or --strict and a target missed; 2: too few GPUs)."""
    from cpkit.harness.launch import RankFailure, launch

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
    source = cpkit_source()
    print(f"dynamic_step: {len(spec.batches)} batches x {len(spec.families)} plan families on "
          f"{args.ranks} ranks ({args.device}), {spec.dims.num_layers} layers of "
          f"{spec.dims.hidden_size}, {spec.warmup} warm-up + {spec.iters} steps each; cpkit "
          f"{source['commit'] or 'not in git'}{' with changes' if source['dirty'] else ''} (content "
          f"{source['fingerprint']})", flush=True)
    try:
        res = launch(run_rank, args.ranks, backend="nccl" if args.device == "cuda" else "gloo",
                     timeout=args.timeout_s, args=(spec,))[0]
    except RankFailure as err:
        print(f"error: {err}\npartial results: {spec.partial_path}", file=sys.stderr)
        _partial(spec)
        return 1
    results = res["results"]
    summary = summarize(results)
    link = res["link"]
    print(f"dynamic CP, real training step on {args.ranks} x {res['device']}: "
          f"{spec.dims.num_layers} layers, hidden {spec.dims.hidden_size}, heads "
          f"{spec.dims.num_heads}/{spec.dims.num_kv_heads}, ffn {spec.dims.ffn_hidden_size}, vocab "
          f"{spec.vocab_size}; link {link['name']} ({link['latency_s'] * 1e6:.1f} us + "
          f"{link['bandwidth_GBps']:.1f} GB/s); run {res['wall_s']:.0f} s")
    _print_calibration(res)
    print("measured: median over the steps of the slowest rank (rank f+b: each rank's median); "
          "pred: the step model (modeled); err = predicted / measured - 1; pace: the host's pace in "
          "the batch's rounds over the calibration's (a probe's seconds); err@pace: the model read at "
          "that pace; kernels: the kernels-only model of the step")
    print(table(results))
    where = breakdown_table(results)
    if where:
        print(where)
    for r in results:
        if r["real_ratios"]:
            print(f"{r['label']}: real step " + ", ".join(f"{k} {v:.3f}" for k, v in r["real_ratios"].items())
                  + f"; loss spread over plans {r['loss_spread']:.2e}")
    for r in results:
        if r["common_error"] is not None:
            within = r["within_batch_errors"].values()
            pace = (r.get("host_pace") or {}).get("pace")
            print(f"{r['label']}: common error {r['common_error']:+.1%} (every plan alike: the host's pace "
                  f"against the calibration's" + (f", measured {pace:.3f}" if pace else "")
                  + f"), within the batch {min(within):+.1%} to {max(within):+.1%}")
    for p in summary["order_problems"]:
        print(f"order: {p}")
    ph = res["phases"]
    print(f"wall: link {ph['link_s']:.0f} s, model build and communicators {ph['build_s']:.0f} s, "
          f"calibration {ph['calibration_s']:.0f} s; per batch: " + ", ".join(
              f"plans {r['predict_wall_s']:.1f} s + steps {r['steps_wall_s']:.0f} s" for r in results))
    if res["skipped"]:
        print(f"skipped (--budget-s): {', '.join(res['skipped'])}")
    checks = targets(results, summary, res)
    for name, ok in checks.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    if res["link_table"] is not None and res["calibrated_here"]:
        from cpkit.bench.dynamic.link import format_link

        print(format_link(res["link_table"]))
        lpath = Path(args.link_out or f"{DEFAULT_RESULTS_DIR}/link.json")
        lpath.parent.mkdir(parents=True, exist_ok=True)
        lpath.write_text(json.dumps(res["link_table"], indent=2) + "\n")
        print(f"link table: {lpath} (python -m cpkit.bench replay --link {lpath})")
    path = write_json(NAME, {
        "benchmark": NAME, "source_commit": source["commit"], "cpkit": source,
        "device": res["device"], "ranks": args.ranks,
        "machine": machine_info(), "dims": vars(spec.dims), "vocab_size": spec.vocab_size,
        "warmup": spec.warmup, "iters": spec.iters, "link": link, "link_table": res["link_table"],
        "calibration_path": res["calibration_path"], "calibrated_here": res["calibrated_here"],
        "calibration": res["calibration"], "summary": summary, "skipped": res["skipped"],
        "phases": res["phases"], "targets": {k: bool(v) for k, v in checks.items()}, "results": results,
        "command": "python -m cpkit.bench dynamic_step " + " ".join(argv), "wall_s": res["wall_s"],
    }, str(out))
    print(f"json: {path}")
    return 1 if args.strict and not all(checks.values()) else 0
