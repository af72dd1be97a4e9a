"""Test support: the multi-rank launcher, pytest integration and the CPU shim for MCore.

Only this package may patch MCore (see cpkit.testing.cpu_shim); library code never does.
"""

from cpkit.testing.launcher import (
    CaseResult,
    LaunchTimeout,
    RankFailure,
    device,
    launch,
    run_cases,
)
from cpkit.testing.params import dist_params, grid_params, grid_result

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
