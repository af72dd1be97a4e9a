"""Everything a test run starts ends with it, whichever of the four ways it stops: Ctrl-C
(SIGINT), SIGTERM, the `timeout` command, SIGKILL. The tree here is the examples' own shape: a
torchrun launch of two ranks started through cpkit.harness.children.popen_tied, as
functional/test_examples.py and functional/test_cluster.py start theirs. Two example ranks once
outlived a timed-out run by 50 minutes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                    reason="the guard is Linux's PR_SET_PDEATHSIG")]
ROOT = Path(__file__).resolve().parents[1]

_RANK = """
import os, sys, time
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(f"{os.getpid()} {os.getppid()}")
time.sleep(600)
"""

_RUN = """
import os, sys, time
from cpkit.harness.children import popen_tied

def test_starts_a_torchrun_tree():
    out = {out!r}
    proc = popen_tied([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       os.path.join(out, "rank.py"), out])
    while len([f for f in os.listdir(out) if f.endswith(".pid")]) < 2:
        time.sleep(0.2)
    print("TREE-UP", flush=True)
    proc.wait()
"""

_POOL = """
import os, sys, threading, time
from cpkit.harness.grid import run_cases

def test_starts_a_rank_pool():
    sys.path.insert(0, {out!r})
    threading.Thread(target=run_cases, args=("pool_case:sleep", ["up"], 2), kwargs=dict(timeout=600), daemon=True).start()
    while len([f for f in os.listdir({out!r}) if f.endswith(".pid")]) < 2:
        time.sleep(0.2)
    print("TREE-UP", flush=True)  # a rank's stdout goes to its stderr file, so the test says it
    time.sleep(600)
"""

_POOL_CASE = """
import os, time
def sleep(case):
    open(os.path.join({out!r}, f"rank{{os.environ['RANK']}}.pid"), "w").write(f"{{os.getpid()}} {{os.getpid()}}")
    time.sleep(600)
"""


def _as_in_a_terminal() -> None:
    """The inner run's SIGINT as a foreground run in a terminal has it: a run started in the
    background (`cmd &`, nohup) ignores SIGINT, and the inner run would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.parametrize("tree,stop", [("torchrun", s) for s in ("ctrl-c", "sigterm", "timeout", "sigkill")]
                         + [("pool", "sigkill")])
def test_a_stopped_run_leaves_no_launch_behind(tmp_path, tree, stop):
    """torchrun and its ranks, or a rank pool's ranks (their guard: cpkit.harness.rank_worker.die_with_parent)."""
    (tmp_path / "rank.py").write_text(_RANK)
    (tmp_path / "pool_case.py").write_text(_POOL_CASE.format(out=str(tmp_path)))
    (tmp_path / "test_tree.py").write_text(textwrap.dedent((_RUN if tree == "torchrun" else _POOL).format(out=str(tmp_path))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-n", "0", str(tmp_path / "test_tree.py")]
    if stop == "timeout":
        cmd = ["timeout", "40", *cmd]  # SIGTERM after 40 s, as the command does by default
    run = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, preexec_fn=_as_in_a_terminal)
    pids: list[int] = []
    try:
        seen, deadline = [], time.monotonic() + 180
        while not any("TREE-UP" in line for line in seen):
            if time.monotonic() > deadline or run.poll() is not None or not select.select([run.stdout], [], [], 5)[0]:
                if time.monotonic() > deadline or run.poll() is not None:
                    pytest.fail("the inner run never started its tree:\n" + "".join(seen))
                continue
            seen.append(run.stdout.readline())
        for f in tmp_path.glob("rank*.pid"):
            rank, launcher = map(int, f.read_text().split())
            pids += [rank, launcher]
        pids = sorted(set(pids))
        assert len(pids) == (3 if tree == "torchrun" else 2) and all(_alive(p) for p in pids), pids
        if stop != "timeout":
            run.send_signal({"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[stop])
        run.wait(timeout=90)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], f"left behind after {stop}: {[p for p in pids if _alive(p)]}"
    finally:
        for pid in [run.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        run.wait()


def test_kill_all_ends_each_running_child_even_one_that_ignores_sigterm():
    """`kill_all` SIGTERMs every registered child's session, then SIGKILLs what outlived the grace."""
    from cpkit.harness.children import kill_all, popen_tied, running

    plain = popen_tied(["sleep", "600"], death_signal=0)
    # The child says when its trap is set: a SIGTERM before that ends it with SIGTERM. A fixed
    # sleep here raced the wrapper's Python start-up and bash's on a loaded host.
    stubborn = popen_tied(["bash", "-c", "trap '' TERM; sleep 600 & echo trapped; wait"], death_signal=0,
                          stdout=subprocess.PIPE, text=True)
    assert select.select([stubborn.stdout], [], [], 120)[0], "the stubborn child never set its trap"
    assert stubborn.stdout.readline().strip() == "trapped"
    assert {plain, stubborn} <= set(running())
    start = time.monotonic()
    assert kill_all(grace_s=2.0) >= 2
    assert plain.wait(timeout=10) == -signal.SIGTERM
    assert stubborn.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - start >= 2.0
    assert plain not in running() and stubborn not in running()
    stubborn.stdout.close()


_LEFT_RUNNING = """
import sys
from cpkit.harness.children import popen_tied

def test_starts_a_child_and_returns():
    proc = popen_tied(["sleep", "600"], death_signal=0)  # no guard: only the session's end stops it
    open({out!r}, "w").write(str(proc.pid))
"""


def test_the_plugin_ends_what_a_run_started_when_the_run_finishes(tmp_path):
    """cpkit's pytest plugin calls `kill_all` as the session finishes: a child a test left running
    is gone when pytest exits, without waiting for the starter's death."""
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_left.py").write_text(_LEFT_RUNNING.format(out=str(pid_file)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          "-p", "cpkit.testing.pytest_plugin", str(tmp_path / "test_left.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    pid = int(pid_file.read_text())
    try:
        assert not _alive(pid), f"the child {pid} outlived the run that started it"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
