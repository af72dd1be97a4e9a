"""pytest integration: markers, skips for GPU tests where the GPUs are missing, test files
spread over xdist workers on hosts with many cores, and the `world1` fixture (a world-size-1 gloo
process group for one-process tests, on CPU or one GPU).

Loaded through `-p cpkit.testing.pytest_plugin` in pyproject's addopts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile

import pytest

from cpkit.devices import cuda_device_count

__all__ = ["GPU_MARKERS", "cuda_device_count", "auto_workers", "world1", "xdist_group_of"]

GPU_MARKERS = {"gpu1": 1, "gpu2": 2, "gpu4": 4}


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: multi-process test on CPU with gloo")
    config.addinivalue_line("markers", "gpu1: device test that needs 1 CUDA device (kernels, merge, sharding)")
    config.addinivalue_line("markers", "gpu2: NCCL test that needs at least 2 CUDA devices")
    config.addinivalue_line("markers", "gpu4: NCCL test that needs at least 4 CUDA devices")
    config.addinivalue_line("markers", "cpkit_grid(scenario, cases_for, timeout): the rank-pool grid of a case")
    config.addinivalue_line("markers", "cpkit_prefetch(start): a callable the session calls once at its first "
                                       "test, to start work in the background (the NCCL examples)")


RANKS_PER_TEST = 4
"""The most ranks one CPU-tier test starts (each with one intra-op thread)."""


def auto_workers(cpus: int) -> int:
    """xdist workers for a host with `cpus` cores: none below 8 cores (CI's 2 cores run one
    process, as before), else as many as fit without oversubscribing: cpus // RANKS_PER_TEST."""
    return cpus // RANKS_PER_TEST if cpus >= 8 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """On a many-core host (a GPU machine) spread the suite over xdist workers, so that the
    README's plain `python3 -m pytest` is not slower there than on CI's 2 cores: one xdist group
    per test file (a file's case grid shares one launch), per file and GPU count for the NCCL
    tests (xdist_group_of, by GridScheduling), so that a 2-GPU grid runs beside another file's on the other GPUs
    (each NCCL launch claims its GPUs: cpkit.harness.gpu_claim). `-n N` (`-n 0`: none) overrides."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is not None or config.getoption("usepdb", False):
        return
    workers = auto_workers(os.cpu_count() or 1)
    if workers >= 2:
        config.option.numprocesses = workers
        config.option.dist = "loadscope"
        config.option.tx = ["popen"] * workers
        config._cpkit_grid_scheduling = True


def pytest_xdist_make_scheduler(config, log):
    """The scheduler of an auto-spread run: xdist's load-scope scheduling with the scope of
    `xdist_group_of` read off the node id alone (controller side). xdist's own `loadgroup` moves
    the group into `item._nodeid`, which pytest 9 no longer reads, so every test went to any
    worker and each worker started its own copy of a file's NCCL grid (8 launches of one grid
    on 4x H100)."""
    if not getattr(config, "_cpkit_grid_scheduling", False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GridScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid, _gpu_count_of(nodeid))

    return GridScheduling(config, log)


def _gpu_count_of(nodeid: str) -> list[str]:
    """The gpu2/gpu4 marker a functional test's node id implies: its parameter id starts with
    the backend and world size (`dist_params`: nccl2, nccl4); [] for anything else."""
    match = re.search(r"\[nccl(\d+)", nodeid)
    return [f"gpu{4 if int(match.group(1)) > 2 else 2}"] if match else []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    order_for_pools(items)
    for item in items:
        for name, needed in GPU_MARKERS.items():
            if item.get_closest_marker(name) is None:
                continue
            found = cuda_device_count()
            if found < needed:
                noun = "device" if needed == 1 else "devices"
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA {noun}, found {found}"))


def pytest_collection_finish(session):
    """Register every grid case the session runs (after every deselection) with its test: a
    recorded coverage map credits each case to its own test, and a grid runs only the cases of
    the tests collected (cpkit.harness.attribution)."""
    from cpkit.harness.attribution import clear_case_tests, register_case_test

    clear_case_tests()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"backend", "world_size", "case_id"} <= set(params):
            register_case_test(item.nodeid, params["backend"], params["world_size"], params["case_id"])


