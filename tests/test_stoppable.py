"""cpkit's pytest runs stop with the process that started them (src/cpkit/validation/stoppable.py):
before, `subprocess.run` left the pytest of a `cpkit validate` ended by SIGTERM (a CI's cancel,
`timeout`) running on, orphaned, with its ranks, for as long as the suite takes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cpkit.validation import stoppable

#: A test that starts a child of its own (as a rank launch does), writes both pids, then waits.
SLOW_TEST = """
import os, subprocess, sys, time
def test_waits():
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(os.environ["PIDS"] + ".tmp", "w").write(f"{os.getpid()} {rank.pid}")
    os.replace(os.environ["PIDS"] + ".tmp", os.environ["PIDS"])
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _pids(path: Path, proc: subprocess.Popen) -> list[int]:
    for _ in range(600):
        if path.exists():
            return [int(p) for p in path.read_text().split()]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the inner test never started")


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_sigterm_to_a_validation_stops_its_pytest_and_the_ranks_it_started(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_TEST)
    pids_file = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        from cpkit.validation.pytest_runner import run_pytest
        run_pytest({str(tmp_path)!r}, ["test_slow.py"], output="capture")
        raise SystemExit("run_pytest returned: the inner test was not stopped by SIGTERM here")
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env=dict(os.environ, PIDS=str(pids_file)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)
    try:
        pids = _pids(pids_file, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=stoppable.STOP_GRACE_S + 20)
        left = _gone_within(pids, 5)
    finally:  # nothing of this test outlives it, whatever failed
        _kill_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert not left, f"still running after the validation ended: {left} (pytest, its rank)"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


#: A child that ignores SIGINT (a background job of a non-interactive shell does) and starts one.
DEAF_CHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {rank.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_a_second_sigterm_during_the_stop_does_not_cut_it_short(tmp_path):
    """A cancel that signals twice: the stop still ends in SIGKILL of the child and its child."""
    pids_file = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        import sys
        from cpkit.validation.stoppable import run_stoppable
        run_stoppable([sys.executable, "-c", {DEAF_CHILD!r}, {str(pids_file)!r}], cwd=".", env=None)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, process_group=0)
    try:
        pids = _pids(pids_file, proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=stoppable.STOP_GRACE_S + 20)
        left = _gone_within(pids, 5)
    finally:
        _kill_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert not left, f"still running after the stop: {left}"


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_a_timeout_stops_the_child_and_its_children_even_when_they_ignore_sigint(tmp_path):
    """SIGINT first (pytest writes its summary); a group that ignores it (a job started in the
    background of a non-interactive shell inherits SIGINT ignored) is killed after the grace."""
    pids_file = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        stoppable.run_stoppable([sys.executable, "-c", DEAF_CHILD, str(pids_file)], cwd=tmp_path,
                                env=dict(os.environ), timeout=8)
    assert time.monotonic() - started < 8 + stoppable.STOP_GRACE_S + 10
    assert pids_file.exists(), "the child had not started within the timeout: raise it on this machine"
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2, pids
    left = _gone_within(pids, 5)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the timeout: {left}"
