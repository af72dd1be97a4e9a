"""`python -m cpkit.bench attention`: CP attention forward + backward throughput.

One launch over max(--cp) ranks (NCCL, one GPU per rank; or gloo with `--device cpu`) times,
for each total sequence length, attention forward + backward with b=1, causal and dense by
default; `--features` adds sliding windows, sinks and MLA head dims to the cpkit and TE cells
(`attention_features.py`; TE's refusal of a feature on a comm type is that cell's error):

- `cpkit`: `cpkit.attention.context_parallel_attention` for every comm type and CP size
  (`a2a+p2p` with a2a groups of `--hcp-a2a` contiguous ranks, where both levels are > 1);
- `te`: Transformer Engine's `DotProductAttention` with `set_context_parallel_group`-style
  construction for the same comm types (when TE imports);
- `torch`: torch's experimental `context_parallel` (allgather rotation) over a DeviceMesh of
  the CP ranks;
- `sdpa`: single-device SDPA (cuDNN on GPUs) on the full sequence, the per-GPU reference.

TFLOP/s per GPU = 3.5 * (2 * b * heads * s^2 * head_dim) / cp / time for the dense cells (causal
forward FLOPs, x3.5 for forward + backward; a feature's cells count the pairs and head dims it
attends, `attention_features.fwd_bwd_flops`). Time is the median over `--iters` iterations after `--warmup`
(CUDA events, barrier before each), the slowest rank's median. Every cell runs in its own
try/except: a failure prints "error: ..." in its cell. Prints a table with the cpkit/TE and
/sdpa ratios (`cpkit.bench.attention.attention_table`), writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from cpkit.bench.attention.attention_features import FEATURES, feature, fwd_bwd_flops
from cpkit.bench.attention.attention_steps import TorchCP, step_cpkit, step_sdpa, step_te
from cpkit.bench.attention.attention_table import render, row_label
from cpkit.bench.common import (
    DEFAULT_RESULTS_DIR,
    add_common_args,
    append_profile,
    machine_info,
    median,
    parse_int_list,
    parse_str_list,
    short_error,
    time_fn,
    write_json,
)
from cpkit.parallel.layout import A2A_P2P, CP_COMM_TYPES

__all__ = ["main", "Case", "Settings", "causal_fwd_bwd_flops", "build_cases", "render", "run_cells"]

NAME = "attention"
COMM_TYPES = CP_COMM_TYPES
BACKENDS = ("cpkit", "te", "torch", "sdpa")


@dataclass(frozen=True)
class Case:
    """One cell of the table: a backend, comm type, KV heads, CP size and total sequence."""

    backend: str
    comm: str  # "-" for sdpa / torch
    kv_heads: int
    cp: int
    seq: int
    feature: str = "dense"  # `attention_features.FEATURES`; sdpa and torch run dense only

    @property
    def row(self) -> str:
        return row_label(asdict(self))


@dataclass
class Settings:
    heads: int
    head_dim: int
    batch: int
    dtype: str
    device: str
    warmup: int
    iters: int
    hcp_a2a: int
    window: int = 4096  # keys on a side of the window features
    partial_path: Optional[str] = None
    profile_path: Optional[str] = None
    world_size: int = 1
    notes: list = field(default_factory=list)


def causal_fwd_bwd_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention: 3.5 * 2 * b * h * s^2 * d."""
    return 3.5 * 2.0 * batch * heads * float(seq) ** 2 * head_dim


def build_cases(backends, comms, kv_heads, cps, seqs, hcp_a2a: int, te_ok: bool,
                features=("dense",)) -> list[Case]:
    """The ordered list of cells to run (sdpa first: it is the reference); cpkit and TE run
    every feature, sdpa and torch the dense cells only."""
    cases = []
    for kvh in kv_heads:
        for seq in seqs:
            if "sdpa" in backends and "dense" in features:
                cases.append(Case("sdpa", "-", kvh, 1, seq))
    for cp in cps:
        for kvh in kv_heads:
            for comm in comms:
                if comm == A2A_P2P and not (1 < hcp_a2a < cp and cp % hcp_a2a == 0):
                    continue  # a degenerate hierarchy is plain a2a or p2p
                for feat in features:
                    for backend in ("cpkit", "te"):
                        if backend in backends and (backend != "te" or te_ok):
                            for seq in seqs:
                                cases.append(Case(backend, comm, kvh, cp, seq, feat))
            if "torch" in backends and "dense" in features:
                for seq in seqs:
                    cases.append(Case("torch", "-", kvh, cp, seq))
    return cases


