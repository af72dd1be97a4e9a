"""`python -m cpkit.bench hybrid`: a gated delta net layer's forward + backward under CP, measured.

For each sequence length (`--seq`, one sequence, b=1) and CP size `--cp`, times one GDN layer
(`src/cpkit/hybrid/gdn.py::GatedDeltaNet`: in_proj, conv, the rule, norm, out_proj; hidden
`--hidden`, `--heads` heads of `--head-dim`) forward and backward, median of `--iters` after
`--warmup`, on every rank at once:

- `one GPU`: the whole sequence on rank 0 (the others wait): the baseline;
- `chunkwise` and `headwise`: the layer at cp on this rank's tokens (contiguous rows);
- `transition`: one zigzag -> contiguous relayout of the layer's input [T/cp, hidden], forward
  and backward (`src/cpkit/hybrid/layout.py::relayout`): what a hybrid model pays per switch.

Reported per cell: ms per layer step (the slowest rank), tokens/s per GPU, and the ratios
`cp x / one GPU` (tokens/s of the cp GPUs together over one GPU's) and `transition / chunkwise`.
The rule runs on flash-linear-attention's kernels where installed (GPU), else cpkit's PyTorch
chunked form (`--kernel`). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from cpkit.bench.common import add_common_args, format_table, machine_info, median, short_error, time_fn, write_json

__all__ = ["main"]

NAME = "hybrid"
MODES = ("one GPU", "chunkwise", "headwise", "transition")


def _parse_seq(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        out.append(int(part[:-1]) * 1024 if part.endswith("K") else int(part))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m cpkit.bench {NAME}", allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2, help="CP size (one rank per GPU; default 2)")
    p.add_argument("--seq", default="32K,128K", help="sequence lengths, e.g. 32K,128K")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--kernel", default="auto", choices=("auto", "torch", "fla"), help="the rule's implementation")
    p.add_argument("--timeout", type=float, default=600.0, help="the launch's deadline (s)")
    add_common_args(p, warmup=2, iters=5)
    return p


def _cell(seq: int, mode: str, args) -> dict:
    """One rank's timing of one cell (every rank runs every cell; the collectives need them all)."""
    from cpkit.hybrid.gdn import GatedDeltaNet, GDNShape
    from cpkit.hybrid.layout import build_routes, relayout
    from cpkit.process_device import device as rank_device

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    group = dist.group.WORLD
    torch.manual_seed(0)
    layer = GatedDeltaNet(GDNShape(args.hidden, args.heads, args.head_dim, args.head_dim), dtype=dtype, device=device,
                          kernel=args.kernel)
    cu = [0, seq]
    if mode == "one GPU":
        tokens, grp = (seq if rank == 0 else 0), None
    else:
        tokens, grp = seq // world, group
    x = torch.randn(tokens, args.hidden, dtype=dtype, device=device, requires_grad=True)
    if mode == "transition":
        routes = build_routes(cu, rank, world, device)
        step = lambda: relayout(x, routes, "contiguous", group).sum().backward()  # noqa: E731
    elif mode == "one GPU" and rank != 0:
        step = lambda: None  # noqa: E731
    else:
        step = lambda: layer(x, cu, grp, mode=mode if grp is not None else "chunkwise").float().sum().backward()  # noqa: E731
    barrier = (lambda: dist.barrier(group=group)) if mode != "one GPU" else None
    times = time_fn(step, warmup=args.warmup, iters=args.iters, device=device, barrier=barrier)
    dist.barrier(group=group)
    return {"seq": seq, "mode": mode, "rank": rank, "ms": median(times), "tokens": tokens}


def _run(cells: list[tuple[int, str]], args) -> list[dict]:
    out = []
    for seq, mode in cells:
        try:
            out.append(_cell(seq, mode, args))
        except Exception as exc:  # one failed cell does not end the run: it holds its error
            out.append({"seq": seq, "mode": mode, "rank": dist.get_rank(), "error": short_error(exc)})
            dist.barrier()
    return out


