"""cpkit.devices: which backend and device a rank of a user's loop takes, and the examples'
world-size check (its fix passes the same check)."""

from __future__ import annotations

import pytest
import torch

from cpkit import devices
from cpkit.errors import CPConfigError


@pytest.mark.parametrize("local_rank,local_world,gpus,want", [
    (None, None, 8, ("gloo", "cpu")),  # not under torchrun: CPU, whatever the host has
    ("0", "2", 0, ("gloo", "cpu")),  # torchrun on a host without GPUs
    ("1", "2", 2, ("nccl", "cuda:1")),
    ("1", "4", 2, ("gloo", "cpu")),  # too few GPUs for the host's ranks: every rank of it on gloo
    ("3", "4", 2, ("gloo", "cpu")),
    ("1", None, 2, ("nccl", "cuda:1")),  # without LOCAL_WORLD_SIZE: a GPU for this local rank
])
def test_rank_device_follows_torchrun_and_the_gpus(monkeypatch, local_rank, local_world, gpus, want):
    for name, value in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(devices, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    rd = devices.rank_device()
    assert (rd.backend, str(rd.device)) == want
    assert str(rd) == f"{want[0]} on {want[1]}"


@pytest.mark.parametrize("backend,want", [("gloo", "cpu"), ("nccl", "cuda:1")])
def test_an_initialized_group_decides(monkeypatch, backend, want):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)  # GPUs, yet a gloo group stays on CPU
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    assert str(devices.rank_device().device) == want


@pytest.mark.parametrize("world,fix_size", [(3, 2), (1, 2), (16, 8), (6, 4)])
def test_a_world_size_an_example_cannot_use_is_refused_with_a_fix_that_passes(world, fix_size):
    sizes = (2, 4, 8)
    with pytest.raises(CPConfigError) as info:
        devices.check_world_size(world, sizes, "examples/x.py")
    (v,) = info.value.violations
    assert (v.field, v.value) == ("world_size", world) and "2 or 4 or 8" in v.constraint
    assert v.fix == f"torchrun --nproc-per-node {fix_size} examples/x.py"
    devices.check_world_size(fix_size, sizes, "examples/x.py")  # the fix passes
