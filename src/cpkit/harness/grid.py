"""Grids of cases on persistent rank pools: `run_cases(fn, cases, world_size)` runs every case on
the process's pool for that backend and world size (cpkit.harness.rank_pool), started once and reused by
every grid, and returns one CaseResult per case.

On a GPU host the NCCL pools of one world size sit on disjoint GPU slices (two 2-GPU slices on 4
GPUs, four on 8), `pools_per_slice()` pools on each, and `PoolSet.prefetch` spreads the cases
(not the grids) of every known grid over all of them in background threads, every world size
at once, so a test that asks for its grid finds it done or running.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from cpkit.harness.attribution import case_test_id, current_test_id, measured_as
from cpkit.harness.gpu_claim import visible_gpu_ids
from cpkit.harness.launch_times import record_grid_times
from cpkit.harness.rank_pool import PoolStartError, RankPool, close_pools, function_ref
from cpkit.process_device import cuda_device_count

__all__ = ["CaseFailed", "CaseResult", "GridSpec", "POOLS_PER_SLICE_ENV", "PoolSet", "case_id_of", "default_pools",
           "pools_per_slice", "run_cases", "world_sizes_per_gpu"]


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
    compiled: int = 0
    cached: int = 0  # of the compiled graphs, those whose kernels came from the machine's inductor cache
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
        self._queues: dict[tuple, _CaseQueue] = {}
        self._indices: dict[tuple, int] = {}  # (backend, world size, slice) -> the last pool index given
        self._closing = False

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

    def pool(self, backend: str, world_size: int, gpu_slice: str | None = None,
             index: int = 0) -> tuple[RankPool, threading.Lock]:
        """The pool of (backend, world size, GPU slice, index): `index` tells apart the pools that
        share one slice (pools_per_slice)."""
        key = (backend, world_size, gpu_slice, index)
        with self._mutex:
            if key not in self._pools:
                self._pools[key] = RankPool(world_size, backend, gpu_ids=gpu_slice, threads=self._threads_per_rank(backend))
                self._locks[key] = threading.Lock()
            return self._pools[key], self._locks[key]

    def _threads_per_rank(self, backend: str) -> int:
        """Intra-op threads of a rank: 1 on gloo (CPU tests run side by side); on NCCL the host's
        cores shared by the rank processes that may sit on one GPU (one per world size 2, 3, 4
        and pool of a slice), so that side-by-side pools do not oversubscribe the CPU."""
        if backend == "gloo":
            return 1
        per_gpu = world_sizes_per_gpu(len(self.gpu_ids)) * pools_per_slice()
        return max(1, (os.cpu_count() or 1) // max(len(self.gpu_ids) * per_gpu, 1))

    def run_grid(self, spec: GridSpec, gpu_slice: str | None = None) -> dict[str, CaseResult]:
        """Run every case of `spec` in order on one pool; a failure ends only its own case."""
        if gpu_slice is None and spec.backend == "nccl":
            gpu_slice = self.slices(spec.backend, spec.world_size)[0]
        pool, lock = self.pool(spec.backend, spec.world_size, gpu_slice)
        ids = [case_id_of(c) for c in spec.cases]
        if len(set(ids)) != len(ids):
            raise ValueError(f"case ids must be unique, got {ids}")
        results = {cid: CaseResult(cid) for cid in ids}
        asker = spec.test_id or current_test_id()
        tests = {cid: case_test_id(asker, spec.backend, spec.world_size, cid) for cid in ids}
        # A recorded coverage map credits the grid's own code to every case's test, a case's to its own.
        with measured_as([t for t in tests.values() if t]):
            with lock:
                started = time.monotonic()  # the grid's own wall: not the wait for its pool
                deadline = started + spec.timeout
                for cid, case in zip(ids, spec.cases):
                    with measured_as([tests[cid]] if tests[cid] else []):
                        _run_case(pool, spec, case, results[cid], deadline)
                if spec.backend == "gloo":
                    pool.drop_groups()  # idle gloo groups poll: an idle pool keeps only its world group
            record_grid_times(spec.fn, spec.backend, spec.world_size, results, started)
        return results

    # -- background scheduling ---------------------------------------------------------------
    def prefetch(self, specs: Iterable[GridSpec]) -> None:
        """Run `specs` in the background, case by case: per (backend, world size) one queue of
        every case of every grid, drained by `pools_per_slice()` pools on each GPU slice, all
        world sizes at once. A pool whose queue runs dry closes (its GPUs and cores go back) and
        its thread starts a pool for the queue with the most cases left (HELP_MIN_CASES or
        more), so that the 4-GPU grids do not run on alone after the 2-GPU ones. `result()`
        waits for a prefetched grid; a grid's deadline counts from its first case."""
        queues: dict[tuple, _CaseQueue] = {}
        with self._mutex:
            for spec in specs:
                if spec.key not in self._futures:
                    self._futures[spec.key] = Future()
                    queues.setdefault((spec.backend, spec.world_size), _CaseQueue()).add(spec, self._futures[spec.key])
        per_slice = pools_per_slice()
        for (backend, world_size), work in sorted(queues.items(), key=lambda kv: kv[0][1]):
            try:
                slices = self.slices(backend, world_size)
            except RuntimeError as exc:
                work.fail(exc)
                continue
            with self._mutex:
                self._queues[(backend, world_size)] = work
            for index in range(per_slice if backend == "nccl" else 1):
                for gpu_slice in slices:
                    self._start_worker(work, backend, world_size, gpu_slice, self._next_index(backend, world_size, gpu_slice))

    def _next_index(self, backend: str, world_size: int, gpu_slice: str | None) -> int:
        with self._mutex:
            key = (backend, world_size, gpu_slice)
            self._indices[key] = self._indices.get(key, -1) + 1
            return self._indices[key]

    def _start_worker(self, work: "_CaseQueue", backend: str, world_size: int, gpu_slice: str | None,
                      index: int) -> None:
        thread = threading.Thread(target=self._drain, args=(work, backend, world_size, gpu_slice, index),
                                  name=f"cpkit-grid-{backend}{world_size}-{gpu_slice}-{index}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _drain(self, work: "_CaseQueue", backend: str, world_size: int, gpu_slice: str | None, index: int) -> None:
        pool, lock = self.pool(backend, world_size, gpu_slice, index)
        while (item := work.take()) is not None:
            grid, cid, case = item
            try:
                with lock:
                    _run_case(pool, grid.spec, case, grid.results[cid], grid.deadline)
            except BaseException:  # noqa: BLE001 - reported as the case's failure, never lost
                grid.results[cid].errors = {r: f"the harness failed running case {cid}:\n{traceback.format_exc()}"
                                            for r in range(world_size)}
            work.done(grid)
        if backend == "nccl" and not self._closing:
            with lock:
                pool.close()  # its GPUs and cores go to the pools still working
            self._help()

    def _help(self) -> None:
        """Start a pool for the NCCL queue with the most cases left, when that is HELP_MIN_CASES
        or more and it has fewer than MAX_POOLS_PER_SLICE pools on its slice."""
        with self._mutex:
            left = sorted(((q.pending(), key) for key, q in self._queues.items() if key[0] == "nccl"), reverse=True)
        for pending, (backend, world_size) in left:
            if pending < HELP_MIN_CASES:
                return
            for gpu_slice in self.slices(backend, world_size):
                if self._indices.get((backend, world_size, gpu_slice), -1) + 1 < MAX_POOLS_PER_SLICE:
                    index = self._next_index(backend, world_size, gpu_slice)
                    self._drain(self._queues[(backend, world_size)], backend, world_size, gpu_slice, index)
                    return

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
            self._closing = True
            for future in self._futures.values():
                future.cancel()
            pools = list(self._pools.values())
        close_pools(pools)

    def stats(self) -> list[dict]:
        """Per pool: starts (1 + respawns), cases run and start-up seconds."""
        return [dict(backend=p.backend, world_size=p.world_size, gpus=p.gpu_ids, index=key[3], starts=p.starts,
                     cases=p.seq, start_s=round(p.start_seconds, 2), retired=dict(p.retired))
                for key, p in self._pools.items() if p.starts]


def _run_case(pool: RankPool, spec: GridSpec, case: Any, result: CaseResult, deadline: float) -> None:
    """One case of `spec` on `pool` into `result`, within the grid's `deadline` (monotonic); a
    case past it, or one whose pool would not start, fails alone."""
    left = deadline - time.monotonic()
    if left <= 0:
        result.errors = {r: f"not run: the grid's {spec.timeout:.0f} s deadline passed before case {result.case_id}"
                         for r in range(spec.world_size)}
        return
    try:
        # Credited to the case's own test (a grid runs whole when its first test asks).
        test_id = case_test_id(spec.test_id or current_test_id(), spec.backend, spec.world_size, result.case_id)
        run = pool.run(spec.fn, case, left, test_id=test_id)
    except PoolStartError as exc:  # this case fails; the next one tries a fresh start
        result.errors = {r: str(exc) for r in range(spec.world_size)}
        return
    _fill(result, run, spec.world_size)


def _fill(result: CaseResult, run, world_size: int) -> None:
    result.values, result.errors, result.seconds = run.values, dict(run.errors), run.seconds
    result.compiled, result.cached = run.compiled, run.cached
    result.assertion_ranks = set(run.assertion_ranks)
    if run.skipped and len(run.skipped) == world_size:
        result.skip_reason = next(iter(run.skipped.values()))
    elif run.skipped:
        for r, reason in run.skipped.items():
            result.errors[r] = (f"skipped on rank(s) {sorted(run.skipped)} only ({reason}); a case must skip on "
                                f"every rank or none: decide skips before the ranks diverge")


POOLS_PER_SLICE_ENV = "CPKIT_POOLS_PER_SLICE"
HELP_MIN_CASES = 12
"""A pool whose queue ran dry starts one for another world size only when that many cases are
left there: a new pool costs its start-up (about 6 s) and its first cases' compiles."""
MAX_POOLS_PER_SLICE = 4
"""The most pools of one world size on one GPU slice, helpers included."""


def pools_per_slice() -> int:
    """NCCL pools per GPU slice and world size: $CPKIT_POOLS_PER_SLICE, else from the host's
    cores per GPU. The cases are mostly host-bound (launches, Python, NCCL set-up; the GPUs were
    7-37% busy in the proofs), so more processes per GPU keep it busier: 2 pools where a GPU has 8
    or more cores, and up to MAX_POOLS_PER_SLICE where cores are left at 4 per rank process for
    the world sizes that share the GPU (world_sizes_per_gpu: 2 GPUs run only world size 2)."""
    value = os.environ.get(POOLS_PER_SLICE_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{POOLS_PER_SLICE_ENV}={value!r}: must be a whole number >= 1; e.g. "
                             f"{POOLS_PER_SLICE_ENV}=1 for one pool per GPU slice")
        return int(value)
    gpus = max(cuda_device_count(), 1)
    cores_per_gpu = (os.cpu_count() or 1) // gpus
    floor = 2 if cores_per_gpu >= 8 else 1
    return max(floor, min(MAX_POOLS_PER_SLICE, cores_per_gpu // (4 * world_sizes_per_gpu(gpus))))


def world_sizes_per_gpu(gpus: int) -> int:
    """How many of the tiers' world sizes (2, 3, 4) fit on `gpus` GPUs: the pools of each share
    every GPU."""
    return max(1, sum(1 for n in (2, 3, 4) if n <= gpus))


@dataclass
class _GridRun:
    """A prefetched grid in flight: its results fill case by case, from any pool of its size."""

    spec: GridSpec
    future: Future
    results: dict[str, CaseResult]
    remaining: int
    started: float | None = None

    @property
    def deadline(self) -> float:
        return (self.started or time.monotonic()) + self.spec.timeout


class _CaseQueue:
    """Every case of the grids of one backend and world size for the pools that drain it, taken
    round-robin over the grids: every scenario's first (slowest: compiles, communicators) cases
    come early, and the last ones are the short cases of the largest grids. A grid's future gets
    its results when its last case is done."""

    def __init__(self):
        self._grids: "deque[tuple[_GridRun, deque]]" = deque()
        self._lock = threading.Lock()

    def add(self, spec: GridSpec, future: Future) -> None:
        ids = [case_id_of(c) for c in spec.cases]
        if len(set(ids)) != len(ids):
            future.set_exception(ValueError(f"case ids must be unique, got {ids}"))
            return
        grid = _GridRun(spec, future, {cid: CaseResult(cid) for cid in ids}, len(ids))
        if not ids:
            if future.set_running_or_notify_cancel():
                future.set_result({})
            return
        with self._lock:
            self._grids.append((grid, deque(zip(ids, spec.cases))))

    def pending(self) -> int:
        with self._lock:
            return sum(len(cases) for _, cases in self._grids)

    def take(self) -> "tuple[_GridRun, str, Any] | None":
        with self._lock:
            while self._grids:
                grid, cases = self._grids.popleft()
                if grid.started is None:
                    if not grid.future.set_running_or_notify_cancel():  # cancelled: PoolSet.close()
                        continue
                    grid.started = time.monotonic()
                cid, case = cases.popleft()
                if cases:
                    self._grids.append((grid, cases))
                return grid, cid, case
            return None

    def done(self, grid: _GridRun) -> None:
        with self._lock:
            grid.remaining -= 1
            finished = grid.remaining == 0
        if finished:
            record_grid_times(grid.spec.fn, grid.spec.backend, grid.spec.world_size, grid.results, grid.started)
            grid.future.set_result(grid.results)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            grids = [grid for grid, _ in self._grids]
            self._grids.clear()
        for grid in grids:
            if grid.future.set_running_or_notify_cancel():
                grid.future.set_exception(exc)


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
    same way and a clean slate (cpkit.harness.rank_worker); exceptions are caught per case and rank. A
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
