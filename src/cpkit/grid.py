"""Grids of cases on persistent rank pools: `run_cases(fn, cases, world_size)` runs every case on
the process's pool for that backend and world size (cpkit.rank_pool), started once and reused by
every grid, and returns one CaseResult per case.

On a GPU host the NCCL pools of one world size sit on disjoint GPU slices (two 2-GPU pools on 4
GPUs, four on 8), and `PoolSet.prefetch` runs known grids in background threads, a slice each,
smaller world sizes first, so a test that asks for its grid finds it done or running.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from cpkit.gpu_claim import cuda_device_count, visible_gpu_ids
from cpkit.launch_times import record_grid_times
from cpkit.rank_pool import PoolStartError, RankPool, function_ref

__all__ = ["CaseFailed", "CaseResult", "GridSpec", "PoolSet", "case_id_of", "default_pools", "run_cases"]


class CaseFailed(RuntimeError):
    """A case failed for a reason other than its own assertion: a rank raised another exception
    (a config error, an upstream crash), died, hung, leaked, or the case did not run. Never an
    AssertionError, so a strict xfail that expects a wrong result does not accept it."""


@dataclass
class CaseResult:
    """The outcome of one case on every rank: return values, or failures with tracebacks."""

    case_id: str
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    assertion_ranks: set[int] = field(default_factory=set)
    skip_reason: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def check(self) -> "CaseResult":
        """Return self when every rank passed; pytest.skip when every rank skipped; raise
        AssertionError when the failures are the case's own assertions on every failing rank,
        else CaseFailed; both carry each failing rank's traceback."""
        if self.errors:
            parts = [f"case {self.case_id} failed on rank(s) {sorted(self.errors)}"]
            parts += [f"--- rank {r} ---\n{tb}" for r, tb in sorted(self.errors.items())]
            kind = AssertionError if set(self.errors) <= self.assertion_ranks else CaseFailed
            raise kind("\n".join(parts))
        if self.skip_reason is not None:
            import pytest

            pytest.skip(self.skip_reason)
        return self


def case_id_of(case: Any) -> str:
    """A case's id: the "id" key of a dict case, else str(case)."""
    if isinstance(case, dict) and "id" in case:
        return str(case["id"])
    return str(case)


@dataclass(frozen=True)
class GridSpec:
    """A grid to run: scenario, its cases, backend, world size and deadline. `test_id`: the test
    a recorded coverage map credits the cases to (a prefetched grid runs in a background thread
    while some other test is current); None: the test current when the grid runs."""

    fn: Callable[[Any], Any]
    cases: tuple
    backend: str
    world_size: int
    timeout: float = 600.0
    test_id: str | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple:
        return (function_ref(self.fn), self.backend, self.world_size, tuple(case_id_of(c) for c in self.cases))


