"""The multi-rank launcher itself: results, failures named by rank, timeouts, case grids."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import cpkit.harness.launch as launch_mod
from cpkit.testing import LaunchTimeout, RankFailure, device, dist_params, launch, run_cases


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.getpid()


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from {bad_rank}")
    dist.barrier()  # the healthy rank waits here until the launcher stops it
    return "unreachable"


def _hang_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(600)
    return dist.get_rank()


def _case(case):
    t = torch.ones(1)
    dist.all_reduce(t)
    # Failures come after the collectives, like a correctness assertion at the end of a case.
    if case == "fail-rank1" and dist.get_rank() == 1:
        raise AssertionError("mismatch on rank 1")
    if case == "fail-all":
        raise AssertionError(f"mismatch on rank {dist.get_rank()}")
    return (case, t.item())


def _fail_before_collective(case):
    # Rank 1 fails before the all_reduce that rank 0 then waits in: only the collective
    # timeout ends that case, and the process group is unusable afterwards.
    if case == "early" and dist.get_rank() == 1:
        raise AssertionError("early failure on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)
    return case


def _crash_on_rank1_late_progress(case):
    # Rank 1 dies without a word; rank 0 finishes the case a little later (its progress
    # arrives while the launcher is deciding whether rank 1 crashed or raised).
    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(1.0)
    return case


def _abort_on_rank1():
    if dist.get_rank() == 1:
        print("a Python line before the crash", file=sys.stderr)
        os.write(2, b"CUDA error: an illegal memory access was encountered (from C)\n")
        os.abort()
    time.sleep(30)  # rank 0 is stopped by the launcher
    return dist.get_rank()


def _segfault_in_case(case):
    t = torch.ones(1)
    dist.all_reduce(t)
    if case == "crash" and dist.get_rank() == 0:
        os.write(2, b"NCCL WARN Cuda failure 'invalid argument' (from C)\n")
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(0.5 if case == "crash" else 0)
    return case


def _exit_zero_on_rank1():
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a result and without an error
    return dist.get_rank()


def _write_pid_and_sleep(pid_dir):
    with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)


def _running(pid):
    """True while `pid` exists and is not a zombie (a reparented child nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_reduce_on_device():
    dev = device()
    t = torch.full((4,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(t)
    return str(dev), t.cpu().tolist()


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.dist
def test_results_come_back_per_rank_and_no_process_survives():
    out = launch(_rank_and_sum, 2, timeout=120)
    assert [(r, s) for r, s, _ in out] == [(0, 3.0), (1, 3.0)]
    time.sleep(0.2)
    assert not any(_pid_alive(pid) for _, _, pid in out)


def _threads_and_cuda_env():
    return torch.get_num_threads(), os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.dist
def test_gloo_ranks_run_on_one_thread_with_cuda_hidden():
    # Ranks with intra-op pools as wide as the machine oversubscribe it (a 32 ms CPU slice per
    # micro-batch in the eval_cp bench on a 64-core GPU host). A gloo rank computes on CPU:
    # one thread, as under torchrun, and no GPU to initialize by accident on a GPU host.
    assert launch(_threads_and_cuda_env, 2, timeout=120) == [(1, "")] * 2


@pytest.mark.dist
def test_gloo_rank_sees_the_gpus_when_asked():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = launch(_threads_and_cuda_env, 2, timeout=120, cuda_visible=True)
    assert [cuda for _, cuda in out] == [visible] * 2


@pytest.mark.dist
def test_raising_rank_is_named_with_traceback_and_others_stopped():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank, 2, args=(1,), timeout=120)
    assert info.value.rank == 1
    assert "rank 1 of 2 failed first" in str(info.value)
    assert "ValueError: boom from 1" in str(info.value)
    assert time.monotonic() - start < 60  # rank 0 was stopped, not left in its barrier


@pytest.mark.dist
def test_hanging_rank_fails_within_timeout_with_stack():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_rank, 2, args=(0,), timeout=15)
    assert time.monotonic() - start < 45
    assert info.value.hung_ranks == [0]
    assert "_hang_on_rank" in str(info.value)  # the stack dump names where it hangs


@pytest.mark.dist
def test_case_grid_reports_each_case_separately():
    cases = ["ok-a", "fail-all", "ok-b", "fail-rank1", "after"]
    res = run_cases(_case, cases, 2, timeout=120)
    assert res["ok-a"].check().values == {0: ("ok-a", 2.0), 1: ("ok-a", 2.0)}
    res["ok-b"].check()
    assert sorted(res["fail-all"].errors) == [0, 1]
    assert sorted(res["fail-rank1"].errors) == [1]
    with pytest.raises(AssertionError, match="mismatch on rank 1"):
        res["fail-rank1"].check()
    # The failures came after the case's last collective: nothing is out of step, later cases run.
    assert res["after"].check().values == {0: ("after", 2.0), 1: ("after", 2.0)}


@pytest.mark.dist
def test_case_grid_after_a_one_sided_failure_before_a_collective_runs_later_cases():
    """A one-sided failure before a collective leaves rank 0 waiting in it: rank 0 is reported
    as stuck within the pool's fail grace (not the collective timeout), and the case after it
    runs on a fresh pool."""
    start = time.monotonic()
    res = run_cases(_fail_before_collective, ["ok", "early", "after"], 2, timeout=120)
    assert time.monotonic() - start < 90
    assert res["ok"].check().values == {0: "ok", 1: "ok"}
    assert "early failure on rank 1" in res["early"].errors[1]
    assert "waiting in a collective" in res["early"].errors[0], res["early"].errors[0]
    assert res["after"].check().values == {0: "after", 1: "after"}


@pytest.mark.dist
def test_crashed_rank_keeps_the_other_ranks_finished_cases():
    """Progress that arrives while a crash is being confirmed is kept, not dropped."""
    res = run_cases(_crash_on_rank1_late_progress, ["a"], 2, timeout=120)
    assert res["a"].values == {0: "a"}
    assert sorted(res["a"].errors) == [1]
    assert "exit code 7" in res["a"].errors[1]


@pytest.mark.dist
def test_rank_killed_by_a_signal_is_reported_with_its_stderr():
    """SIGABRT (what a CUDA or cuDNN abort looks like): the report names the rank, the signal
    and the last lines the rank wrote to stderr, from Python and from C alike."""
    with pytest.raises(RankFailure) as info:
        launch(_abort_on_rank1, 2, timeout=120)
    text = str(info.value)
    assert info.value.rank == 1
    assert "rank 1 of 2 died with exit code -6 (signal 6: SIGABRT)" in text, text
    assert "a Python line before the crash" in text and "illegal memory access was encountered (from C)" in text
    assert "_abort_on_rank1" in text  # faulthandler's stack of the dying rank


@pytest.mark.dist
def test_case_grid_names_the_case_a_crashed_rank_was_running():
    """run_cases: a rank that segfaults in its second case is reported on that case, with its
    rank, the signal, its stderr's last lines; the finished case keeps its results."""
    res = run_cases(_segfault_in_case, ["fine", "crash", "later"], 2, timeout=120)
    assert res["fine"].check().values == {0: "fine", 1: "fine"}
    err = res["crash"].errors[0]
    assert "rank 0 of 2 died" in err and "signal 11: SIGSEGV" in err, err
    assert "Cuda failure 'invalid argument' (from C)" in err and "_segfault_in_case" in err, err
    assert res["later"].check().values == {0: "later", 1: "later"}  # on a fresh pool


@pytest.mark.dist
def test_rank_exiting_without_result_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_exit_zero_on_rank1, 2, timeout=120)
    assert time.monotonic() - start < 60  # not left to the launch timeout
    assert info.value.rank == 1
    assert "without a result" in str(info.value)


