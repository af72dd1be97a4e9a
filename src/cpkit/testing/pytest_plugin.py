"""pytest integration: markers, and skips for GPU tests where the GPUs are missing.

Loaded through `-p cpkit.testing.pytest_plugin` in pyproject's addopts.
"""

from __future__ import annotations

import functools

import pytest

GPU_MARKERS = {"gpu2": 2, "gpu4": 4}


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    try:
        import torch

        if not torch.cuda.is_available():
            return 0
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: multi-process test on CPU with gloo")
    config.addinivalue_line("markers", "gpu2: NCCL test that needs at least 2 CUDA devices")
    config.addinivalue_line("markers", "gpu4: NCCL test that needs at least 4 CUDA devices")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, needed in GPU_MARKERS.items():
            if item.get_closest_marker(name) is None:
                continue
            found = cuda_device_count()
            if found < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA devices, found {found}"))
