"""`python -m cpkit.bench.timeline TRACE...`: where a profiled GPU timeline is not computing.

Reads Chrome traces written by `--profile` (`<file>.<cell>.rank<r>.trace.json`) and splits the
span from the first kernel to the last into: compute (any non-communication kernel running),
exposed communication (only NCCL kernels running) and idle (nothing running, e.g. the host or
a wait is late). Kernel-time tables cannot show this: an NCCL kernel hidden under attention and
one that the attention waits for look the same there.

`--kernels` adds where the kernel time goes, per iteration (`--iters`, 3 for `--profile`'s
traces): attention forward and backward kernels, the attention library's helper kernels,
communication, and everything else (merges, casts, copies, layout changes), with the largest of
those named. That is the split that compares cpkit with TE on the same cell: same attention
kernels, different everything else.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

__all__ = ["Timeline", "summarize", "kernel_split", "main"]


@dataclass(frozen=True)
class Timeline:
    span_ms: float
    compute_ms: float
    exposed_comm_ms: float
    idle_ms: float
    comm_ms: float  # sum over communication kernels, hidden or not
    kernels: int

    def line(self) -> str:
        return (f"span {self.span_ms:.2f} ms: compute {self.compute_ms:.2f}, exposed comm "
                f"{self.exposed_comm_ms:.2f}, idle {self.idle_ms:.2f} (comm kernels {self.comm_ms:.2f} "
                f"in all, {self.kernels} kernels)")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def _is_comm(name: str) -> bool:
    return name.startswith("nccl") or "Nccl" in name or "nvshmem" in name


def summarize(trace: dict) -> Timeline:
    """The compute / exposed communication / idle split of one Chrome trace (times in us)."""
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return Timeline(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    comm = [s for s, e in zip(spans, kernels) if _is_comm(e.get("name", ""))]
    compute = [s for s, e in zip(spans, kernels) if not _is_comm(e.get("name", ""))]
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3
    busy, compute_ms = _union_ms(spans), _union_ms(compute)
    return Timeline(span, compute_ms, busy - compute_ms, span - busy,
                    sum(b - a for a, b in comm) / 1e3, len(kernels))


def _kind(name: str) -> str:
    low = name.lower()
    if _is_comm(name):
        return "comm"
    if "fprop" in low or ("flash" in low and "fwd" in low):
        return "attn fwd"
    if "bprop" in low or ("flash" in low and "bwd" in low):
        return "attn bwd"
    if "cudnn" in low or "fmha" in low:
        return "attn helpers"
    return "other"


_GENERIC = {"elementwise_kernel", "unrolled_elementwise_kernel", "vectorized_elementwise_kernel",
            "gpu_kernel_impl", "gpu_kernel_impl_nocast", "native"}


def _short(name: str) -> str:
    """A kernel's name without its template arguments, with the op it runs: an ATen elementwise
    kernel is `outer[op]` (`vectorized_elementwise_kernel[CUDAFunctor_add]`)."""
    outer = name.removeprefix("void ").split("<")[0].split("(")[0].strip().split("::")[-1] or name[:40]
    ops = [m for m in re.findall(r"native::(?:\(anonymous namespace\)::)?([A-Za-z_0-9]+)", name)
           if m not in _GENERIC and m != outer]
    return f"{outer}[{ops[0]}]" if ops else outer


def kernel_split(trace: dict, iters: int = 1, top: int = 4) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """({kind: ms per iteration}, the `top` largest "other" kernels as (name, ms per iteration))."""
    split: dict[str, float] = {k: 0.0 for k in ("attn fwd", "attn bwd", "attn helpers", "comm", "other")}
    others: dict[str, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, ms = e.get("name", ""), float(e.get("dur", 0)) / 1e3 / iters
        kind = _kind(name)
        split[kind] += ms
        if kind == "other":
            others[_short(name)] = others.get(_short(name), 0.0) + ms
    return split, sorted(others.items(), key=lambda kv: -kv[1])[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench.timeline", description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files (from --profile)")
    p.add_argument("--kernels", action="store_true", help="also the kernel time per kind, per iteration")
    p.add_argument("--iters", type=int, default=3, help="iterations in each trace (default 3, --profile's)")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters {args.iters}: must be >= 1 (the iterations each trace holds)")
    for path in args.traces:
        try:
            with open(path, encoding="utf-8") as fh:
                trace = json.load(fh)
        except OSError as err:
            p.error(f"{path}: {err.strerror} (a Chrome trace written by --profile)")
        except json.JSONDecodeError as err:
            p.error(f"{path}: not a JSON trace ({err.msg} at line {err.lineno})")
        print(f"{path}: {summarize(trace).line()}")
        if args.kernels:
            split, others = kernel_split(trace, args.iters)
            print("  per iteration (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
            print("  largest other: " + "; ".join(f"{n} {v:.2f}" for n, v in others))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
