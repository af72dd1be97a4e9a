"""`python -m cpkit.bench.timeline TRACE...`: where a profiled GPU timeline is not computing.

Reads Chrome traces written by `--profile` (`<file>.<cell>.rank<r>.trace.json`) and splits the
span from the first kernel to the last into: compute (any non-communication kernel running),
exposed communication (only NCCL kernels running) and idle (nothing running, e.g. the host or
a wait is late). Kernel-time tables cannot show this: an NCCL kernel hidden under attention and
one that the attention waits for look the same there.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

__all__ = ["Timeline", "summarize", "main"]


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench.timeline", description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files (from --profile)")
    args = p.parse_args(argv)
    for path in args.traces:
        try:
            with open(path, encoding="utf-8") as fh:
                trace = json.load(fh)
        except OSError as err:
            p.error(f"{path}: {err.strerror} (a Chrome trace written by --profile)")
        except json.JSONDecodeError as err:
            p.error(f"{path}: not a JSON trace ({err.msg} at line {err.lineno})")
        print(f"{path}: {summarize(trace).line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
