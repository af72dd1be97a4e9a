"""This process's devices: how many CUDA devices it sees (the one count that test skips and
checkers use), and which backend and device a rank of a user's loop runs on.

`rank_device()` is the choice: NCCL on cuda:LOCAL_RANK where torchrun started the rank and CUDA
has a device for every local rank, gloo on CPU otherwise (or the backend of a process group that
is already up, such as one cpkit.harness.launch started). `init_rank()` acts on it in a training
loop's start-up: the default process group, the current CUDA device, and MCore made ready for that
device (the CPU shim on CPU, MCore's CUDA RNG state and memory buffer on CUDA).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Sequence

from cpkit.process_device import cuda_device_count  # the count lives below the launcher

__all__ = ["RankDevice", "check_world_size", "cuda_device_count", "describe_rank_devices", "init_rank",
           "rank_device"]


@functools.lru_cache(maxsize=1)
@dataclass(frozen=True)
class RankDevice:
    """The process-group backend ("nccl" or "gloo") and the torch device of one rank."""

    backend: str
    device: Any
    """torch.device: cuda:<local rank> under nccl, cpu under gloo."""

    def __str__(self) -> str:
        return f"{self.backend} on {self.device}"


def rank_device() -> RankDevice:
    """This rank's backend and device.

    With a default process group already initialized, its backend decides (nccl: cuda:LOCAL_RANK;
    else cpu). Otherwise: nccl on cuda:LOCAL_RANK when LOCAL_RANK is set (torchrun sets it) and
    CUDA sees a device for every local rank (LOCAL_WORLD_SIZE of them, so that all ranks of a
    host agree: 8 ranks on a 4-GPU host all take gloo); gloo on CPU when not (no torchrun, too
    few GPUs, or CUDA_VISIBLE_DEVICES hiding them).
    """
    import torch
    import torch.distributed as dist

    local = os.environ.get("LOCAL_RANK")
    if dist.is_available() and dist.is_initialized():
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", int(local or 0) + 1))
        backend = "nccl" if local is not None and cuda_device_count() >= ranks_here else "gloo"
    device = torch.device("cuda", int(local or 0)) if backend == "nccl" else torch.device("cpu")
    return RankDevice(backend, device)


def init_rank(*, memory_buffer: bool = True) -> RankDevice:
    """Start this rank of a training loop on rank_device(): set the CUDA device, initialize the
    default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) unless
    one is up, and make MCore ready for the device: on CPU cpkit.mcore_cpu's shim (MCore calls
    CUDA in a few places), on CUDA MCore's "model-parallel-rng" state, and on both MCore's global
    memory buffer (the decentralized process-group path never calls initialize_model_parallel,
    which sets them). `memory_buffer=False` leaves the buffer to a loop that then calls MCore's
    initialize_model_parallel (itself or through Megatron-Bridge), which creates it and refuses a
    second one. Returns the RankDevice. Idempotent."""
    import torch
    import torch.distributed as dist

    rd = rank_device()
    if rd.device.type == "cuda":
        torch.cuda.set_device(rd.device)
    if not dist.is_initialized():
        dist.init_process_group(rd.backend)
    from cpkit.compat import ensure_cuda_rng_tracker, ensure_global_memory_buffer

    if rd.device.type == "cpu":
        from cpkit.mcore_cpu import install_mcore_cpu_shim

        install_mcore_cpu_shim("cpu")
    else:
        ensure_cuda_rng_tracker()
    if memory_buffer:  # on CPU too: the shim does not create it on demand, as CUDA does not
        ensure_global_memory_buffer()
    return rd


def describe_rank_devices(rd: RankDevice) -> str:
    """'rank 0: nccl on cuda:0; rank 1: nccl on cuda:1', every rank's backend and device, the same
    string on every rank. A collective over the default group."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, str(rd))
    return "; ".join(f"rank {r}: {text}" for r, text in enumerate(every))


def check_world_size(world_size: int, sizes: Sequence[int], script: str) -> None:
    """Raise CPConfigError unless `world_size` is one of `sizes` (what `script` supports); the fix
    is the torchrun command with the largest supported size not above `world_size` (else the
    smallest)."""
    if world_size not in sizes:
        from cpkit.errors import CPConfigError

        fit = max((s for s in sizes if s <= world_size), default=min(sizes))
        raise CPConfigError.single(
            "world_size", world_size, f"{script} runs on {' or '.join(map(str, sizes))} ranks",
            f"torchrun --nproc-per-node {fit} {script}")
