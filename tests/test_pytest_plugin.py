"""The pytest plugin's worker choice: many-core hosts spread the suite, CI's 2 cores do not."""

import os
from types import SimpleNamespace

import pytest

from cpkit.testing import pytest_plugin


@pytest.mark.parametrize("cpus,workers", [(1, 0), (2, 0), (4, 0), (7, 0), (8, 2), (16, 4), (64, 16)])
def test_auto_workers_never_oversubscribe(cpus, workers):
    assert pytest_plugin.auto_workers(cpus) == workers


class _Config:
    def __init__(self, numprocesses=None, xdist=True):
        self.option = SimpleNamespace(numprocesses=numprocesses, dist="no", tx=[], usepdb=False)
        self.pluginmanager = SimpleNamespace(hasplugin=lambda name: xdist and name == "xdist")

    def getoption(self, name, default=None):
        return getattr(self.option, name, default)


def test_many_core_host_groups_files_over_workers(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(pytest_plugin.os, "cpu_count", lambda: 16)
    config = _Config()
    pytest_plugin.pytest_cmdline_main(config)
    assert (config.option.numprocesses, config.option.dist, config.option.tx) == (4, "loadscope", ["popen"] * 4)


GRID_FILE = """
import os, pytest
@pytest.mark.parametrize("case", ["nccl2-a", "nccl2-b", "nccl4-a", "nccl4-b", "gloo2-a", "gloo2-b"])
def test_case(case):
    with open(os.environ["WORKERS_LOG"], "a") as fh:
        fh.write(case + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
@pytest.mark.parametrize("case", ["nccl2-c", "gloo2-c"])
def test_other(case):
    test_case(case)
"""


def test_an_auto_spread_run_keeps_each_grid_on_one_worker(tmp_path):
    """End to end, as on a GPU host (16 cores): every test of one file and GPU count runs in one
    worker, so a file's NCCL grid (one launch for all its cases) starts once; xdist's own
    loadgroup spread them over every worker under pytest 9 (`pytest_xdist_make_scheduler`)."""
    import subprocess
    import sys

    (tmp_path / "test_grid.py").write_text(GRID_FILE)
    log = tmp_path / "workers.log"
    code = ("import os, sys, pytest; os.cpu_count = lambda: 16; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'cpkit.testing.pytest_plugin', {str(tmp_path / 'test_grid.py')!r}]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "WORKERS_LOG": str(log)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers = {}
    for line in log.read_text().split("\n"):
        if line:
            case, worker = line.split()
            workers.setdefault(case.split("-")[0], set()).add(worker)
    assert set(workers) == {"nccl2", "nccl4", "gloo2"}
    assert all(len(ws) == 1 for name, ws in workers.items() if name.startswith("nccl")), workers


@pytest.mark.parametrize("config,cpus", [(_Config(numprocesses=0), 16), (_Config(xdist=False), 16), (_Config(), 2)],
                         ids=["user-chose-n0", "xdist-disabled", "two-cores"])
def test_explicit_choice_or_small_host_is_left_alone(config, cpus, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(pytest_plugin.os, "cpu_count", lambda: cpus)
    pytest_plugin.pytest_cmdline_main(config)
    assert config.option.dist == "no" and config.option.tx == []


def _grid_scenario(case):
    return case


def test_a_prefetched_grid_credits_its_cases_to_the_first_test_that_reads_it(monkeypatch):
    """The coverage map must credit a background grid's cases to the test that reads them,
    not to whichever test happens to be current while the grid runs."""
    import threading

    from cpkit.harness.grid import GridSpec, PoolSet
    from cpkit.harness.rank_pool import CaseRun
    from cpkit.testing import params

    sent = []

    class FakePool:
        def run(self, fn, case, timeout, *, test_id=None):
            sent.append((case, test_id))
            return CaseRun()

    spec = GridSpec(_grid_scenario, ("a", "b"), "nccl", 2, 60.0)
    items = [SimpleNamespace(nodeid=f"functional/test_x.py::test_case[nccl-2-{c}]",
                             callspec=SimpleNamespace(params={"backend": "nccl", "world_size": 2}),
                             get_closest_marker=lambda name: None)
             for c in ("a", "b")]
    prefetched = []
    monkeypatch.setattr(pytest_plugin, "_will_skip", lambda item: False)
    monkeypatch.setattr(params, "grid_spec_of", lambda item: spec)
    monkeypatch.setattr("cpkit.harness.grid.default_pools", lambda: SimpleNamespace(prefetch=prefetched.extend))
    assert pytest_plugin.prefetch_grids(items) == 1
    assert [s.test_id for s in prefetched] == [items[0].nodeid] and prefetched[0].key == spec.key

    pools = PoolSet(gpu_ids=["0", "1"])
    monkeypatch.setattr(pools, "pool", lambda *a: (FakePool(), threading.Lock()))
    monkeypatch.setenv("CPKIT_COVERAGE_CONTEXT", "tests/test_some_other.py::test_current")
    pools.run_grid(prefetched[0])
    assert sent == [("a", items[0].nodeid), ("b", items[0].nodeid)]


def test_prefetch_spreads_the_cases_of_a_grid_over_every_pool_of_its_size(monkeypatch):
    """Cases, not grids, are balanced: one grid's cases run on every pool of its world size (two
    GPU slices x two pools each here), each credited to the grid's test, and the grid's result
    holds every case once."""
    import threading
    import time

    from cpkit.harness.grid import GridSpec, PoolSet
    from cpkit.harness.rank_pool import CaseRun

    ran: dict = {}
    closed: list = []

    class FakePool:
        def __init__(self, key):
            self.key = key

        def run(self, fn, case, timeout, *, test_id=None):
            time.sleep(0.05)  # long enough that every pool takes a share
            ran.setdefault(self.key, []).append((case, test_id))
            return CaseRun(values={0: case, 1: case}, seconds=0.05)

        def close(self):
            closed.append(self.key)

    made = {}

    def pool(backend, world_size, gpu_slice=None, index=0):
        key = (backend, world_size, gpu_slice, index)
        made.setdefault(key, (FakePool(key), threading.Lock()))
        return made[key]

    monkeypatch.setenv("CPKIT_POOLS_PER_SLICE", "2")
    pools = PoolSet(gpu_ids=["0", "1", "2", "3"])
    monkeypatch.setattr(pools, "pool", pool)
    spec = GridSpec(_grid_scenario, tuple(f"c{i}" for i in range(24)), "nccl", 2, 60.0, test_id="t::x")
    pools.prefetch([spec])
    results = pools.result(spec)
    assert sorted(results) == sorted(spec.cases) and all(r.values[0] == cid for cid, r in results.items())
    assert set(ran) == {("nccl", 2, s, i) for s in ("0,1", "2,3") for i in (0, 1)}, sorted(ran)
    assert sorted(c for cases in ran.values() for c, _ in cases) == sorted(spec.cases)
    assert {t for cases in ran.values() for _, t in cases} == {"t::x"}
    assert sorted(closed) == sorted(ran), "a pool whose queue ran dry closes"

    # A pool whose queue ran dry starts one for the world size with the most cases left.
    ran.clear()
    monkeypatch.setenv("CPKIT_POOLS_PER_SLICE", "1")
    small = GridSpec(_grid_scenario, ("s0", "s1"), "nccl", 2, 60.0)
    large = GridSpec(_grid_scenario, tuple(f"l{i}" for i in range(60)), "nccl", 4, 60.0)
    pools = PoolSet(gpu_ids=["0", "1", "2", "3"])
    monkeypatch.setattr(pools, "pool", pool)
    made.clear()
    pools.prefetch([small, large])
    assert sorted(pools.result(large)) == sorted(large.cases) and sorted(pools.result(small)) == ["s0", "s1"]
    helpers = {k for k in ran if k[1] == 4 and k[3] > 0}
    assert helpers, f"no 4-rank pool was started when the 2-rank queue ran dry: {sorted(ran)}"


def test_pools_per_slice_refuses_a_bad_value_with_the_fix(monkeypatch):
    from cpkit.harness.grid import pools_per_slice

    monkeypatch.setenv("CPKIT_POOLS_PER_SLICE", "0")
    with pytest.raises(ValueError, match=r"CPKIT_POOLS_PER_SLICE='0': must be a whole number >= 1; e.g. CPKIT_POOLS_PER_SLICE=1"):
        pools_per_slice()
    monkeypatch.setenv("CPKIT_POOLS_PER_SLICE", "1")
    assert pools_per_slice() == 1


@pytest.mark.parametrize("gpus, cpus, expected", [
    (4, 64, 2),   # 4 GPUs, 16 cores each, three world sizes share each GPU: the floor of 2
    (2, 32, 4),   # 2 GPUs run only world size 2: 16 cores a GPU leave room for 4 pools
    (2, 12, 1),   # 6 cores a GPU: one pool
    (8, 128, 2),  # 16 cores a GPU, three world sizes
    (3, 96, 4),   # 32 cores a GPU, world sizes 2 and 3: capped at MAX_POOLS_PER_SLICE
])
def test_pools_per_slice_follows_the_cores_left_per_world_size(monkeypatch, gpus, cpus, expected):
    import cpkit.harness.grid as grid

    monkeypatch.delenv("CPKIT_POOLS_PER_SLICE", raising=False)
    monkeypatch.setattr(grid, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(grid.os, "cpu_count", lambda: cpus)
    assert grid.pools_per_slice() == expected


def test_closing_several_pools_waits_one_grace_not_one_per_pool(monkeypatch):
    """close_pools asks every pool's ranks to leave first, then joins them against one shared
    deadline: ranks that never leave cost one grace in all, then a kill."""
    import cpkit.harness.rank_pool as rank_pool

    clock = [0.0]
    monkeypatch.setattr(rank_pool.time, "monotonic", lambda: clock[0])

    class Stuck:  # a rank process that never exits: join waits out its timeout
        def join(self, timeout):
            clock[0] += timeout

    class Pool:
        def __init__(self):
            self.procs, self.sent, self.killed = [Stuck(), Stuck()], [], False

        def _send_all(self, message):
            self.sent.append((message, clock[0]))

        def kill(self):
            self.killed = True

    pools = [Pool() for _ in range(3)]
    rank_pool.close_pools(pools, grace_s=5.0)
    assert clock[0] == 5.0, f"closing 3 stuck pools took {clock[0]} s of a 5 s grace"
    assert all(p.sent == [(("exit",), 0.0)] and p.killed for p in pools)
