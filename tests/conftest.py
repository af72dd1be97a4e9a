"""Unit-test fixtures: a world-size-1 gloo process group (the most any unit test may use)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def world1():
    """torch.distributed initialized on gloo with world size 1 (FileStore: xdist-safe)."""
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="cpkit-world1-"), "store")
        dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture(scope="session")
def mcore_cpu(world1):
    """world1 plus the MCore CPU shim (a no-op where CUDA is available)."""
    from cpkit.testing.cpu_shim import install_mcore_cpu_shim

    install_mcore_cpu_shim()
    yield world1
