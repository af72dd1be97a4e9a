"""A child process that stops with the process that started it.

`subprocess.run` leaves its child running when this process is ended by SIGTERM (a CI's cancel,
`timeout cpkit validate ...`): Python dies at once and the pytest it started ran on, orphaned,
with its ranks, for as long as the suite takes. Here the child runs in a process group of its
own, and whatever ends the wait (SIGTERM, Ctrl-C, the timeout) stops that whole group: SIGINT
first, so pytest writes its summary and ends its workers and ranks, then SIGKILL after
STOP_GRACE_S. Ctrl-C in a terminal reaches this process (the child is in another group) and is
passed on the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading

__all__ = ["STOP_GRACE_S", "run_stoppable"]

STOP_GRACE_S = 10.0
"""Seconds the child's group has after SIGINT before SIGKILL."""


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the child's process group, then SIGKILL to what is left of it after the child
    ended or STOP_GRACE_S passed: no rank outlives the run."""
    def signal_group(sig):
        with contextlib.suppress(ProcessLookupError):  # the group is gone
            os.killpg(proc.pid, sig)

    signal_group(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    signal_group(signal.SIGKILL)
    proc.wait()


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run_stoppable(cmd: list[str], *, cwd, env, timeout: float | None = None, capture: bool = False,
                  stdout=None) -> tuple[int, str]:
    """(exit code, captured stdout + stderr or "") of `cmd`; raises subprocess.TimeoutExpired
    after `timeout` seconds, the child's group stopped first. `capture` collects its output,
    else it writes to `stdout` (None: this process's)."""
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) if capture else dict(stdout=stdout)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if main else None
    try:
        # its own process group, in this session: it keeps the terminal, and signals reach it from here
        with subprocess.Popen(cmd, cwd=cwd, env=env, process_group=0, **pipes) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException:
                _stop_group(proc)
                raise
            return proc.returncode, (out or "") + (err or "")
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