def dropped_cells(comms, cps, hcp_a2a: int) -> list[str]:
    """Why a requested comm type has no row at a cp (build_cases leaves it out): one line each."""
    out = []
    for cp in cps:
        if A2A_P2P not in comms or (1 < hcp_a2a < cp and cp % hcp_a2a == 0):
            continue
        if cp % hcp_a2a:
            why = f"--hcp-a2a {hcp_a2a} does not divide cp {cp}"
        else:  # one level of size 1: the hierarchy is plain a2a (p2p level 1) or plain p2p (a2a level 1)
            level, plain = ("p2p", "a2a") if hcp_a2a >= cp else ("a2a", "p2p")
            why = f"--hcp-a2a {hcp_a2a} at cp {cp} leaves a {level} level of 1, which is plain {plain} (its own row)"
        out.append(f"no {A2A_P2P} row at cp {cp}: {A2A_P2P} needs two levels > 1 and {why}; at cp 4, --hcp-a2a 2 is [2, 2]")
    return out


# ------------------------------------------------------------------------------------ workers


def _make_groups(cps, hcp_a2a: int) -> dict:
    """Every group any case needs, created by every rank in the same order.

    CP size c uses ranks 0..c-1; its hierarchical groups are a2a = contiguous blocks of
    `hcp_a2a` ranks, p2p = ranks with the same position in their block (TE's convention).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = {}
    for cp in sorted(set(cps)):
        g = dist.new_group(list(range(cp)))
        groups[("cp", cp)] = g if rank < cp else None
        if 1 < hcp_a2a < cp and cp % hcp_a2a == 0:
            mine = [None, None]
            for start in range(0, cp, hcp_a2a):
                ranks = list(range(start, start + hcp_a2a))
                ga = dist.new_group(ranks)
                if rank in ranks:
                    mine[0] = ga
            for offset in range(hcp_a2a):
                ranks = list(range(offset, cp, hcp_a2a))
                gp = dist.new_group(ranks)
                if rank in ranks:
                    mine[1] = gp
            groups[("hcp", cp)] = mine if rank < cp else None
    return groups


def _time_case(case: Case, s: Settings, dev, groups) -> tuple[float, Optional[str]]:
    """(median ms on this rank, None) or (nan, error text); runs only on the case's ranks."""
    import torch.distributed as dist

    cp_group = groups.get(("cp", case.cp))
    barrier = (lambda: dist.barrier(group=cp_group)) if case.cp > 1 else None

    def run(step):
        ms = median(time_fn(step, warmup=s.warmup, iters=s.iters, device=dev, barrier=barrier))
        if s.profile_path:
            append_profile(s.profile_path, step, iters=3, device=dev, title=f"{case.row} seq {case.seq}")
        return ms

    try:
        if case.backend == "cpkit":
            return run(step_cpkit(case, s, dev, groups)), None
        if case.backend == "te":
            return run(step_te(case, s, dev, groups)), None
        # sdpa / torch: native GQA first; expanded KV heads when the kernel refuses GQA.
        last = None
        for expand in ([False, True] if case.kv_heads != s.heads else [False]):
            try:
                if case.backend == "sdpa":
                    ms = run(step_sdpa(case, s, dev, groups, expand))
                else:
                    with TorchCP(case, s, dev, groups, expand) as step:
                        ms = run(step)
                return ms, ("note: kv heads expanded" if expand else None)
            except Exception as exc:  # noqa: BLE001 - retried once with expanded KV
                last = exc
        raise last
    except Exception as exc:  # noqa: BLE001 - one bad cell must not end the run
        return float("nan"), f"{short_error(exc)}\n{traceback.format_exc()}"
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def run_cells(cases: list, settings: Settings) -> Optional[list]:
    """Time every cell on the ranks of an initialized process group (this launch's, or a
    torchrun job's): every rank calls it with the same cells; a cell uses ranks 0..cp-1 (SDPA
    rank 0). Returns one result dict per cell on rank 0 (errors in its "error"), None elsewhere."""
    import torch.distributed as dist

    from cpkit.process_device import device

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    if any(c.backend == "te" for c in cases):
        # TE must load cuDNN before torch's first cuDNN call: imported after it, TE 2.20.2 pulled
        # the system's libcudnn_cnn.so.9 next to torch's and every TE cell failed (4x H200).
        from cpkit.attention.te import te_available

        te_available()
    groups = _make_groups([c.cp for c in cases], settings.hcp_a2a)
    results = []
    for case in cases:
        torch.manual_seed(1234 + rank)
        if case.backend == "sdpa":
            mine = _time_case(case, settings, dev, groups) if rank == 0 else None
        else:
            mine = _time_case(case, settings, dev, groups) if rank < case.cp else None
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)  # also keeps the ranks in step between cases
        if rank == 0:
            results.append(_summarize(case, settings, [g for g in gathered if g is not None]))
            if settings.partial_path:
                with open(settings.partial_path, "a") as fh:
                    fh.write(json.dumps(results[-1]) + "\n")
    return results if rank == 0 else None


