"""How many CUDA devices this process sees; the one count that test skips and checkers use."""

from __future__ import annotations

import functools

__all__ = ["cuda_device_count"]


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """Visible CUDA devices; 0 without torch, without CUDA, or with a broken CUDA install."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0
