"""The devices this process has, as the lowest layer sees them: how many CUDA devices it sees,
and the torch device of a rank that one of cpkit's launchers started. Product code (the models,
the MCore CPU shim, the benchmarks) and the harness (GPU claims, rank pools) both read them here,
so that the product never imports the harness.

cpkit's launchers (cpkit.harness.launch, the rank pools of cpkit.harness.rank_worker, `python -m
cpkit.cluster`) set BACKEND_ENV in every rank they start; a process they did not start reads as
CPU. A user's training loop under torchrun picks its backend with cpkit.devices.rank_device.
"""

from __future__ import annotations

import os

__all__ = ["BACKEND_ENV", "cuda_device_count", "device"]

BACKEND_ENV = "CPKIT_LAUNCH_BACKEND"
"""The backend of a rank's process group ("nccl" or "gloo"), set by the launcher that started it."""


def cuda_device_count() -> int:
    """Visible CUDA devices; 0 without torch, without CUDA, or with a broken CUDA install."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


def device():
    """This rank's torch device: cuda:<local rank> under NCCL, cpu under gloo."""
    import torch

    if os.environ.get(BACKEND_ENV) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
