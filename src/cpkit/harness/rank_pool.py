"""Persistent rank pools: N ranks that start once (spawn, imports, process group) and then run
case after case, so a test tier pays start-up once per world size and GPU slice, not per grid.

Modelled on Transformer Engine's CP test pool and PyTorch's MultiProcContinuousTest, and guarded
against their known failure modes: a dead worker never hangs the owner (liveness is polled with
every wait), each rank has its own pipe (no shared queue to desync), teardown is bounded (exit
message, then SIGKILL of each rank's process group), and one failure never mutes later cases:

- a case that raises on some ranks while the rest finish is a failure of that case only; the
  ranks resynchronize through the store (cpkit.harness.rank_worker) and the pool carries on;
- a rank that dies, or ranks still running `fail_grace_s` after another rank failed (stuck in a
  collective the failed rank never joined), or a case past its deadline: every rank's state is
  reported (result, traceback, exit, stack dump, stderr tail), the pool is killed and the next
  case starts a fresh one;
- a case after which its ranks hold more GPU memory than before fails with the leak and retires
  the pool; a pool is retired (nothing fails) when its ranks keep more process groups than a
  leak-free tier makes, or made different numbers of them (cpkit.harness.pool_groups: groups are reused
  across cases). `RankPool.retired` counts each reason.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_conn
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from cpkit.harness.attribution import current_test_id
from cpkit.harness.rank_stderr import StderrFollower, describe_exit
from cpkit.harness.rank_worker import rank_main
from cpkit.harness.rendezvous import START_ATTEMPTS, is_transient_rendezvous, note_retry
from cpkit.notices import child_warnoptions

__all__ = ["PoolStartError", "RankPool", "CaseRun", "close_pools", "function_ref"]

DEFAULT_FAIL_GRACE_S = 10.0
"""After one rank fails, how long the others may take to report before they count as stuck."""
DEFAULT_START_TIMEOUT_S = 180.0


class PoolStartError(RuntimeError):
    """The pool's ranks did not all come up; the message holds each rank's account, `.problems`
    maps rank -> that account."""

    def __init__(self, message: str, problems: dict[int, str] | None = None):
        super().__init__(message)
        self.problems = problems or {}


def function_ref(fn: Callable) -> str:
    """'module:qualname' of a module-level callable; ValueError for one a rank cannot import."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{fn!r}: a pool runs cases by importable name; define it at module level of an "
                         f"importable module (got module={module!r}, qualname={qualname!r})")
    return f"{module}:{qualname}"


@dataclass
class CaseRun:
    """One case on every rank: `values` of ranks that returned, `errors` (rank -> text) of the
    rest (tracebacks, or the harness's account of a death, hang or leak), `skipped` (rank ->
    reason), the slowest rank's seconds and whether the pool survived."""

    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    assertion_ranks: set[int] = field(default_factory=set)
    """Ranks whose error is the case's own AssertionError (a wrong result), not a crash or a
    config error: only these can make an expected failure (a strict xfail with raises=AssertionError)."""
    skipped: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    compiled: int = 0
    """Graphs torch.compile compiled during the case (the most on one rank)."""
    cached: int = 0
    """Of those, graphs whose kernels came from the machine's inductor cache (the most on one rank)."""
    pool_broken: bool = False


