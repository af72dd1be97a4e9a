"""The persistent rank pools themselves (cpkit.harness.rank_pool, cpkit.harness.grid) on gloo: what a failing,
dying, hanging, skipping, noisy or leaking case does to its own result and to the cases after it.
Each test fails on a pool that lacks the property it names."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from cpkit.harness.grid import CaseFailed, GridSpec, PoolSet, run_cases
from cpkit.harness.rank_pool import RankPool

pytestmark = pytest.mark.dist
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sum_case(case):
    """Every case all-reduces; the named misbehaviour happens on rank 1 after that collective."""
    t = torch.ones(1)
    dist.all_reduce(t)
    me = dist.get_rank()
    if case == "assert-rank1" and me == 1:
        raise AssertionError("wrong result on rank 1")
    if case == "config-error" and me == 1:
        raise ValueError("seq_length=4096: must be divisible by 2*cp = 6")
    if case == "exit-rank1" and me == 1:
        os.write(2, b"rank 1 says goodbye on stderr\n")
        os._exit(3)
    if case == "sigkill-rank1" and me == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if case == "hang-rank1" and me == 1:
        time.sleep(600)
    if case == "early-rank1":  # rank 1 fails BEFORE a collective rank 0 then waits in
        if me == 1:
            raise AssertionError("early failure on rank 1")
        dist.all_reduce(t)
    if case == "skip-rank1" and me == 1:
        pytest.skip("not on rank 1")
    if case == "skip-all":
        pytest.skip("nothing to run here")
    if case == "noisy":
        print("NCCL INFO a banner on stdout\n" * 50, flush=True)
        os.write(1, b"\x80\x03garbage that looks like a pickle\n")
    return (case, t.item(), os.getpid())


@pytest.fixture(scope="module")
def pools():
    pools = PoolSet()
    yield pools
    pools.close()


def _pool(pools) -> RankPool:
    return pools.pool("gloo", 2)[0]


def _grid(pools, cases, timeout=120.0):
    return pools.run_grid(GridSpec(_sum_case, tuple(cases), "gloo", 2, timeout))


def test_an_assertion_on_one_rank_fails_its_case_only_and_keeps_the_pool(pools):
    res = _grid(pools, ["ok-a", "assert-rank1", "ok-b"])
    assert res["ok-a"].check().values[0][:2] == ("ok-a", 2.0)
    with pytest.raises(AssertionError, match="wrong result on rank 1"):
        res["assert-rank1"].check()
    assert res["assert-rank1"].values[0][:2] == ("assert-rank1", 2.0)  # rank 0 finished it
    assert res["ok-b"].check().values[1][:2] == ("ok-b", 2.0)
    pids = {v[2] for r in ("ok-a", "ok-b") for v in res[r].values.values()}
    assert len(pids) == 2, "the one-sided assertion must not cost a respawn"


def test_a_config_error_is_never_an_assertion(pools):
    """A strict xfail expects AssertionError: a rank's ValueError must raise CaseFailed."""
    res = _grid(pools, ["config-error"])
    with pytest.raises(CaseFailed, match="divisible by 2\\*cp"):
        res["config-error"].check()


@pytest.mark.parametrize("death", ["exit-rank1", "sigkill-rank1"])
def test_a_dying_rank_is_named_and_the_next_case_gets_a_fresh_pool(pools, death):
    if not _pool(pools).alive:  # run alone or first: the grid's own first start is not a respawn
        _pool(pools).start()
    starts = _pool(pools).starts
    res = _grid(pools, ["ok-a", death, "ok-b"])
    err = res[death].errors[1]
    assert "rank 1 of 2 died with exit code" in err, err
    assert ("exit code 3" in err and "goodbye on stderr" in err) if death == "exit-rank1" else "SIGKILL" in err
    res["ok-b"].check()
    assert res["ok-b"].values[0][2] != res["ok-a"].values[0][2]  # rank 0 was replaced too
    assert _pool(pools).starts == starts + 1


def test_a_hanging_rank_hits_the_deadline_with_its_stack_and_later_cases_run(pools):
    started = time.monotonic()
    pool = _pool(pools)
    res = pool.run(_sum_case, "hang-rank1", timeout=8.0)
    assert time.monotonic() - started < 40
    assert "the case's deadline" in res.errors[1] and "_sum_case" in res.errors[1], res.errors
    assert res.values[0][:2] == ("hang-rank1", 2.0)
    assert pool.run(_sum_case, "ok", timeout=120).values[1][:2] == ("ok", 2.0)


