"""Megatron-LM's dynamic-CP scheduler, run from a checkout, as a third implementation behind
cpkit's plan type.

Megatron-LM (`dev`) schedules a global batch for dynamic CP with
`megatron/core/datasets/data_schedule.py::DefaultDynamicCPScheduler.get_groups_and_subsamples`
(`next_hdp_group_packing_aware` per micro-batch, then `align_sample_id_groups` when VPP is on).
`mlm_schedule` runs it from the checkout named by `CPKIT_MLM_SRC` in a worker process
(cpkit.dynamic.mlm_worker: the checkout's own files, not the installed megatron-core) and turns
its per-rank sample lists into CP groups: ranks holding the same samples form one group. A
group's samples are packed into one THD micro-batch (build_packed_microbatches), so
packed=True. Nothing here repairs the plan; cpkit.dynamic.invariants checks it.

The worker stays up between calls (loading the checkout takes seconds; a call takes
milliseconds, so property tests call it thousands of times). A call that does not return
within `timeout_s` seconds of the worker's CPU time raises SchedulerCrash(hang=True) with the
input: the worker's own alarm ends
upstream's loop (pure Python) and the worker stays up; if no reply comes `_GRACE_S` later, the
worker is killed and the next call starts a fresh one. An exception upstream raises
SchedulerCrash with its type, message and the input.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from cpkit.dynamic.mcore import SchedulerCrash, groups_from_rank_lists
from cpkit.dynamic.plan import Microbatch, Plan
from cpkit.upstream.checkouts import git_commit

__all__ = ["MLM_SCHEDULER", "MLM_SRC_ENV", "MLMCheckoutError", "checkout_commit", "mlm_call",
           "mlm_schedule", "mlm_src", "skip_reason"]

MLM_SRC_ENV = "CPKIT_MLM_SRC"
"""Environment variable: the root of a Megatron-LM checkout (the folder holding `megatron/`)."""

MLM_SCHEDULER = ("megatron/core/datasets/data_schedule.py::"
                 "DefaultDynamicCPScheduler.get_groups_and_subsamples")

_START_TIMEOUT_S = 120.0
_GRACE_S = 5.0


class MLMCheckoutError(RuntimeError):
    """The checkout is missing or its scheduling modules do not load (not a scheduler bug)."""


def mlm_src() -> Path | None:
    """The checkout root named by CPKIT_MLM_SRC, or None when the variable is unset or empty."""
    value = os.environ.get(MLM_SRC_ENV, "").strip()
    return Path(value) if value else None


def skip_reason() -> str | None:
    """Why Megatron-LM's scheduler cannot run here (a pytest skip reason), or None when it can."""
    root = mlm_src()
    if root is None:
        return (f"{MLM_SRC_ENV} is not set: point it at a Megatron-LM checkout (dev) to run "
                "its dynamic-CP scheduler")
    if not (root / "megatron/core/datasets/data_schedule.py").is_file():
        return (f"{MLM_SRC_ENV}={root} has no megatron/core/datasets/data_schedule.py "
                "(not a Megatron-LM checkout with dynamic CP)")
    return None


def checkout_commit(root: str | os.PathLike | None = None) -> str:
    """The commit the checkout at `root` (default: CPKIT_MLM_SRC) has checked out, read from its
    .git without running git (cpkit.upstream.checkouts.git_commit); "unknown" for a tree without
    .git or an unreadable one."""
    root = Path(root) if root is not None else mlm_src()
    return git_commit(root) if root is not None else "unknown"


