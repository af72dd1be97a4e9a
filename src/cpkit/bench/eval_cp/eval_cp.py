"""`python -m cpkit.bench eval_cp`: evaluate() at the training layout vs at a higher eval CP.

One launch over `--world-size` ranks (NCCL, one GPU per rank; or gloo with `--device cpu`).
For each layout (`--layouts`, e.g. tp1pp2 and tp2pp1: tp and pp fixed, cp_train -> cp_eval, dp
follows) and each sequence length (`--seq`), a GPT (cpkit.attention.gpt, cpkit attention, `--hidden`,
`--layers`, `--heads`, bf16) evaluates one fixed validation set (`--eval-samples`; default
dp_eval * pp * micro-batch, the eval layout's pipeline filled once, the regime of the planner's
calibration) with `cpkit.eval_cp.context.evaluate`:

- train: at the training collection, each rank running at least pp micro-batches (the pipeline
  filled as the planner counts it; extra ones are loss-masked filler);
- eval: inside `eval_cp_context(model, eval_pgs)` (the switch and restore are inside the timed
  region), same minimum.

Time is the median over `--iters` after `--warmup` (barrier before each, CUDA events), the
slowest rank's. Columns: both times, the measured speedup, the estimate of
`cpkit plan eval-cp` (cpkit.eval_cp.plan) for the same sizes, the eval loss difference between
the layouts and the context switch alone. Every cell runs in its own try/except. Prints a table
and writes JSON (bench-results/eval_cp.json).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from cpkit.bench.common import (
    add_common_args,
    append_profile,
    format_table,
    machine_info,
    median,
    parse_int_list,
    short_error,
    time_fn,
    write_json,
)

__all__ = ["main", "Settings", "parse_layout"]

NAME = "eval_cp"


@dataclass(frozen=True)
class Settings:
    """Everything a rank needs; picklable."""

    layouts: tuple
    seqs: tuple
    cp_train: int
    cp_eval: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    micro_batch_size: int
    eval_samples: Optional[int]
    dtype: str
    device: str
    warmup: int
    iters: int
    profile_path: Optional[str] = None


def parse_layout(text: str) -> tuple[int, int]:
    """"tp2pp1" -> (2, 1); raises ValueError otherwise."""
    m = re.fullmatch(r"tp(\d+)pp(\d+)", text.strip())
    if not m:
        raise ValueError(f"layout {text!r}: expected tp<N>pp<M>, e.g. tp1pp2")
    return int(m.group(1)), int(m.group(2))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench eval_cp",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=None,
                   help="comma-separated tp<N>pp<M> (default tp1pp2,tp2pp1; cpu: tp1pp1)")
    p.add_argument("--seq", type=parse_int_list, default=None, help="sequence lengths (default 1K,8K,16K)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 4; cpu: 2)")
    p.add_argument("--cp-train", type=int, default=1, help="CP size of training")
    p.add_argument("--cp-eval", type=int, default=2, help="CP size for evaluation")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; cpu: 64)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 8; cpu: 2)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 16; cpu: 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads, GQA (default heads/2)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32768; cpu: 128)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="validation set size (default dp_eval * pp * micro-batch)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 (cpu: fp32)")
    p.add_argument("--timeout", type=float, default=1800.0, help="launch timeout in seconds")
    add_common_args(p, warmup=3, iters=10, profile=True)
    return p


def _settings(args) -> Settings:
    cpu = args.device == "cpu"
    small = cpu or args.quick
    layouts = args.layouts or ("tp1pp1" if cpu else "tp1pp2,tp2pp1")
    seqs = args.seq or ([64, 128] if cpu else ([1024, 4096] if args.quick else [1024, 8192, 16384]))
    heads = args.heads or (8 if small else 16)
    return Settings(
        layouts=tuple(parse_layout(x) for x in layouts.split(",") if x.strip()),
        seqs=tuple(seqs),
        cp_train=args.cp_train,
        cp_eval=args.cp_eval,
        hidden=args.hidden or (64 if small else 2048),
        layers=args.layers or (2 if small else 8),
        heads=heads,
        kv_heads=args.kv_heads or max(1, heads // 2),
        vocab=args.vocab or (128 if small else 32768),
        micro_batch_size=args.micro_batch_size,
        eval_samples=args.eval_samples,
        dtype=args.dtype or ("fp32" if cpu else "bf16"),
        device=args.device,
        warmup=1 if args.quick else args.warmup,
        iters=3 if args.quick else args.iters,
        profile_path=args.profile,
    )


def _row(tp: int, pp: int, s: Settings) -> str:
    return f"tp{tp} pp{pp} cp{s.cp_train}->{s.cp_eval}"


# ------------------------------------------------------------------------------------ workers


def _groups(tp, pp, s: Settings, world: int):
    """The training layout and both collections of one table row (built once per row)."""
    from cpkit.eval_cp.context import build_eval_pg_collection
    from cpkit.parallel.groups import build_pg_collection
    from cpkit.parallel.layout import CPLayout

    layout = CPLayout(world_size=world, tp=tp, pp=pp, cp=s.cp_train, num_attention_heads=s.heads,
                      num_query_groups=s.kv_heads, eval_context_parallel_size=s.cp_eval).validate()
    train_pgs = build_pg_collection(layout)
    return layout, train_pgs, build_eval_pg_collection(layout, s.cp_eval, train_pgs=train_pgs)


def _cell(tp, pp, seq, s: Settings, groups, dev) -> dict:
    import torch.distributed as dist

    from cpkit.eval_cp.context import eval_cp_context, evaluate
    from cpkit.eval_cp.plan import plan_eval_cp
    from cpkit.attention.gpt import GPTConfig, build_gpt, make_batch

    dtype = torch.bfloat16 if s.dtype == "bf16" else torch.float32
    layout, train_pgs, eval_pgs = groups
    samples = s.eval_samples or layout.eval_layout().dp * pp * s.micro_batch_size
    plan = plan_eval_cp(world_size=layout.world_size, tp=tp, pp=pp, cp_train=s.cp_train, cp_eval=s.cp_eval,
                        eval_samples=samples, micro_batch_size=s.micro_batch_size, seq_length=seq,
                        num_layers=s.layers, hidden_size=s.hidden)
    cfg = GPTConfig(num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                    num_query_groups=s.kv_heads, vocab_size=s.vocab, seq_length=seq, dtype=dtype)
    model = build_gpt(cfg, train_pgs, attention="cpkit", device=dev)
    val = make_batch(cfg, batch_size=samples, seed=11)
    kw = dict(micro_batch_size=s.micro_batch_size, min_micro_batches=pp)
    out = {}

    def at_train():
        out["train"] = evaluate(model, val, train_pgs, **kw)

    def at_eval():
        with eval_cp_context(model, eval_pgs):
            out["eval"] = evaluate(model, val, eval_pgs, **kw)

    def switch_only():
        with eval_cp_context(model, eval_pgs):
            pass

    barrier = dist.barrier
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_train = median(time_fn(at_train, warmup=s.warmup, iters=s.iters, device=dev, barrier=barrier))
    mem_train = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_eval = median(time_fn(at_eval, warmup=s.warmup, iters=s.iters, device=dev, barrier=barrier))
    mem_eval = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    t_switch = median(time_fn(switch_only, warmup=1, iters=s.iters, device=dev))
    if s.profile_path:
        for name, fn in (("train", at_train), ("eval", at_eval)):
            append_profile(s.profile_path, fn, iters=2, device=dev,
                           title=f"{_row(tp, pp, s)} seq {seq}: {name} layout")
    slowest = torch.tensor([t_train, t_eval, t_switch], dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    t_train, t_eval, t_switch = slowest.tolist()
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tp": tp, "pp": pp, "seq": seq, "cp_train": s.cp_train, "cp_eval": s.cp_eval,
        "eval_samples": samples, "train_ms": t_train, "eval_ms": t_eval, "switch_ms": t_switch,
        "speedup": t_train / t_eval, "estimate": plan.speedup_estimate,
        "loss_train": out["train"].loss, "loss_eval": out["eval"].loss,
        "loss_delta": abs(out["train"].loss - out["eval"].loss),
        "peak_gib_train": mem_train, "peak_gib_eval": mem_eval, "warnings": plan.warnings,
    }


def _worker(s: Settings):
    import torch.distributed as dist

    from cpkit.process_device import device

    if s.device == "cpu":
        from cpkit.attention.gpt import prepare_cpu

        prepare_cpu()
    dev = device()
    world = dist.get_world_size()
    results = []
    for tp, pp in s.layouts:
        try:
            groups = _groups(tp, pp, s, world)
        except Exception as exc:  # noqa: BLE001 - e.g. a layout that does not fit the world
            results += [{"tp": tp, "pp": pp, "seq": seq, "error": short_error(exc)} for seq in s.seqs]
            continue
        for seq in s.seqs:
            try:
                results.append(_cell(tp, pp, seq, s, groups, dev))
            except Exception as exc:  # noqa: BLE001 - one failing cell must not hide the rest
                results.append({"tp": tp, "pp": pp, "seq": seq, "error": short_error(exc)})
    return results


# ------------------------------------------------------------------------------------ output


def render(results: list[dict], s: Settings) -> str:
    """The table: one row per layout and sequence length."""
    columns = ["train ms", "eval ms", "speedup", "estimate", "|dloss|", "switch ms", "peak GiB t/e"]
    rows, cells = [], {}
    for r in results:
        label = f"tp{r['tp']} pp{r['pp']} cp{s.cp_train}->{s.cp_eval} seq {r['seq']}"
        rows.append(label)
        if "error" in r:
            cells[(label, "train ms")] = r["error"]
            continue
        cells[(label, "train ms")] = f"{r['train_ms']:.2f}"
        cells[(label, "eval ms")] = f"{r['eval_ms']:.2f}"
        cells[(label, "speedup")] = f"{r['speedup']:.2f}x"
        cells[(label, "estimate")] = f"{r['estimate']:.2f}x"
        cells[(label, "|dloss|")] = f"{r['loss_delta']:.1e}"
        cells[(label, "switch ms")] = f"{r['switch_ms']:.3f}"
        if r["peak_gib_train"] is not None:
            cells[(label, "peak GiB t/e")] = f"{r['peak_gib_train']:.1f}/{r['peak_gib_eval']:.1f}"
    return format_table(rows, columns, cells, corner="layout")


def main(argv=None) -> int:
    """Run the benchmark; print the table; write JSON. Returns the process exit code."""
    from cpkit.harness.launch import RankFailure, launch

    args = _parser().parse_args(argv)
    try:
        s = _settings(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    world = args.world_size or (2 if args.device == "cpu" else 4)
    if args.device == "cuda" and torch.cuda.device_count() < world:
        print(f"error: --device cuda needs {world} GPUs, found {torch.cuda.device_count()} "
              "(use --device cpu --quick for a smoke run)", file=sys.stderr)
        return 2
    print(f"eval_cp bench: {len(s.layouts) * len(s.seqs)} cells on {world} ranks, {s.device}, {s.dtype}, "
          f"hidden {s.hidden} x {s.layers} layers, {s.heads}/{s.kv_heads} heads, "
          f"median of {s.iters} after {s.warmup} warm-ups", flush=True)
    failure = None
    try:
        results = launch(_worker, world, backend="nccl" if s.device == "cuda" else "gloo",
                         timeout=args.timeout, args=(s,))[0]
    except RankFailure as exc:
        failure, results = str(exc), []
    print(render(results, s))
    for r in results:
        for w in r.get("warnings", []):
            print(f"note (tp{r['tp']} pp{r['pp']} seq {r['seq']}): {w}")
    payload = {"bench": NAME, "machine": machine_info(), "settings": asdict(s), "world_size": world,
               "results": results, "failure": failure}
    path = write_json(NAME, payload, args.out)
    print(f"wrote {path}")
    if failure:
        print(f"error: the launch failed:\n{failure}", file=sys.stderr)
        return 1
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