class RankPool:
    """`world_size` ranks on `backend` ("gloo": CPU; "nccl": rank r on the r-th of `gpu_ids`).

    `run(fn, case, timeout)` runs `fn(case)` on every rank and returns a CaseRun; the pool starts
    on first use and again after any failure that broke it. `close()` ends it within seconds.
    """

    def __init__(self, world_size: int, backend: str = "gloo", *, gpu_ids: str | None = None,
                 threads: int = 1, pg_timeout_s: float = 120.0, fail_grace_s: float = DEFAULT_FAIL_GRACE_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        self.world_size, self.backend, self.gpu_ids = world_size, backend, gpu_ids
        self.threads, self.pg_timeout_s = threads, pg_timeout_s
        self.fail_grace_s, self.start_timeout_s = fail_grace_s, start_timeout_s
        self.procs: list = []
        self.conns: list = []
        self.dir: str | None = None
        self.follower: StderrFollower | None = None
        self.seq = 0
        self.starts = 0  # how many times ranks were spawned (1 + respawns)
        self.start_seconds = 0.0
        self.retired: Counter = Counter()  # why the pool was killed: hang, crash, leak, kept groups, ...

    def __repr__(self) -> str:
        where = f" on GPUs {self.gpu_ids}" if self.gpu_ids else ""
        return f"RankPool({self.backend}, {self.world_size} ranks{where})"

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.exitcode is None for p in self.procs)

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the ranks and wait until every one has joined the process group (once more
        after a gloo mesh failure while joining: cpkit.harness.rendezvous)."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except PoolStartError as error:
                flaky = [t for t in error.problems.values() if is_transient_rendezvous(self.backend, t)]
                if not flaky or attempt == START_ATTEMPTS:
                    raise
                note_retry(repr(self), flaky[0])

    def _start_once(self) -> None:
        self.close()
        began = time.monotonic()
        ctx = mp.get_context("spawn")
        self.dir = tempfile.mkdtemp(prefix=f"cpkit-pool-{self.backend}{self.world_size}-")  # fresh store
        pairs = [ctx.Pipe(duplex=True) for _ in range(self.world_size)]
        self.conns = [parent for parent, _ in pairs]
        sync_timeout = self.pg_timeout_s
        self.procs = [ctx.Process(target=rank_main, name=f"cpkit-pool-rank{r}", daemon=True,
                                  args=(r, self.world_size, self.backend, self.dir, child, os.getpid(),
                                        self.gpu_ids or "", self.threads, self.pg_timeout_s, sync_timeout))
                      for r, (_, child) in enumerate(pairs)]
        self.follower = StderrFollower([os.path.join(self.dir, f"rank{r}.stderr") for r in range(self.world_size)])
        before = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = child_warnoptions(before)  # MCore notices a rank cannot act on
        try:
            for p in self.procs:
                p.start()
        finally:
            if before is None:
                os.environ.pop("PYTHONWARNINGS", None)
            else:
                os.environ["PYTHONWARNINGS"] = before
        for _, child in pairs:
            child.close()
        self.starts += 1
        waiting, problems = set(range(self.world_size)), {}
        deadline = time.monotonic() + self.start_timeout_s
        while waiting and not problems and time.monotonic() < deadline:
            for r, message in self._receive(waiting, 0.2):
                if message is None or message[0] == "fatal":
                    problems[r] = message[1] if message else self._exit_text(r)
                waiting.discard(r)
            for r in list(waiting):
                if self.procs[r].exitcode is not None:
                    problems[r] = self._exit_text(r)
                    waiting.discard(r)
        if waiting and not problems:
            problems = {r: f"rank {r} did not join within {self.start_timeout_s:.0f} s:\n{stack}"
                        for r, stack in self._stacks(waiting).items()}
        if problems:
            self.kill()
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(problems.items()))
            raise PoolStartError(f"{self!r} failed to start:\n{text}", problems)
        self.start_seconds += time.monotonic() - began

    def close(self, grace_s: float = 5.0) -> None:
        """Ask the ranks to leave, then kill whatever is left after `grace_s`."""
        close_pools([self], grace_s)

    def kill(self) -> None:
        """SIGKILL every rank's process group (a rank's own children die with it)."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), lambda: os.kill(p.pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
        for p in self.procs:
            p.join(5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def drop_groups(self, timeout: float = 60.0) -> None:
        """Have every rank free the process groups it keeps for later cases (between grids on
        gloo, where idle groups cost CPU); a rank that does not answer, or ranks whose group
        counts then differ, cost the pool (the next case starts a fresh one)."""
        if not self.alive:
            return
        counts = {}
        self._send_all(("drop-groups",))  # a rank that cannot take it does not answer: handled below
        deadline = time.monotonic() + timeout
        waiting = set(range(self.world_size))
        while waiting and time.monotonic() < deadline and self.alive:
            for r, message in self._receive(waiting, 0.2):
                waiting.discard(r)
                if message and message[0] == "dropped":
                    counts[r] = message[2]
        if waiting or len(counts) != self.world_size or len(set(counts.values())) > 1:
            self.retired["dropping groups failed"] += 1
            self.kill()

    # -- running cases ---------------------------------------------------------------------
    def run(self, fn: Callable[[Any], Any] | str, case: Any, timeout: float, *, test_id: str | None = None) -> CaseRun:
        """Run `fn(case)` on every rank within `timeout` seconds (start-up not included).
        `test_id` (default: the test being measured, when a coverage map is recorded) is the test
        the ranks attribute the case's coverage to: a pool outlives the test that started it."""
        ref = fn if isinstance(fn, str) else function_ref(fn)
        test_id = test_id or current_test_id()
        if not self.alive:
            self.start()
        self.seq += 1
        out = CaseRun()
        running = set(range(self.world_size))
        for r, conn in enumerate(self.conns):
            try:
                conn.send(("case", self.seq, ref, case, test_id))
            except (OSError, ValueError) as exc:
                out.errors[r] = f"rank {r}: the case could not be sent ({exc})"
                running.discard(r)
        deadline = time.monotonic() + timeout
        first_failure = None
        while running:
            for r, message in self._receive(running, 0.2):
                running.discard(r)
                if message is None or message[0] == "fatal":
                    out.errors[r] = message[1] if message else self._exit_text(r)
                    first_failure = first_failure or time.monotonic()
                    continue
                kind, _, payload, seconds, compiled, cached = message
                out.seconds, out.compiled = max(out.seconds, seconds), max(out.compiled, compiled)
                out.cached = max(out.cached, cached)
                if kind == "ok":
                    out.values[r] = payload
                elif kind == "skipped":
                    out.skipped[r] = payload
                else:
                    if kind == "failed":
                        out.assertion_ranks.add(r)
                    out.errors[r] = payload
                    first_failure = first_failure or time.monotonic()
            for r in list(running):
                if self.procs[r].exitcode is not None:
                    out.errors[r] = self._exit_text(r)
                    running.discard(r)
                    first_failure = first_failure or time.monotonic()
            now = time.monotonic()
            if running and (now > deadline or (first_failure and now - first_failure > self.fail_grace_s)):
                why = (f"still running the case {timeout:.0f} s after it started (the case's deadline)"
                       if now > deadline else
                       f"still running {self.fail_grace_s:.0f} s after rank(s) {sorted(out.errors)} failed: "
                       f"most likely waiting in a collective that the failed rank never joined")
                for r, stack in self._stacks(running).items():
                    tail = self.follower.tail(r) if self.follower else ""
                    out.errors[r] = f"rank {r} was {why}; the pool was killed. Its stack:\n{stack}" + (
                        f"\nIts last stderr lines:\n{tail}" if tail else "")
                self.retired["hang" if now > deadline else "stuck after a failure"] += 1
                self.kill()
                out.pool_broken = True
                return out
        if out.errors and any(self.procs[r].exitcode is not None for r in range(self.world_size)):
            self.retired["crash"] += 1
            self.kill()  # a rank died: the group is gone for everyone
            out.pool_broken = True
            return out
        self._await_clean_up(out)
        return out

    def _await_clean_up(self, out: CaseRun) -> None:
        waiting = set(range(self.world_size))
        counts: dict[int, int] = {}
        reasons: set[str] = set()
        deadline = time.monotonic() + self.pg_timeout_s + 30.0
        while waiting and time.monotonic() < deadline:
            for r, message in self._receive(waiting, 0.2):
                waiting.discard(r)
                if message is None or message[0] != "clean":
                    why = message[1] if message else self._exit_text(r)
                    out.errors[r] = (out.errors.get(r, "") + f"\nrank {r} failed cleaning up after the case: {why}").strip()
                    out.pool_broken = True
                    reasons.add("clean-up failed")
                else:
                    if message[2]:
                        out.errors[r] = (out.errors.get(r, "") + f"\nleak: the case left behind {message[2]}").strip()
                    if message[3]:  # a leak, or too many kept groups: retire the pool
                        out.pool_broken = True
                        reasons.add(message[3])
                    counts[r] = message[4]
            for r in list(waiting):
                if self.procs[r].exitcode is not None:
                    out.errors[r] = (out.errors.get(r, "") + "\n" + self._exit_text(r)).strip()
                    out.pool_broken = True
                    reasons.add("crash")
                    waiting.discard(r)
        if len(set(counts.values())) > 1:
            # A case that failed half-way on some ranks: their next new_group calls would pair up
            # wrongly (c10d names groups by this count), so the next case gets fresh ranks.
            out.pool_broken = True
            reasons.add("group counts differ")
        if waiting:
            for r, stack in self._stacks(waiting).items():
                out.errors[r] = (out.errors.get(r, "") + f"\nrank {r} did not finish cleaning up after the case "
                                 f"(other ranks never reached it, or a process group would not close):\n{stack}").strip()
            out.pool_broken = True
            reasons.add("clean-up hung")
        if out.pool_broken:
            self.retired.update(reasons)
            self.kill()

    # -- plumbing --------------------------------------------------------------------------
    def _send_all(self, message: tuple) -> None:
        """`message` to every rank whose channel still takes it."""
        for conn in self.conns:
            try:
                conn.send(message)
            except (OSError, ValueError):
                pass

    def _receive(self, ranks, timeout: float):
        """(rank, message) for every rank in `ranks` with a message; message None: pipe closed."""
        by_conn = {self.conns[r]: r for r in ranks}
        got = []
        for conn in mp_conn.wait(list(by_conn), timeout=timeout):
            try:
                got.append((by_conn[conn], conn.recv()))
            except (EOFError, OSError):
                self.procs[by_conn[conn]].join(2.0)  # let its exit code settle
                got.append((by_conn[conn], None))
        return got

    def _exit_text(self, r: int) -> str:
        code = self.procs[r].exitcode
        tail = self.follower.tail(r) if self.follower else ""
        if code is None:
            return f"rank {r} of {self.world_size} closed its channel without a word"
        return describe_exit(r, self.world_size, code, tail)

    def _stacks(self, ranks) -> dict[int, str]:
        """Each live rank's Python stacks now (faulthandler on SIGUSR1, appended to its file)."""
        paths = {r: os.path.join(self.dir, f"rank{r}.stacks") for r in ranks}
        offsets = {r: os.path.getsize(path) if os.path.exists(path) else 0 for r, path in paths.items()}
        for r in ranks:
            if self.procs[r].exitcode is None:
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)
        stacks = {}
        for r in ranks:
            try:
                with open(paths[r]) as fh:
                    fh.seek(offsets[r])
                    stacks[r] = fh.read().strip() or "(no stack dump)"
            except OSError:
                stacks[r] = "(no stack dump)"
        return stacks


def close_pools(pools: list["RankPool"], grace_s: float = 5.0) -> None:
    """Ask every rank of every pool to leave at once, then kill whatever is left after one
    shared `grace_s`: closing N pools takes one grace, not N."""
    for pool in pools:
        pool._send_all(("exit",))
    deadline = time.monotonic() + grace_s
    for pool in pools:
        for p in pool.procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for pool in pools:
        pool.kill()
