"""Each launched rank's stderr in a file of its own, forwarded to the launcher's stderr as it
grows and tailed into the failure report when the rank dies.

A rank killed by a signal (a CUDA, NCCL or cuDNN abort, a segfault) sends no traceback through
the launcher's queue; what it wrote to stderr just before (the library's error, faulthandler's
Python stack) is then the only account of the crash, so cpkit.harness.launch quotes its last lines.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

__all__ = ["SILENT_EXIT", "TAIL_LINES", "capture_stderr", "StderrFollower", "describe_exit"]

TAIL_LINES = 30
"""How many of a dead rank's last stderr lines a failure report quotes."""


def capture_stderr(path: str) -> None:
    """In a rank process: point file descriptor 2 (Python's, C's and CUDA's stderr alike) at
    `path`, and have faulthandler print every thread's Python stack there on a fatal signal."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)


class StderrFollower:
    """In the launcher: copies what each rank appends to its stderr file onto this process's
    stderr (poll() from the launcher's wait loop), and reads a rank's last lines back."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.offsets = [0] * len(paths)

    def poll(self) -> None:
        """Forward every rank's new output (whole chunks; ranks interleave as on a shared fd)."""
        for r, path in enumerate(self.paths):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[r])
                    data = fh.read()
            except OSError:  # not created yet
                continue
            if data:
                self.offsets[r] += len(data)
                sys.stderr.write(data.decode("utf-8", errors="replace"))
        sys.stderr.flush()

    def tail(self, rank: int, lines: int = TAIL_LINES) -> str:
        """The last `lines` lines rank `rank` wrote to stderr ("" when it wrote nothing)."""
        try:
            with open(self.paths[rank], "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - 64 * 1024))
                text = fh.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


SILENT_EXIT = "; it wrote nothing to stderr"
"""How describe_exit ends for a rank that died without a word (rendezvous retries those)."""


def describe_exit(rank: int, world_size: int, code: int, tail: str) -> str:
    """'rank R of N died with exit code C (signal S: SIGNAME)' and the rank's last stderr lines."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        head = f"rank {rank} of {world_size} died with exit code {code} (signal {-code}: {name})"
    elif code == 0:
        head = f"rank {rank} of {world_size} exited (code 0) without a result or an error"
    else:
        head = f"rank {rank} of {world_size} died with exit code {code}"
    if not tail:
        return head + SILENT_EXIT
    return f"{head}; the last lines of its stderr:\n" + "\n".join("    " + line for line in tail.splitlines())
