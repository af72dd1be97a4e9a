"""Test support: pytest integration, the scenarios (`cpkit.testing.scenarios`) that both the
functional tests and `python -m cpkit.cluster` run, and the public launcher (`cpkit.harness.launch`)
re-exported for them. MCore is patched only by `cpkit.mcore_cpu` (CPU runs), never elsewhere. The
pytest helpers (dist_params, grid_params, grid_result) are imported on first use, so that the
launcher and the scenarios work where pytest is not installed (a cluster's training image).
"""

from cpkit.harness.launch import (
    CaseResult,
    LaunchTimeout,
    RankFailure,
    launch,
    run_cases,
)
from cpkit.process_device import device

__all__ = [
    "CaseResult",
    "LaunchTimeout",
    "RankFailure",
    "device",
    "dist_params",
    "grid_params",
    "grid_result",
    "launch",
    "run_cases",
]

_PYTEST_HELPERS = ("dist_params", "grid_params", "grid_result")


def __getattr__(name):
    if name in _PYTEST_HELPERS:
        from cpkit.testing import params

        return getattr(params, name)
    raise AttributeError(f"module 'cpkit.testing' has no attribute {name!r}")
