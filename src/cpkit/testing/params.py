"""pytest parameters that run one scenario on every backend it fits."""

from __future__ import annotations

import pytest

__all__ = ["dist_params"]


def dist_params(world_sizes=(2, 4)):
    """`(backend, world_size)` params: gloo marked `dist`, nccl marked `gpu<n>` (n = 2 or 4).

    Use with `@pytest.mark.parametrize("backend,world_size", dist_params())` so ONE scenario
    function serves CPU CI and the GPU suites; gpu cases skip where the GPUs are missing.
    """
    params = []
    for n in world_sizes:
        params.append(pytest.param("gloo", n, marks=pytest.mark.dist, id=f"gloo{n}"))
        gpu_mark = getattr(pytest.mark, f"gpu{n}" if n in (2, 4) else "gpu4")
        params.append(pytest.param("nccl", n, marks=gpu_mark, id=f"nccl{n}"))
    return params