def _summarize(case: Case, s: Settings, per_rank: list) -> dict:
    errors = [e for _, e in per_rank if e and not e.startswith("note:")]
    notes = sorted({e for _, e in per_rank if e and e.startswith("note:")})
    entry = asdict(case) | {"heads": s.heads, "head_dim": s.head_dim, "batch": s.batch,
                            "dtype": s.dtype, "ms": None, "tflops_per_gpu": None,
                            "error": None, "notes": notes}
    entry["kv_heads"] = feature(case.feature, s.window).kv_heads(s.heads, case.kv_heads)  # MLA: heads
    if errors:
        entry["error"] = errors[0]
        return entry
    ms = max(m for m, _ in per_rank)  # the slowest rank sets the pace
    entry["ms"] = ms
    flops = fwd_bwd_flops(s.batch, s.heads, case.seq, s.head_dim, feature(case.feature, s.window))
    entry["tflops_per_gpu"] = flops / case.cp / (ms * 1e-3) / 1e12
    return entry


# ------------------------------------------------------------------------------------- driver


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpkit.bench attention", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--seq", default=None, help="total sequence lengths, e.g. 32768,65536 or 32K,64K")
    p.add_argument("--cp", default=None, help="CP sizes, e.g. 2,4")
    p.add_argument("--comm", default=",".join(COMM_TYPES), help="comm types (p2p,all_gather,a2a,a2a+p2p)")
    p.add_argument("--kv-heads", default=None, help="KV head counts, e.g. 8,32")
    p.add_argument("--backends", default=None, help="cpkit,te,torch,sdpa (te skipped without TE)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; 4 on cpu)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; 16 on cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--features", default="dense",
                   help=f"model features of the cpkit and TE cells ({','.join(FEATURES)}; default dense)")
    p.add_argument("--window", type=int, default=4096, help="keys on a side of the window features (default 4096)")
    p.add_argument("--hcp-a2a", type=int, default=2, help="a2a group size for a2a+p2p (default 2: [2,2] at cp=4)")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole launch")
    add_common_args(p, profile=True)
    return p


def _defaults(args) -> None:
    cpu = args.device == "cpu"
    pick = lambda value, gpu, gpu_quick, cpu_value: value if value is not None else (  # noqa: E731
        cpu_value if cpu else (gpu_quick if args.quick else gpu))
    args.seq = parse_int_list(pick(args.seq, "32768,65536,131072", "32768", "256" if args.quick else "1024"))
    args.cp = parse_int_list(pick(args.cp, "2,4", "4", "2"))
    args.kv_heads = parse_int_list(pick(args.kv_heads, "8,32", "8", "2" if args.quick else "2,4"))
    args.backends = parse_str_list(pick(args.backends, "cpkit,te,torch,sdpa", "cpkit,te,torch,sdpa", "cpkit,sdpa"))
    args.comm = parse_str_list(args.comm)
    args.features = parse_str_list(args.features)
    args.heads = args.heads or (4 if cpu else 32)
    args.head_dim = args.head_dim or (16 if cpu else 128)
    args.dtype = args.dtype or ("fp32" if cpu else "bf16")
    if args.quick:
        args.warmup, args.iters = min(args.warmup, 1 if cpu else 2), min(args.iters, 2 if cpu else 5)
    args.timeout = args.timeout or (300.0 if cpu else 3600.0)


