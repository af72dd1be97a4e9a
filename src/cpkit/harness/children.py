"""Processes a test run starts that must end with it: torchrun launches of the examples and the
cluster runner, the Megatron-LM worker. Two guards, for the four ways a run stops:

- `popen_tied` starts the command in a session of its own (so that its whole tree can be killed
  as one) through a small exec wrapper that first sets PR_SET_PDEATHSIG: when the process that
  started it dies, however (SIGTERM, a `timeout`, SIGKILL), the kernel sends the child
  `death_signal`. torchrun answers SIGTERM by stopping its ranks. The wrapper, not `preexec_fn`:
  the examples start from threads, where preexec_fn may deadlock.
- `kill_all` ends every child still running (SIGTERM to its session, SIGKILL after `grace_s`);
  the pytest plugin calls it when the session finishes, Ctrl-C included.

Rank pools and `cpkit.harness.launch` ranks have their own guard (cpkit.harness.rank_worker.die_with_parent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

__all__ = ["kill_all", "popen_tied", "running"]

_WRAPPER = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(1)  # the starter died before the guard was set\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)
_children: set[subprocess.Popen] = set()
_lock = threading.Lock()


def popen_tied(cmd: Sequence[str], *, death_signal: int = signal.SIGTERM, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs) in a new session, sent `death_signal` when this process
    dies, and registered for `kill_all`."""
    wrapped = [sys.executable, "-c", _WRAPPER, str(int(death_signal)), str(os.getpid()), *cmd]
    proc = subprocess.Popen(wrapped, start_new_session=True, **kwargs)
    with _lock:
        _children.add(proc)
    return proc


def running() -> list[subprocess.Popen]:
    """The registered children still running."""
    with _lock:
        alive = [p for p in _children if p.poll() is None]
        _children.intersection_update(alive)
    return alive


def kill_all(grace_s: float = 10.0) -> int:
    """SIGTERM every running child's session, SIGKILL what is left after `grace_s`; how many
    were running."""
    procs = running()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    return len(procs)
