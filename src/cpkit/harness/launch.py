"""Run a Python callable on N ranks (gloo on CPU, NCCL with one GPU per rank).

Modelled on PyTorch's own distributed test harness: spawned ranks, FileStore rendezvous (no
port races under pytest-xdist), a failing rank reported with its number and traceback while the
others are stopped at once, and a per-launch timeout that names the hung ranks with their stack
dumps. No process outlives a launch, whatever the outcome.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from cpkit.harness.gpu_claim import CLAIM_ENV, claim_gpus, gpu_slots, visible_gpu_ids
from cpkit.harness.launch_times import record_times
from cpkit.harness.rank_stderr import StderrFollower, capture_stderr, describe_exit
from cpkit.harness.rank_worker import die_with_parent
from cpkit.harness.rendezvous import START_ATTEMPTS, is_transient_rendezvous, note_retry
from cpkit.notices import child_warnoptions
from cpkit.process_device import BACKEND_ENV, cuda_device_count

__all__ = [
    "LaunchTimeout",
    "RankFailure",
    "CaseFailed",
    "CaseResult",
    "case_id_of",
    "launch",
    "run_cases",
]

DEFAULT_TIMEOUT_S = 300.0
_BIND_ENV = "CPKIT_NCCL_BIND_DEVICE"  # "1": init_process_group(device_id=...): eager NCCL, split subgroups


class RankFailure(RuntimeError):
    """A rank raised (or died). `.rank` is the first failing rank, `.details` maps rank -> text;
    `.joining` is True when that rank failed while joining the process group, before `fn` ran."""

    def __init__(self, message: str, rank: int | None, details: dict[int, str], joining: bool = False):
        super().__init__(message)
        self.rank = rank
        self.details = details
        self.joining = joining


class LaunchTimeout(RankFailure):
    """The launch ran past its timeout; `.hung_ranks` never reported, `.details` holds stacks."""

    def __init__(self, message: str, hung_ranks: list[int], details: dict[int, str]):
        super().__init__(message, hung_ranks[0] if hung_ranks else None, details)
        self.hung_ranks = hung_ranks


def _worker(rank, world_size, backend, store_path, dump_dir, pg_timeout_s, fn, args, kwargs, out_q,
            parent_pid=None, cuda_visible=None, gpu_ids=None, threads=None):
    capture_stderr(os.path.join(dump_dir, f"rank{rank}.stderr"))
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if not (cuda_visible if cuda_visible is not None else backend == "nccl"):
        # A gloo rank runs on CPU: hide the GPUs before torch first looks for them, so that
        # nothing in the rank (MCore, a kernel choice, an RNG fork) initializes CUDA by accident.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif gpu_ids is not None:  # the GPUs this launch claimed (cpkit.harness.gpu_claim): rank r on the r-th
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_ids
    # A stack dump on SIGUSR1 lets the parent show where a hung rank is stuck.
    dump_file = open(os.path.join(dump_dir, f"rank{rank}.stacks"), "w")
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            BACKEND_ENV: backend,
        }
    )
    joined = False
    try:
        import torch
        import torch.distributed as dist

        # N ranks share the machine's cores: don't oversubscribe them. On GPU hosts too: with
        # every rank's intra-op pool as wide as the machine, a small CPU op (a batch slice) took
        # 32 ms instead of microseconds in the eval_cp bench (torchrun sets 1 thread for this).
        # gloo ranks compute on CPU with test-sized tensors: one thread each, as under torchrun,
        # so that a 16-core host is not slower than a 2-core one (idle intra-op pools spin).
        torch.set_num_threads(1 if backend == "gloo" else threads or 1)
        bind = {}
        if backend != "gloo":
            torch.cuda.set_device(rank)
            if os.environ.get(_BIND_ENV) == "1":
                bind["device_id"] = torch.device("cuda", rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
            **bind,
        )
        joined = True
        # On error, report before tearing the group down: tearing down first would wake the
        # healthy ranks with connection errors that could arrive ahead of the real cause.
        result = fn(*args, **(kwargs or {}))
        out_q.put(("ok", rank, pickle.dumps(result)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        out_q.put(("error" if joined else "joining", rank, traceback.format_exc()))
        out_q.close()
        out_q.join_thread()
        os._exit(1)
    out_q.close()
    out_q.join_thread()


def _start(procs) -> None:
    """Start the ranks with cpkit.notices' filters in their PYTHONWARNINGS: a spawned rank
    imports the parent's main module and fn's module (often megatron-core, with its notices)
    before any cpkit code runs in it. Real warnings still show, and so do these where the
    parent's own -W or PYTHONWARNINGS options ask for them (spawn repeats those on the rank's
    command line, after the environment)."""
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = child_warnoptions(before)
    try:
        for p in procs:
            p.start()
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before


def _stop(procs, grace_s: float = 3.0) -> None:
    procs = [p for p in procs if p.pid is not None]  # never started: nothing to stop
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _collect_stacks(procs, ranks, dump_dir) -> dict[int, str]:
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(1.0)
    stacks = {}
    for r in ranks:
        path = os.path.join(dump_dir, f"rank{r}.stacks")
        try:
            with open(path) as fh:
                stacks[r] = fh.read().strip() or "(no stack dump)"
        except OSError:
            stacks[r] = "(no stack dump)"
    return stacks


def _raise_failure(procs, out_q, world_size, rank, payload, follower, joining=False):
    """Stop every rank and raise RankFailure for `rank`, listing other ranks' errors after it."""
    details = {rank: payload}
    deadline = time.monotonic() + 0.5  # errors the first failure caused elsewhere, if any
    while time.monotonic() < deadline:
        try:
            kind, other, text = out_q.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        if kind in ("error", "joining"):
            details.setdefault(other, text)
    # A rank that died without a word (a crash, a kill) is often the root cause: name it.
    for r, p in enumerate(procs):
        if r not in details and p.exitcode not in (None, 0, 1):
            details[r] = describe_exit(r, world_size, p.exitcode, follower.tail(r))
    _stop(procs)
    text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in details.items())
    raise RankFailure(f"rank {rank} of {world_size} failed first:\n{text}", rank, details, joining)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    pg_timeout: float | None = None,
    cuda_visible: bool | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` fresh ranks; return the per-rank results.

    `fn` must be importable (module level). Each rank has torch.distributed initialized on
    `backend` ("gloo" or "nccl"; nccl puts rank r on cuda:r) with a FileStore rendezvous.
    Results must be picklable (return CPU tensors). Raises RankFailure naming the first rank that
    raised or died, with its traceback, after stopping the others at once; raises LaunchTimeout
    naming the ranks that did not finish within `timeout` seconds, with their stack dumps.
    `pg_timeout` bounds every collective (default: the launch timeout), so an out-of-step
    rank errors instead of hanging. `cuda_visible` (default: only under nccl) lets a gloo rank
    see the GPUs; otherwise gloo ranks run with CUDA hidden and one intra-op thread each.

    Under nccl the launch first claims `world_size` GPUs of the host (cpkit.harness.gpu_claim; waits
    while other launches hold them; CPKIT_GPU_CLAIM=0: no claim, rank r on visible GPU r), so
    that launches smaller than the host run side by side (CPKIT_GPU_SLOTS launches per GPU). A rank that dies by a signal is
    reported with the last lines it wrote to stderr (each rank's stderr also reaches this
    process's stderr as it is written).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    if backend != "nccl" or os.environ.get(CLAIM_ENV) == "0":
        return _launch(fn, world_size, backend, timeout, args, kwargs, pg_timeout, cuda_visible,
                       None, max(1, (os.cpu_count() or 1) // world_size))
    count = cuda_device_count()
    asked = time.monotonic()
    with claim_gpus(world_size, visible_gpu_ids(count)) as mine:
        record_times([dict(launch=getattr(fn, "__name__", str(fn)), world_size=world_size, gpus=mine,
                            claim_wait_s=round(time.monotonic() - asked, 2))])
        # Share the cores by GPU and slot: launches side by side must not oversubscribe them either.
        threads = max(1, (os.cpu_count() or 1) // (max(world_size, count) * gpu_slots()))
        return _launch(fn, world_size, backend, timeout, args, kwargs, pg_timeout, cuda_visible,
                       ",".join(mine), threads)


def _launch(fn, world_size, backend, *rest):
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _launch_once(fn, world_size, backend, *rest)
        except RankFailure as failure:
            first = failure.details.get(failure.rank, "")
            if not (failure.joining and is_transient_rendezvous(backend, first)) or attempt == START_ATTEMPTS:
                raise
            note_retry(f"launch of {getattr(fn, '__name__', fn)} on {world_size} ranks", first)


def _launch_once(fn, world_size, backend, timeout, args, kwargs, pg_timeout, cuda_visible,
                 gpu_ids, threads):
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="cpkit-launch-")
    out_q = ctx.Queue()
    pg_timeout_s = float(pg_timeout if pg_timeout is not None else timeout)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, backend, os.path.join(tmp, "store"), tmp, pg_timeout_s,
                  fn, tuple(args), kwargs, out_q, os.getpid(), cuda_visible, gpu_ids, threads),
            name=f"cpkit-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    results: dict[int, Any] = {}
    follower = StderrFollower([os.path.join(tmp, f"rank{r}.stderr") for r in range(world_size)])

    def handle(message) -> None:
        kind, rank, payload = message
        if kind == "ok":
            results[rank] = pickle.loads(payload)
        elif kind in ("error", "joining"):
            _raise_failure(procs, out_q, world_size, rank, payload, follower, kind == "joining")

    def gone() -> list[int]:
        # Exit code 0 counts too: a rank that exited cleanly without a result (os._exit(0) in
        # fn) would otherwise be waited for until the launch timeout.
        return [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]

    try:
        _start(procs)
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                handle(out_q.get(timeout=0.2))
                idle = False
            except queue_mod.Empty:
                idle = True
            follower.poll()
            if idle and gone():
                # Give a raising rank's error (or a clean rank's result) a moment to arrive
                # before blaming a crash; keep every other message that arrives meanwhile.
                grace = time.monotonic() + 2.0
                while gone() and time.monotonic() < grace:
                    try:
                        handle(out_q.get(timeout=0.1))
                    except queue_mod.Empty:
                        pass
                dead = gone()
                if dead:
                    r = dead[0]
                    msg = describe_exit(r, world_size, procs[r].exitcode, follower.tail(r))
                    _stop(procs)
                    raise RankFailure(f"launch of {getattr(fn, '__name__', fn)}: {msg}", r, {r: msg})
            if len(results) < world_size and time.monotonic() > deadline:
                hung = [r for r in range(world_size) if r not in results]
                stacks = _collect_stacks(procs, hung, tmp)
                _stop(procs)
                text = "\n".join(f"--- rank {r} stack ---\n{stacks[r]}" for r in hung)
                raise LaunchTimeout(
                    f"launch of {getattr(fn, '__name__', fn)} on {world_size} ranks timed out "
                    f"after {timeout:.0f}s; hung ranks: {hung}\n{text}",
                    hung, stacks,
                )
        for p in procs:
            p.join(10)
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        follower.poll()
        out_q.close()
        shutil.rmtree(tmp, ignore_errors=True)


# Grids of cases run on persistent rank pools (cpkit.harness.grid); re-exported for existing imports.
from cpkit.harness.grid import CaseFailed, CaseResult, case_id_of, run_cases  # noqa: E402
