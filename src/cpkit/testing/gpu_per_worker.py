"""One GPU per pytest-xdist worker, for one-GPU tests spread over a host's GPUs (the GPU proof's
gpu1 tier, scripts/gpu-proof.sh: `pytest -n <2 x GPUs> -p cpkit.testing.gpu_per_worker -m gpu1`).

Worker gwN sees only the Nth GPU of those the run was started with, through CUDA_VISIBLE_DEVICES,
so a gpu1 test's "cuda" (or cuda:0) is its worker's own GPU, and so are the processes a test
starts. The variable is set in the worker's first plugin hook, before any conftest or test module
imports torch: CUDA reads it once, when it initializes. Loaded only by name (`-p`); in the
controller and without xdist (`-n 0`) it does nothing.
"""

from __future__ import annotations

import os
import re

import pytest

__all__ = ["worker_gpu"]


def worker_gpu(worker: str, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES of xdist worker `worker` ("gw3"): the Nth id of `visible` (the
    run's own CUDA_VISIBLE_DEVICES, wrapping when workers outnumber its ids), "N" where it is
    unset (then run one worker per GPU, `-n <GPUs>`; the GPU proof sets it, so that its workers wrap), "" where it hides every GPU.
    Raises ValueError for a worker id that is not gw<N>."""
    match = re.fullmatch(r"gw(\d+)", worker)
    if match is None:
        raise ValueError(f"PYTEST_XDIST_WORKER={worker!r}: not an xdist worker id, which is gw<N> (gw0, gw1, ...); "
                         "fix: load cpkit.testing.gpu_per_worker only in a pytest-xdist run (-n <GPUs>)")
    index = int(match[1])
    if visible is None:
        return str(index)
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    return ids[index % len(ids)] if ids else ""


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # The earliest hook of a -p plugin: conftests and test modules (which ask torch.cuda) come after.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ["CUDA_VISIBLE_DEVICES"] = worker_gpu(worker, os.environ.get("CUDA_VISIBLE_DEVICES"))