class _Worker:
    """One worker process (cpkit.dynamic.mlm_worker) for one checkout."""

    def __init__(self, root: Path):
        self.root = root
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # cpkit's own src, first on the path
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cpkit.dynamic.mlm_worker", str(root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        self._buffer = b""
        self.exited = False
        ready = self._read(_START_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            detail = ready["error"] if ready else self._stderr_tail()
            self.close()
            raise MLMCheckoutError(f"the Megatron-LM checkout at {root} did not load its "
                                   f"scheduling modules: {detail}")

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"it exited with code {self.proc.poll()}"

    def _read(self, timeout_s: float | None) -> dict | None:
        """The next reply, or None when the worker died or `timeout_s` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # end of file: the worker exited
                self.exited = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def request(self, message: dict, timeout_s: float | None) -> tuple[dict | None, str | None]:
        """Send one request: (its reply, None); (None, the last line of its stderr) when the
        worker died first; (None, None) after killing it at the timeout."""
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(timeout_s)
        except BrokenPipeError:
            reply = None
        died = None
        if reply is None:
            if self.exited or self.proc.poll() is not None:
                try:
                    self.proc.wait(timeout=5)  # its exit code, for the report
                except subprocess.TimeoutExpired:
                    pass
                died = self._stderr_tail()
            self.close()
        return reply, died

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            stream.close()


_workers: dict[Path, _Worker] = {}
_lock = threading.Lock()


@atexit.register
def _close_workers() -> None:
    for worker in list(_workers.values()):
        worker.close()
    _workers.clear()


def _checkout_root(root: str | os.PathLike | None) -> Path:
    path = Path(root) if root is not None else mlm_src()
    if path is None:
        raise MLMCheckoutError(skip_reason())
    if not (path / "megatron/core/datasets/data_schedule.py").is_file():
        raise MLMCheckoutError(f"{path} has no megatron/core/datasets/data_schedule.py: set "
                               f"{MLM_SRC_ENV} to the root of a Megatron-LM dev checkout")
    return path.resolve()


def _request(message: dict, timeout_s: float | None, root, inputs: dict) -> dict:
    path = _checkout_root(root)
    with _lock:
        worker = _workers.get(path)
        if worker is None or not worker.alive():
            worker = _workers[path] = _Worker(path)
        wait_s = None if timeout_s is None else timeout_s + _GRACE_S
        reply, died = worker.request({**message, "timeout_s": timeout_s}, wait_s)
        if reply is None:
            del _workers[path]
            if died is not None:
                raise SchedulerCrash(f"the worker died: {died}", inputs=inputs)
            raise SchedulerCrash(f"did not return within {timeout_s:g} s", hang=True,
                                 inputs=inputs)
    where = f" in {reply['where']}" if reply.get("where") else ""
    if reply.get("hang"):
        raise SchedulerCrash(f"did not return within {timeout_s:g} s (looping{where})",
                             hang=True, inputs=inputs)
    if not reply["ok"]:
        raise SchedulerCrash(f"{reply['error']}{where}", inputs=inputs,
                             error_type=reply["type"])
    return reply


def mlm_call(target: str, *args, timeout_s: float | None = 10.0, root=None):
    """Run the cpkit function `target` ("module:function") in the worker, given the checkout's
    modules ({"data_schedule", "data_schedule_utils", "hybrid_cp_schedule"}) and `args` (JSON
    values); its JSON result. For probes of upstream internals; raises SchedulerCrash as
    mlm_schedule does."""
    return _request({"op": "call", "target": target, "args": list(args)}, timeout_s, root,
                    {"target": target, "args": list(args)})["result"]


def mlm_schedule(
    seq_lens: Sequence[int],
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    *,
    microbatch_group_size: int | None = None,
    timeout_s: float | None = 10.0,
    min_cp_size: int = 1,
    root: str | os.PathLike | None = None,
) -> Plan:
    """Plan `seq_lens` with Megatron-LM's DefaultDynamicCPScheduler on `dp_cp_size` ranks.

    `microbatch_group_size` is its microbatch_group_size_per_vp_stage (VPP; None or 1: off),
    `min_cp_size` its min_cp_size. `root` defaults to CPKIT_MLM_SRC. Group sizes are the number of ranks holding each sample
    list (checked, not repaired, by cpkit.dynamic.invariants); `workloads` are upstream's
    estimate at the needed size (L**2 / cp); `needed_cp_sizes` cpkit's cp_size_for (0 when a
    sample fits no group). Raises SchedulerCrash (with the input) for an exception upstream or
    a call that does not return within `timeout_s` (hang=True), MLMCheckoutError when the
    checkout is missing or does not load.
    """
    from cpkit.dynamic.scheduler import cp_size_for

    lens = [int(L) for L in seq_lens]
    inputs = {"seq_lens": lens, "dp_cp_size": int(dp_cp_size),
              "max_seq_len_per_rank": int(max_seq_len_per_rank),
              "microbatch_group_size": microbatch_group_size}
    if min_cp_size != 1:
        inputs["min_cp_size"] = int(min_cp_size)
    reply = _request({"op": "schedule", **inputs}, timeout_s, root, inputs)
    microbatches = tuple(Microbatch(groups=groups_from_rank_lists(per_rank))
                         for per_rank in reply["sample_id_groups"])
    needs = []
    for L in lens:
        try:
            needs.append(cp_size_for(L, max_seq_len_per_rank, min_cp_size))
        except ValueError:
            needs.append(0)
    return Plan(
        microbatches=microbatches,
        seq_lens=tuple(lens),
        dp_cp_size=int(dp_cp_size),
        max_seq_len_per_rank=int(max_seq_len_per_rank),
        workloads=tuple(L * L / max(1, c) for L, c in zip(lens, needs)),
        needed_cp_sizes=tuple(needs),
        candidate="mlm",
        packed=True,
    )
