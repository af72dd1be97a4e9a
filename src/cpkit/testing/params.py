"""pytest parameters that run one scenario on every backend it fits, one test per case."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import pytest

from cpkit.launch import CaseResult, case_id_of, run_cases

__all__ = ["dist_params", "grid_params", "grid_result"]


def _mark_for(backend: str, world_size: int):
    if backend == "gloo":
        return pytest.mark.dist
    return getattr(pytest.mark, "gpu2" if world_size <= 2 else "gpu4")


def dist_params(world_sizes=(2, 4)):
    """`(backend, world_size)` params: gloo marked `dist`, nccl marked `gpu<n>` (n = 2 or 4).

    Use with `@pytest.mark.parametrize("backend,world_size", dist_params())` so ONE scenario
    function serves CPU CI and the GPU suites; gpu cases skip where the GPUs are missing.
    """
    params = []
    for n in world_sizes:
        params.append(pytest.param("gloo", n, marks=_mark_for("gloo", n), id=f"gloo{n}"))
        params.append(pytest.param("nccl", n, marks=_mark_for("nccl", n), id=f"nccl{n}"))
    return params


def grid_params(cases_for: Callable[[str, int], Iterable[Any]], world_sizes=(2, 4), backends=("gloo", "nccl"),
                xfail: Callable[[Any], str | None] | None = None):
    """`(backend, world_size, case_id)` params, one per case, marked like dist_params.

    `cases_for(backend, world_size)` lists the cases (dicts with "id", or any value whose str
    is its id). Pair with grid_result() so a whole grid runs in one launch per backend/size.
    `xfail(case)`: a reason (a known upstream defect) makes that case a strict xfail.
    """
    params = []
    for n in world_sizes:
        for backend in backends:
            for case in cases_for(backend, n):
                cid = case_id_of(case)
                reason = xfail(case) if xfail else None
                marks = [_mark_for(backend, n)] + ([pytest.mark.xfail(strict=True, reason=reason)] if reason else [])
                params.append(pytest.param(backend, n, cid, marks=marks, id=f"{backend}{n}-{cid}"))
    return params


_grids: dict[tuple, dict[str, CaseResult]] = {}


def grid_result(fn: Callable[[Any], Any], cases_for: Callable[[str, int], Iterable[Any]], backend: str,
                world_size: int, case_id: str, *, timeout: float = 600.0) -> CaseResult:
    """The result of one case; the first call for (fn, backend, world_size) runs the whole grid."""
    key = (fn.__module__, fn.__qualname__, backend, world_size)
    if key not in _grids:
        _grids[key] = run_cases(fn, list(cases_for(backend, world_size)), world_size,
                                backend=backend, timeout=timeout)
    return _grids[key][case_id]
