"""The timing table of multi-rank runs: with CPKIT_CASE_TIMES=<file>, cpkit.harness.launch appends one
JSON line per GPU claim wait, per case and per grid (wall time against the cases' own time: the
rest is start-up: spawning, imports, CUDA and NCCL initialization). scripts/gpu-suites.sh sets it,
so that a slow tier shows which case, which grid's start-up or which wait for GPUs costs what."""

from __future__ import annotations

import json
import os
import time
import warnings

__all__ = ["TIMES_ENV", "record_times", "record_grid_times"]

TIMES_ENV = "CPKIT_CASE_TIMES"


def record_times(entries) -> None:
    """Append `entries` (dicts) as JSON lines to $CPKIT_CASE_TIMES, where it is set."""
    path = os.environ.get(TIMES_ENV)
    if not path:
        return
    try:  # a timing log never fails the run it times
        with open(path, "a") as fh:
            fh.write("".join(json.dumps(e) + "\n" for e in entries))
    except OSError as exc:
        warnings.warn(f"cpkit: {TIMES_ENV}={path!r} cannot be written ({exc}); the timing table is incomplete")


def record_grid_times(fn, backend: str, world_size: int, results: dict, started: float) -> None:
    """One line per case of a run_cases grid (its slowest rank's seconds) and one for the grid:
    wall_s since `started` (time.monotonic()) and cases_s, the sum of its cases."""
    grid = dict(grid=f"{fn.__module__}.{getattr(fn, '__qualname__', fn)}", backend=backend, world_size=world_size)
    cases_s = sum(r.seconds for r in results.values())
    wall, t1 = time.monotonic() - started, time.time()  # t0/t1: epoch seconds, to line up stages run side by side
    record_times([dict(grid, case=r.case_id, seconds=round(r.seconds, 3), ok=r.ok,
                       **({"compiled": r.compiled, "cached": getattr(r, "cached", 0)} if getattr(r, "compiled", 0) else {}))
                  for r in results.values()]
                 + [dict(grid, wall_s=round(wall, 2), cases_s=round(cases_s, 2), t0=round(t1 - wall, 2), t1=round(t1, 2))])