def _check_args(args) -> Optional[str]:
    bad = [c for c in args.comm if c not in COMM_TYPES]
    if bad:
        return f"--comm {bad}: each must be one of {list(COMM_TYPES)}"
    bad = [f for f in args.features if f not in FEATURES]
    if bad:
        return f"--features {bad}: each must be one of {list(FEATURES)}"
    if args.window < 1:
        return f"--window {args.window}: must be >= 1 (keys on a side of the window)"
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        return f"--backends {bad}: each must be one of {list(BACKENDS)}"
    if any(c < 1 for c in args.cp):
        return f"--cp {args.cp}: CP sizes must be >= 1"
    odd = [s for s in args.seq for c in args.cp if s % (2 * c)]
    if odd:
        return f"--seq {sorted(set(odd))}: every length must be divisible by 2 * cp for each --cp {args.cp}"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return ("no CUDA device: this benchmark needs one GPU per CP rank; "
                    "for a CPU smoke run use `python -m cpkit.bench attention --device cpu --quick`")
        if torch.cuda.device_count() < max(args.cp):
            return f"--cp {args.cp} needs {max(args.cp)} GPUs, found {torch.cuda.device_count()}"
    return None


def main(argv=None) -> int:
    """Run the benchmark; print the table; write JSON. Returns the process exit code."""
    from cpkit.attention.te import te_available
    from cpkit.harness.launch import RankFailure, launch

    args = _parser().parse_args(argv)
    _defaults(args)
    problem = _check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    te_ok = "te" in args.backends and args.device == "cuda" and te_available()
    if "te" in args.backends and not te_ok:
        print("note: te backend skipped (Transformer Engine not importable, or --device cpu)")
    cases = build_cases(args.backends, args.comm, args.kv_heads, args.cp, args.seq, args.hcp_a2a, te_ok,
                        args.features)
    for line in dropped_cells(args.comm, args.cp, args.hcp_a2a):
        print(f"note: {line}")
    world = max([c.cp for c in cases] + [1])
    out_path = Path(args.out) if args.out else Path(DEFAULT_RESULTS_DIR) / f"{NAME}.json"
    partial = out_path.with_suffix(".partial.jsonl")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)
    settings = Settings(
        heads=args.heads, head_dim=args.head_dim, batch=1, dtype=args.dtype, device=args.device,
        warmup=args.warmup, iters=args.iters, hcp_a2a=args.hcp_a2a, window=args.window,
        partial_path=str(partial), profile_path=args.profile, world_size=world,
    )
    print(f"attention bench: {len(cases)} cells on {world} rank(s), {args.device}, {args.dtype}, "
          f"heads={args.heads} head_dim={args.head_dim} b=1 fwd+bwd, features {','.join(args.features)}"
          f"{f' (window {args.window})' if any(f.startswith('window') for f in args.features) else ''}", flush=True)
    failure = None
    try:
        results = launch(
            run_cells, world, backend="nccl" if args.device == "cuda" else "gloo",
            timeout=args.timeout, args=(cases, settings),
        )[0]
    except RankFailure as exc:  # keep what finished; name what did not
        failure = str(exc)
        results = [json.loads(line) for line in partial.read_text().splitlines()] if partial.exists() else []
    partial.unlink(missing_ok=True)
    print(render(results, args.seq, args.device))
    payload = {
        "bench": NAME,
        "machine": machine_info(),
        "settings": {k: v for k, v in asdict(settings).items()
                     if k not in ("partial_path", "profile_path", "notes")},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "flops": "fwd+bwd = 3.5 * 2*b*h*pairs*(d_qk + d_v), pairs = s^2/2 causal (attention_features); per GPU = total / cp",
        "results": results,
        "failure": failure,
    }
    path = write_json(NAME, payload, str(out_path))
    print(f"wrote {path}")
    if failure:
        print(f"error: the launch failed after {len(results)} of {len(cases)} cells:\n{failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
