"""pytest integration: markers, skips for GPU tests where the GPUs are missing, test files
spread over xdist workers on hosts with many cores, and the `world1` fixture (a world-size-1 gloo
process group for one-process tests, on CPU or one GPU).

Loaded through `-p cpkit.testing.pytest_plugin` in pyproject's addopts.
"""

from __future__ import annotations

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
    (each NCCL launch claims its GPUs: cpkit.gpu_claim). `-n N` (`-n 0`: none) overrides."""
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
    for item in items:
        for name, needed in GPU_MARKERS.items():
            if item.get_closest_marker(name) is None:
                continue
            found = cuda_device_count()
            if found < needed:
                noun = "device" if needed == 1 else "devices"
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA {noun}, found {found}"))


def xdist_group_of(nodeid: str, gpu_markers: list[str]) -> str:
    """The xdist group of a test: its file; for gpu2/gpu4 tests its file and GPU count (a grid's
    cases are one launch, run by one worker: grids are cached per process, keyed by world size,
    so the 2- and 4-GPU grids of a file may run on two workers); every gpu1 test in one group
    (they run in the worker's own process, on its first GPU)."""
    path = nodeid.split("::")[0]
    if "gpu1" in gpu_markers:
        return "gpu1"
    multi = [m for m in gpu_markers if m != "gpu1"]
    return f"{path}::{multi[-1]}" if multi else path


@pytest.fixture(scope="session")
def world1():
    """torch.distributed initialized on gloo with world size 1 (FileStore: xdist-safe)."""
    import torch.distributed as dist  # here, so that loading the plugin does not import torch

    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="cpkit-world1-"), "store")
        dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield dist.group.WORLD