class PoolSet:
    """The rank pools of one process, one per (backend, world size, GPU slice), started on first
    use and closed at exit. `gpu_ids`: the GPUs NCCL pools may use (default: all visible)."""

    def __init__(self, gpu_ids: list[str] | None = None):
        self._gpu_ids = gpu_ids
        self._pools: dict[tuple, RankPool] = {}
        self._locks: dict[tuple, threading.Lock] = {}
        self._futures: dict[tuple, Future] = {}
        self._mutex = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def gpu_ids(self) -> list[str]:
        if self._gpu_ids is None:
            self._gpu_ids = visible_gpu_ids(cuda_device_count())
        return self._gpu_ids

    def slices(self, backend: str, world_size: int) -> list[str | None]:
        """The disjoint GPU slices (comma-joined ids) a pool of this size may take; [None] for gloo."""
        if backend != "nccl":
            return [None]
        ids = self.gpu_ids
        if len(ids) < world_size:
            raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs; this process sees {len(ids)}")
        return [",".join(ids[i:i + world_size]) for i in range(0, len(ids) - world_size + 1, world_size)]

    def pool(self, backend: str, world_size: int, gpu_slice: str | None = None) -> tuple[RankPool, threading.Lock]:
        key = (backend, world_size, gpu_slice)
        with self._mutex:
            if key not in self._pools:
                threads = 1 if backend == "gloo" else max(1, (os.cpu_count() or 1) // max(len(self.gpu_ids), 1))
                self._pools[key] = RankPool(world_size, backend, gpu_ids=gpu_slice, threads=threads)
                self._locks[key] = threading.Lock()
            return self._pools[key], self._locks[key]

    def run_grid(self, spec: GridSpec, gpu_slice: str | None = None) -> dict[str, CaseResult]:
        """Run every case of `spec` in order on one pool; a failure ends only its own case."""
        if gpu_slice is None and spec.backend == "nccl":
            gpu_slice = self.slices(spec.backend, spec.world_size)[0]
        pool, lock = self.pool(spec.backend, spec.world_size, gpu_slice)
        ids = [case_id_of(c) for c in spec.cases]
        if len(set(ids)) != len(ids):
            raise ValueError(f"case ids must be unique, got {ids}")
        results = {cid: CaseResult(cid) for cid in ids}
        with lock:
            started = time.monotonic()  # the grid's own wall: not the wait for its pool
            deadline = started + spec.timeout
            for cid, case in zip(ids, spec.cases):
                left = deadline - time.monotonic()
                if left <= 0:
                    results[cid].errors = {r: f"not run: the grid's {spec.timeout:.0f} s deadline passed before "
                                              f"case {cid}" for r in range(spec.world_size)}
                    continue
                try:
                    run = pool.run(spec.fn, case, left, test_id=spec.test_id)
                except PoolStartError as exc:  # this case fails; the next one tries a fresh start
                    results[cid].errors = {r: str(exc) for r in range(spec.world_size)}
                    continue
                _fill(results[cid], run, spec.world_size)
        record_grid_times(spec.fn, spec.backend, spec.world_size, results, started)
        return results

    # -- background scheduling ---------------------------------------------------------------
    def prefetch(self, specs: Iterable[GridSpec]) -> None:
        """Run `specs` in the background: per world size (smallest first), one thread per GPU
        slice takes grids from a shared queue. `result()` waits for a prefetched grid."""
        by_size: dict[int, list[GridSpec]] = {}
        with self._mutex:
            for spec in specs:
                if spec.key not in self._futures:
                    self._futures[spec.key] = Future()
                    by_size.setdefault(spec.world_size, []).append(spec)
        if by_size:
            thread = threading.Thread(target=self._run_phases, args=(by_size,), name="cpkit-grid-prefetch",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run_phases(self, by_size: dict[int, list[GridSpec]]) -> None:
        for world_size in sorted(by_size):
            todo: queue.Queue = queue.Queue()
            for spec in by_size[world_size]:
                todo.put(spec)
            backend = by_size[world_size][0].backend
            try:
                slices = self.slices(backend, world_size)
            except RuntimeError as exc:
                for spec in by_size[world_size]:
                    self._futures[spec.key].set_exception(exc)
                continue
            workers = [threading.Thread(target=self._drain, args=(todo, s), daemon=True) for s in slices]
            for w in workers:
                w.start()
            for w in workers:
                w.join()

    def _drain(self, todo: queue.Queue, gpu_slice: str | None) -> None:
        while True:
            try:
                spec = todo.get_nowait()
            except queue.Empty:
                return
            future = self._futures[spec.key]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.run_grid(spec, gpu_slice))
            except BaseException as exc:  # noqa: BLE001 - delivered to the test that asks
                future.set_exception(exc)

    def result(self, spec: GridSpec) -> dict[str, CaseResult]:
        """The grid's results: a prefetched grid's (waiting for it), else run now."""
        with self._mutex:
            future = self._futures.get(spec.key)
            if future is None:
                future = self._futures[spec.key] = Future()
                future.set_running_or_notify_cancel()
                mine = True
            else:
                mine = False
        if mine:
            try:
                future.set_result(self.run_grid(spec))
            except BaseException as exc:  # noqa: BLE001
                future.set_exception(exc)
        return future.result()

    def close(self) -> None:
        """Close every pool (bounded: each is killed after a few seconds)."""
        with self._mutex:
            for future in self._futures.values():
                future.cancel()
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()

    def stats(self) -> list[dict]:
        """Per pool: starts (1 + respawns), cases run and start-up seconds."""
        return [dict(backend=p.backend, world_size=p.world_size, gpus=p.gpu_ids, starts=p.starts, cases=p.seq,
                     start_s=round(p.start_seconds, 2)) for p in self._pools.values() if p.starts]


def _fill(result: CaseResult, run, world_size: int) -> None:
    result.values, result.errors, result.seconds = run.values, dict(run.errors), run.seconds
    result.assertion_ranks = set(run.assertion_ranks)
    if run.skipped and len(run.skipped) == world_size:
        result.skip_reason = next(iter(run.skipped.values()))
    elif run.skipped:
        for r, reason in run.skipped.items():
            result.errors[r] = (f"skipped on rank(s) {sorted(run.skipped)} only ({reason}); a case must skip on "
                                f"every rank or none: decide skips before the ranks diverge")


_default: PoolSet | None = None


def default_pools() -> PoolSet:
    """This process's PoolSet (closed at exit)."""
    global _default
    if _default is None:
        _default = PoolSet()
        atexit.register(_default.close)
    return _default


def run_cases(fn: Callable[[Any], Any], cases: Iterable[Any], world_size: int, *, backend: str = "gloo",
              timeout: float = 300.0, pg_timeout: float | None = None, pools: PoolSet | None = None
              ) -> dict[str, CaseResult]:
    """Run `fn(case)` for every case, in order, on this process's pool of `world_size` ranks.

    `fn` must be importable (module level): cases travel by name. Each case gets RNG seeded the
    same way and a clean slate (cpkit.rank_worker); exceptions are caught per case and rank. A
    case that fails on some ranks while the others finish fails alone; a rank that dies or hangs,
    or ranks stuck after another failed, fail that case with every rank's account, and the next
    case gets a fresh pool. `timeout` bounds the whole grid. `pg_timeout` is accepted for
    compatibility; pooled ranks use their pool's collective timeout. Returns {case_id: CaseResult}.
    """
    del pg_timeout
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
    spec = GridSpec(fn, tuple(cases), backend, world_size, timeout)
    return (pools or default_pools()).run_grid(spec)