def summarize(results: list[dict], world: int) -> dict[tuple[int, str], dict]:
    """(seq, mode) -> the slowest rank's ms, tokens/s per GPU, or its error."""
    cells: dict[tuple[int, str], dict] = {}
    for r in results:
        key = (r["seq"], r["mode"])
        cell = cells.setdefault(key, {"ms": 0.0, "tokens": 0, "error": None})
        if "error" in r:
            cell["error"] = r["error"]
            continue
        cell["ms"] = max(cell["ms"], r["ms"])
        cell["tokens"] = max(cell["tokens"], r["tokens"])
    for (seq, mode), cell in cells.items():
        if cell["error"] is None and cell["ms"] > 0 and mode != "transition":
            gpus = 1 if mode == "one GPU" else world
            cell["tokens_per_s_per_gpu"] = seq / gpus / (cell["ms"] / 1e3)
    return cells


def _label(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


def render(cells: dict, seqs: list[int], world: int) -> str:
    labels = list(MODES)
    cols = [_label(s) for s in seqs]
    table = {}
    for (seq, mode), cell in cells.items():
        col = _label(seq)
        table[(mode, col)] = cell["error"] or f"{cell['ms']:.2f} ms"
    for seq in seqs:
        col = _label(seq)
        one, chunk, head, move = (cells.get((seq, m), {}) for m in MODES)
        for mode, cell in (("chunkwise", chunk), ("headwise", head)):
            if cell.get("tokens_per_s_per_gpu") and one.get("tokens_per_s_per_gpu"):
                table[(f"cp{world} {mode} / one GPU (tokens/s)", col)] = \
                    f"{world * cell['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.3f}"
        if move.get("ms") and chunk.get("ms") and not move.get("error") and not chunk.get("error"):
            table[("transition / chunkwise layer", col)] = f"{move['ms'] / chunk['ms']:.3f}"
    labels += [f"cp{world} chunkwise / one GPU (tokens/s)", f"cp{world} headwise / one GPU (tokens/s)",
               "transition / chunkwise layer"]
    return format_table(labels, cols, table, corner="GDN layer fwd+bwd (slowest rank)")


def main(argv=None) -> int:
    from cpkit.harness.launch import RankFailure, launch

    args = _parser().parse_args(argv)
    if args.quick:
        args.device, args.seq, args.hidden, args.heads, args.head_dim = "cpu", "256", 64, 4, 16
        args.warmup, args.iters, args.dtype, args.kernel = 1, 2, "fp32", "torch"
    seqs = _parse_seq(args.seq)
    bad = [s for s in seqs if s % (2 * args.cp)]
    if bad:
        print(f"error: --seq {bad}: every length must be a multiple of 2 * cp = {2 * args.cp}", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < args.cp:
        print(f"error: --cp {args.cp} needs {args.cp} GPUs, found {torch.cuda.device_count()}; for a CPU smoke run "
              f"use `python -m cpkit.bench {NAME} --quick`", file=sys.stderr)
        return 2
    cells = [(s, m) for s in seqs for m in MODES]
    print(f"hybrid bench: GDN layer, {len(cells)} cells on {args.cp} rank(s), {args.device}, {args.dtype}, hidden "
          f"{args.hidden}, {args.heads} heads x {args.head_dim}, kernel {args.kernel}", flush=True)
    failure = None
    try:
        results = [r for rank in launch(_run, args.cp, backend="nccl" if args.device == "cuda" else "gloo",
                                        timeout=args.timeout, args=(cells, args)) for r in rank]
    except RankFailure as exc:
        failure, results = str(exc), []
    summary = summarize(results, args.cp)
    print(render(summary, seqs, args.cp))
    from cpkit.hybrid.delta_rule import fla_refusal

    fla_why = fla_refusal(torch.device(args.device)) if args.kernel != "torch" else "--kernel torch"
    print(f"the rule ran on: {'fla' if fla_why is None else 'cpkit PyTorch chunked form (' + fla_why + ')'}")
    payload = {"bench": NAME, "machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "out"},
               "rule_kernel": "fla" if fla_why is None else "torch", "fla_refusal": fla_why, "results": results,
               "failure": failure,
               "cells": [{"seq": s, "mode": m, **c} for (s, m), c in summary.items()]}
    path = write_json(NAME, payload, args.out)
    print(f"wrote {path}")
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
