"""A child process that stops with the process that started it.

`subprocess.run` leaves its child running when this process is ended by SIGTERM (a CI's cancel,
`timeout cpkit validate ...`) or SIGHUP: Python dies at once and the pytest it started ran on,
orphaned, with its ranks, for as long as the suite takes. Here whatever ends the wait (SIGTERM,
SIGHUP, Ctrl-C, the timeout) stops the child: SIGINT first, so pytest writes its summary and ends
its workers and ranks, then SIGKILL after STOP_GRACE_S, with further signals held off meanwhile.
Without a terminal the child runs in a process group of its own and the whole group is
signalled, ranks included; at a terminal it stays in the terminal's group, so that it can read it
(`--pdb`), and Ctrl-C reaches it directly.
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


def _stop(proc: subprocess.Popen, group: bool, interrupt: bool = True) -> None:
    """SIGINT to the child (its group; not where Ctrl-C at the terminal reached it already), then
    SIGKILL after the child ended or STOP_GRACE_S passed: no rank outlives the run. SIGINT,
    SIGTERM and SIGHUP here are ignored meanwhile, so a second Ctrl-C or a cancel's follow-up
    cannot cut the stop short."""
    def send(sig):
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)

    main = threading.current_thread() is threading.main_thread()
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOPPING} if main else {}
    try:
        if interrupt:
            send(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=STOP_GRACE_S)  # drains captured output: a full pipe never blocks it
    finally:
        send(signal.SIGKILL)
        proc.wait()
        for sig, handler in held.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def run_stoppable(cmd: list[str], *, cwd, env, timeout: float | None = None, capture: bool = False,
                  stdout=None) -> tuple[int, str]:
    """(exit code, captured stdout + stderr or "") of `cmd`; raises subprocess.TimeoutExpired
    after `timeout` seconds, the child's group stopped first. `capture` collects its output,
    else it writes to `stdout` (None: this process's)."""
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) if capture else dict(stdout=stdout)
    group = not _at_a_terminal()
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _raise_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)} if main else {}
    try:
        with subprocess.Popen(cmd, cwd=cwd, env=env, process_group=0 if group else None, **pipes) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException as exc:
                _stop(proc, group, interrupt=group or not isinstance(exc, KeyboardInterrupt))
                raise
            return proc.returncode, (out or "") + (err or "")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _at_a_terminal() -> bool:
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False