@pytest.mark.dist
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    """The launching process is SIGKILLed (a CI job killed, pytest-timeout's thread method):
    its ranks must die with it, not sleep on as orphans."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    driver = (
        "import sys; sys.path.insert(0, %r)\n"
        "from cpkit.testing import launch\n"
        "from functional.test_launcher import _write_pid_and_sleep\n"
        "launch(_write_pid_and_sleep, 2, args=(%r,), timeout=600)\n" % (root, str(tmp_path))
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=root)
    pids = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid")) if p.read_text()]
        assert len(pids) == 2, "the ranks never started"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_running(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:  # the ranks this test started, if the launcher left them behind
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("backend,world_size", dist_params((2, 4)))
def test_all_reduce_smoke(backend, world_size):
    """NCCL (gpu2/gpu4) or gloo (dist) smoke test: each rank on its own device, right sum."""
    out = launch(_all_reduce_on_device, world_size, backend=backend, timeout=120)
    total = float(sum(range(1, world_size + 1)))
    assert [values for _, values in out] == [[total] * 4] * world_size
    expected = [f"cuda:{r}" for r in range(world_size)] if backend == "nccl" else ["cpu"] * world_size
    assert [dev for dev, _ in out] == expected


# A user's loop: the rank function lives in a module that imports megatron-core at the top, so a
# spawned rank prints MCore's import-time notice before any cpkit code runs in it. The notice is
# raised here as MCore raises it (importing MCore itself takes a rank 10-20 s on 2 cores;
# tests/test_cli_output.py checks the real ones).
_USER_MODULE = """
import warnings
warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                       UserWarning, "megatron/core/optimizer/__init__.py", 24, module="megatron.core.optimizer")

def rank_fn():
    warnings.warn("a warning of the user's own", UserWarning)
    return 0
"""

_USER_LOOP = """
import os, sys, warnings
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")  # this process's own: not a rank's
sys.path.insert(0, sys.argv[1])
import user_loop
from cpkit.testing import launch
before = os.environ.get("PYTHONWARNINGS")
assert launch(user_loop.rank_fn, 2, timeout=240) == [0, 0]
assert os.environ.get("PYTHONWARNINGS") == before, "the launch must leave the environment as it was"
"""


@pytest.mark.dist
def test_ranks_print_no_mcore_notices_and_keep_other_warnings(tmp_path):
    (tmp_path / "user_loop.py").write_text(_USER_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", _USER_LOOP, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "not installed" not in proc.stderr, proc.stderr
    assert proc.stderr.count("UserWarning: a warning of the user's own") == 2, proc.stderr


@pytest.mark.dist
def test_a_rank_failing_to_join_is_marked_joining_and_not_retried(monkeypatch):
    """A joining failure that is not gloo's mesh flake (cpkit.harness.rendezvous) is reported at once."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "cpkit-no-such-interface")
    attempts = []
    real_once = launch_mod._launch_once
    monkeypatch.setattr(launch_mod, "_launch_once", lambda *a: attempts.append(1) or real_once(*a))
    with pytest.raises(RankFailure) as info:
        launch(_rank_and_sum, 2, timeout=120)
    assert info.value.joining and "cpkit-no-such-interface" in str(info.value)
    assert len(attempts) == 1