def test_ranks_stuck_after_a_one_sided_failure_fail_fast_not_at_the_collective_timeout(pools):
    started = time.monotonic()
    res = _grid(pools, ["early-rank1", "after"])
    assert time.monotonic() - started < 60  # the fail grace, not the 120 s collective timeout
    assert "early failure on rank 1" in res["early-rank1"].errors[1]
    assert "waiting in a collective" in res["early-rank1"].errors[0], res["early-rank1"].errors[0]
    res["after"].check()


def test_skips_on_every_rank_skip_and_a_partial_skip_fails_without_blinding_later_cases(pools):
    res = _grid(pools, ["skip-all", "skip-rank1", "ok"])
    with pytest.raises(pytest.skip.Exception, match="nothing to run here"):
        res["skip-all"].check()
    with pytest.raises(CaseFailed, match=r"skipped on rank\(s\) \[1\] only"):
        res["skip-rank1"].check()
    res["ok"].check()


def test_noisy_stdout_does_not_corrupt_the_channel(pools):
    res = _grid(pools, ["noisy", "ok"])
    assert res["noisy"].check().values[0][:2] == ("noisy", 2.0)
    res["ok"].check()


def _state_case(case):
    """'dirty' leaves state behind; 'look' reports what it finds."""
    import megatron.core.parallel_state as ps  # noqa: F401 - imported so the reset sees MCore

    if case == "dirty":
        os.environ["CPKIT_LEFT_BEHIND"] = "1"
        torch.set_default_dtype(torch.float64)
        ps.initialize_model_parallel(context_parallel_size=2)
        ps._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = [dist.new_group([0, 1])]  # an a2a+p2p layout leaves it set
        dist.new_group([0, 1])
        return None
    return dict(env=os.environ.get("CPKIT_LEFT_BEHIND"), dtype=str(torch.get_default_dtype()),
                mcore=ps.model_parallel_is_initialized(), draw=torch.rand(3).tolist(), py=random.random(),
                hcp=getattr(ps, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", None) is None)


def test_each_case_starts_from_a_clean_slate(pools):
    res = pools.run_grid(GridSpec(_state_case, ("look-before", "dirty", "look"), "gloo", 2, 180.0))
    before, after = res["look-before"].check().values[0], res["look"].check().values[0]
    res["dirty"].check()
    assert after == before  # env, dtype, MCore, RNG draws: as before the dirty case
    assert after["env"] is None and after["mcore"] is False and after["dtype"] == "torch.float32" and after["hcp"]


def test_random_order_gives_the_same_results(pools):
    order = ["look-a", "dirty", "look-b", "look-c"]
    first = pools.run_grid(GridSpec(_state_case, tuple(order), "gloo", 2, 180.0))
    shuffled = pools.run_grid(GridSpec(_state_case, tuple(reversed(order)), "gloo", 2, 180.0))
    for cid in order:
        assert first[cid].check().values == shuffled[cid].check().values, cid


def _leaky_case(case):
    """'leak' makes the clean-up find 1 GiB more held than before the case (what a module-level
    list of CUDA tensors looks like to it; CPU ranks hold no GPU memory to leak for real)."""
    import cpkit.harness.rank_worker as worker

    if case == "leak":
        worker._held_bytes = lambda device: 1 << 30
    return os.getpid()


def test_a_leak_fails_the_case_that_leaked_and_retires_the_pool(pools):
    res = pools.run_grid(GridSpec(_leaky_case, ("fine", "leak", "after"), "gloo", 2, 180.0))
    res["fine"].check()
    with pytest.raises(CaseFailed, match=r"leak: the case left behind 1024 MiB more GPU memory"):
        res["leak"].check()
    assert res["after"].check().values[0] != res["fine"].values[0]  # a fresh pool, no leak left
    assert _pool(pools).retired["leak"] >= 1


def _frozen_case(case):
    """The clean-up's collection: what survived the first case is frozen (later collections skip
    it); 'frozen-garbage' holds 1 GiB while anything is frozen, as a frozen garbage cycle holding
    CUDA tensors would, and none once the clean-up unfreezes to look again."""
    import gc

    import cpkit.harness.rank_worker as worker

    if case == "frozen-garbage":
        worker._real_held_bytes = worker._held_bytes
        worker._held_bytes = lambda device: (1 << 30) if gc.get_freeze_count() else 0
    if case == "after":
        worker._held_bytes = worker.__dict__.pop("_real_held_bytes", worker._held_bytes)
    return gc.get_freeze_count(), os.getpid()


def test_the_clean_up_freezes_survivors_and_never_names_frozen_garbage_a_leak(pools):
    """A full collection over torch's and MCore's objects cost 0.1-0.3 s per rank and case; the
    survivors of a clean-up are frozen instead, and a leak check that fails looks again unfrozen."""
    pools.run_grid(GridSpec(_probe_case, ("drop",), "gloo", 2, 60.0))  # a fresh grid: a clean baseline
    res = pools.run_grid(GridSpec(_frozen_case, ("first", "second", "frozen-garbage", "after"), "gloo", 2, 120.0))
    assert all(frozen > 0 for frozen, _ in res["second"].check().values.values()), res["second"].values
    res["frozen-garbage"].check()  # not a leak
    assert res["after"].check().values[0][1] == res["first"].check().values[0][1]  # the pool was not retired


_STALE_OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from cpkit.harness.grid import GridSpec, PoolSet
from functional.test_rank_pool import _sum_case
pools = PoolSet()
pools.run_grid(GridSpec(_sum_case, ("ok",), "gloo", 2, 120.0))
print("UP", flush=True)
time.sleep(600)
"""


def test_a_pool_starts_cleanly_after_another_owner_was_killed(tmp_path):
    """A killed owner leaves its rendezvous files behind (no clean-up ran); the next pool must not
    read them (each pool rendezvouses in a fresh directory)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    owner = subprocess.Popen([sys.executable, "-c", _STALE_OWNER.format(root=ROOT)], stdout=subprocess.PIPE,
                             text=True, env=env, cwd=ROOT)
    try:
        assert owner.stdout.readline().strip() == "UP"
        owner.kill()
        owner.wait()
        assert any(p.name.startswith("cpkit-pool-") for p in tmp_path.iterdir()), "no stale rendezvous left"
        proc = subprocess.run([sys.executable, "-c", _STALE_OWNER.format(root=ROOT).replace("time.sleep(600)", "")],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
        assert proc.returncode == 0 and "UP" in proc.stdout, proc.stderr[-3000:]
    finally:
        owner.kill()


_HUNG_SESSION = """
import time
from cpkit.harness.grid import GridSpec, default_pools
from functional.test_rank_pool import _sum_case

def test_leaves_a_hung_grid_behind():
    default_pools().prefetch([GridSpec(_sum_case, ("hang-rank1",), "gloo", 2, 600.0)])
    time.sleep(8)  # rank 1 is now asleep in its case
"""


def test_pytest_exits_promptly_with_a_hung_rank(tmp_path):
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(_HUNG_SESSION))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           str(tmp_path / "test_hung.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - started < 60, "pytest waited for the hung rank"


def test_run_cases_runs_on_the_process_pool():
    """Two grids of one size share one pool: start-up is paid once."""
    a = run_cases(_sum_case, ["x"], 2, timeout=120)["x"].check().values
    b = run_cases(_sum_case, ["y"], 2, timeout=120)["y"].check().values
    assert {v[2] for v in a.values()} == {v[2] for v in b.values()}


_LAST_CASE = 499
_LAYOUTS = ({"tensor_model_parallel_size": 2}, {"context_parallel_size": 2}, {"context_parallel_size": 1})


def _running_threads(me: int) -> int:
    """Threads of this process in state R now, this one aside."""
    running = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        running += state == "R" and int(tid) != me
    return running


def _threads_and_groups(looks: int = 1) -> dict:
    """This rank's threads (all, and those that stay runnable with nothing to do), live groups.

    One look at /proc catches threads that are still finishing the case's last collective, or
    waiting for a core on a loaded machine (CI saw 5 once); a thread that polls or spins is
    runnable in every look, so the fewest over `looks` looks 10 ms apart is what counts."""
    import threading

    from cpkit.harness.pool_groups import live_groups

    me = threading.get_native_id()
    running = []
    for _ in range(looks):
        running.append(_running_threads(me))
        time.sleep(0.01)
    tasks = os.listdir("/proc/self/task")
    return dict(threads=len(tasks), running=min(running), groups=len(live_groups()))


def _layout_case(i):
    """What a scenario does to groups: MCore's layout groups (its gloo groups too), cpkit's
    builder, a raw new_group twice over the same ranks, a collective on each; a different
    layout each time, so that every case asks for groups an earlier case made."""
    import megatron.core.parallel_state as ps

    from cpkit.parallel.groups import build_pg_collection
    from cpkit.parallel.layout import CPLayout

    ps.initialize_model_parallel(**_LAYOUTS[i % len(_LAYOUTS)])
    cp = 1 + i % 2
    pgs = build_pg_collection(CPLayout(world_size=2, cp=cp, seq_length=64))
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    assert a is not b, "two requests in one case must get two groups"
    t, expected = torch.ones(1), 1
    for group in (a, b, pgs.cp, ps.get_data_parallel_group(with_context_parallel=True)):
        dist.all_reduce(t, group=group)
        expected *= dist.get_world_size(group)
    assert t.item() == expected, (t.item(), expected)
    return dict(_threads_and_groups(looks=20 if i == _LAST_CASE else 1), pid=os.getpid())


def _probe_case(case):
    return _threads_and_groups()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads threads and CPU time from /proc")
def test_groups_threads_and_cpu_stay_flat_over_500_cases():
    """Cases that build the same layouts again reuse the pool's groups: threads, running threads
    and live groups per rank are the same after case 500 as after the first round of layouts,
    and the ranks never respawn; after the grid the pool keeps only its world group, and its
    idle ranks use next to no CPU (kept gloo groups took a 2-core machine's load past 800)."""
    pools = PoolSet()
    try:
        cases = list(range(_LAST_CASE + 1))
        res = pools.run_grid(GridSpec(_layout_case, tuple(cases), "gloo", 2, 900.0))
        for i in cases:
            res[str(i)].check()
        warm = res[str(2 * len(_LAYOUTS))].values
        last = res[str(cases[-1])].values
        for r in (0, 1):
            assert last[r]["pid"] == warm[r]["pid"], "the pool was respawned: groups must not force that"
            assert last[r]["groups"] == warm[r]["groups"], (r, warm[r], last[r])
            assert last[r]["threads"] == warm[r]["threads"], (r, warm[r], last[r])
            assert last[r]["running"] <= 2, (r, last[r])
        # Between grids a gloo pool frees its kept groups: an idle gloo group's TCP loop polls
        # (about 1 ms of CPU a second each), and 40 of them made an idle rank use 4% of a core.
        idle = pools.run_grid(GridSpec(_probe_case, ("idle",), "gloo", 2, 60.0))["idle"].check().values
        for r in (0, 1):
            assert idle[r]["groups"] == 1 and idle[r]["threads"] < warm[r]["threads"], (r, idle[r], warm[r])
        pool = pools.pool("gloo", 2)[0]
        pids = [p.pid for p in pool.procs]
        before = [_cpu_seconds(pid) for pid in pids]
        time.sleep(3.0)
        used = [_cpu_seconds(pid) - b for pid, b in zip(pids, before)]
        assert max(used) <= 0.06, f"idle pool ranks used {used} CPU-seconds in 3 s"
    finally:
        pools.close()


def _half_done_case(case):
    """Rank 1 fails before a new_group that rank 0 makes: their group counts differ afterwards."""
    if case == "diverge":
        if dist.get_rank() == 1:
            raise AssertionError("rank 1 stops before the group")
        return dist.new_group([0]) is not None  # not collective for a group of one on gloo
    return os.getpid()


def test_ranks_whose_group_counts_differ_get_a_fresh_pool(pools):
    """After a case that made groups on some ranks only, the next new_group would pair different
    groups across ranks (c10d names them by count): the pool retires instead."""
    res = pools.run_grid(GridSpec(_half_done_case, ("before", "diverge", "after"), "gloo", 2, 120.0))
    with pytest.raises(AssertionError, match="rank 1 stops before the group"):
        res["diverge"].check()
    assert res["after"].check().values[0] != res["before"].check().values[0]
    assert _pool(pools).retired["group counts differ"] >= 1


def _crossed_collectives_case(case):
    """Two groups with MCore's 30-minute timeout: rank 0 all-reduces on the first, rank 1 on the
    second, so each waits for a peer that waits elsewhere (as pipeline stages that reduce
    different numbers of losses do)."""
    import datetime

    groups = [dist.new_group([0, 1], timeout=datetime.timedelta(minutes=30)) for _ in range(2)]
    dist.all_reduce(torch.ones(1), group=groups[dist.get_rank()])
    return case


def test_crossed_collectives_raise_at_the_pools_timeout_not_the_groups():
    """A gloo pool caps the timeout of the groups a case makes at its own collective timeout: a
    fault that leaves the ranks in different collectives raises there, with its traceback, long
    before the 30 minutes MCore asks for or the case's deadline."""
    pool = RankPool(2, "gloo", pg_timeout_s=5.0)
    try:
        pool.start()
        start = time.monotonic()
        run = pool.run(_crossed_collectives_case, "crossed", timeout=120.0)
        seconds = time.monotonic() - start
        assert set(run.errors) == {0, 1}, run
        assert all("all_reduce" in run.errors[r] and "deadline" not in run.errors[r] for r in (0, 1)), run.errors
        assert seconds < 60.0, f"the ranks waited {seconds:.0f} s: the groups kept their 30-minute timeout"
    finally:
        pool.close()