def xdist_group_of(nodeid: str, gpu_markers: list[str]) -> str:
    """The xdist group of a test: its file; every gpu1 test in one group (they run in the
    worker's own process, on its first GPU); every gpu2/gpu4 test in one group too, so that one
    worker owns the host's rank pools and spreads the grids over the GPUs itself
    (cpkit.harness.grid.PoolSet: disjoint GPU slices, no claims between workers)."""
    path = nodeid.split("::")[0]
    if "gpu1" in gpu_markers:
        return "gpu1"
    return "nccl" if any(m != "gpu1" for m in gpu_markers) else path


def nccl_world_size(item) -> int | None:
    """The NCCL world size a collected test runs at (its backend/world_size params), or None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("world_size") if params.get("backend") == "nccl" else None


def order_for_pools(items: list) -> None:
    """NCCL tests after the rest, smallest world size first (stable otherwise): every 2-GPU grid
    runs while the 2-GPU pools are up, side by side, then the 3- and 4-GPU grids."""
    items.sort(key=lambda item: (nccl_world_size(item) or 0))


def _will_skip(item) -> bool:
    from _pytest.skipping import evaluate_skip_marks  # pytest's own reading of skip/skipif

    return evaluate_skip_marks(item) is not None


def prefetch_grids(items) -> int:
    """Start the NCCL grids of `items` that will run (not skipped) in the background; how many."""
    from cpkit.harness.grid import default_pools
    from cpkit.testing.params import grid_spec_of

    specs = {}
    for item in items:
        if nccl_world_size(item) is None or _will_skip(item):
            continue
        spec = grid_spec_of(item)
        if spec is not None:  # credited per case to its own test (cpkit.harness.attribution.case_test_id)
            specs.setdefault(spec.key, dataclasses.replace(spec, test_id=item.nodeid))
    starters = {}
    for item in items:
        mark = item.get_closest_marker("cpkit_prefetch")
        if mark is not None and not _will_skip(item):
            starters.setdefault(mark.kwargs["start"], None)
    default_pools().prefetch(specs.values())
    for start in starters:  # after the grids: their pools start first, examples beside them
        start()
    return len(specs)


_prefetched = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Start every NCCL grid of the session in the background, once per process (under xdist
    only one worker runs NCCL tests: xdist_group_of puts them in one group)."""
    global _prefetched
    if _prefetched:
        return
    # An xdist worker waits for its first NCCL test (one worker gets them all); a single process
    # starts them with its first test, so the GPUs work while the CPU tiers run.
    if os.environ.get("PYTEST_XDIST_WORKER") and (nccl_world_size(item) is None or _will_skip(item)):
        return
    _prefetched = True
    prefetch_grids(item.session.items)


def pytest_sessionfinish(session):
    """End every launch the run started (torchrun examples and clusters, Ctrl-C included: the
    launches' own guard covers a killed run, cpkit.harness.children), close this process's rank pools
    (bounded) and log their start-ups into the timing table."""
    import sys

    children = sys.modules.get("cpkit.harness.children")
    if children is not None:
        children.kill_all()
    grid = sys.modules.get("cpkit.harness.grid")
    if grid is None or grid._default is None:
        return
    from cpkit.harness.launch_times import record_times

    record_times([dict(pool=True, **s) for s in grid._default.stats()])
    grid._default.close()


@pytest.fixture(scope="session")
def world1():
    """torch.distributed initialized on gloo with world size 1 (FileStore: xdist-safe)."""
    import torch.distributed as dist  # here, so that loading the plugin does not import torch

    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="cpkit-world1-"), "store")
        dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield dist.group.WORLD
