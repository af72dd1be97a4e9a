"""pytest parameters that run one scenario on every backend it fits, one test per case."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import pytest

from cpkit.harness.attribution import collected_case_ids, current_test_id
from cpkit.harness.grid import CaseResult, GridSpec, case_id_of, default_pools

__all__ = ["GRID_MARK", "dist_params", "grid_params", "grid_result", "grid_spec_of"]

GRID_MARK = "cpkit_grid"
"""The marker grid_params(scenario=...) puts on each case, so the plugin can start a session's
NCCL grids in the background before their tests ask (cpkit.testing.pytest_plugin)."""


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
                xfail: Callable[[Any], str | None] | None = None, *, scenario: Callable[[Any], Any] | None = None,
                timeout: float = 600.0, grid_cases_for: Callable[[str, int], Iterable[Any]] | None = None):
    """`(backend, world_size, case_id)` params, one per case, marked like dist_params.

    `cases_for(backend, world_size)` lists the cases (dicts with "id", or any value whose str
    is its id). Pair with grid_result() so a whole grid runs on one rank pool per backend/size.
    `xfail(case)`: a reason or an UpstreamDefect (a known upstream defect) makes that case a strict
    xfail that expects the case's own AssertionError (CaseResult.check), or the defect's `raises`:
    a config error, a crash, a hang or a case
    that did not run raises CaseFailed and fails the test. `scenario`/`timeout`: the grid's
    function and deadline, as given to grid_result; with them a pytest run on GPUs runs the grid in the
    background before its tests ask for it; `grid_cases_for`: the grid's cases where they are more
    than this test's own (several tests reading one grid).
    """
    params = []
    for n in world_sizes:
        for backend in backends:
            grid = [getattr(pytest.mark, GRID_MARK)(scenario=scenario, cases_for=grid_cases_for or cases_for,
                                                    timeout=timeout)] \
                if scenario is not None else []
            for case in cases_for(backend, n):
                cid = case_id_of(case)
                reason = xfail(case) if xfail else None
                marks = [_mark_for(backend, n)] + grid
                if reason:  # a str, or an UpstreamDefect (cpkit.testing.upstream_xfail) naming what it raises
                    raises = getattr(reason, "raises", AssertionError)
                    marks.append(pytest.mark.xfail(strict=True, reason=str(reason), raises=raises))
                params.append(pytest.param(backend, n, cid, marks=marks, id=f"{backend}{n}-{cid}"))
    return params


def _run_cases(cases_for: Callable[[str, int], Iterable[Any]], backend: str, world_size: int, test: str | None,
               own: str | None = None) -> tuple:
    """The cases of a grid this session runs: those whose tests were collected in the file of
    `test` (a run of some of the grid's tests runs only theirs), `own` always; every case when
    the session registered none there."""
    cases = tuple(cases_for(backend, world_size))
    wanted = collected_case_ids(test, backend, world_size)
    if wanted is None:
        return cases
    kept = tuple(c for c in cases if case_id_of(c) in wanted or case_id_of(c) == own)
    return kept or cases


def grid_spec_of(item) -> GridSpec | None:
    """The grid a collected test belongs to (from grid_params(scenario=...)), or None."""
    mark = item.get_closest_marker(GRID_MARK)
    callspec = getattr(item, "callspec", None)
    if mark is None or callspec is None or "backend" not in callspec.params:
        return None
    backend, world_size = callspec.params["backend"], callspec.params["world_size"]
    cases_for = mark.kwargs["cases_for"]
    return GridSpec(mark.kwargs["scenario"], _run_cases(cases_for, backend, world_size, item.nodeid), backend,
                    world_size, mark.kwargs["timeout"])


def grid_result(fn: Callable[[Any], Any], cases_for: Callable[[str, int], Iterable[Any]], backend: str,
                world_size: int, case_id: str, *, timeout: float = 600.0) -> CaseResult:
    """The result of one case; the first call for (fn, backend, world_size) runs the whole grid,
    every case of it the session collected a test for (or waits for it, when the session started
    it in the background)."""
    cases = _run_cases(cases_for, backend, world_size, current_test_id(), case_id)
    spec = GridSpec(fn, cases, backend, world_size, timeout)
    return default_pools().result(spec)[case_id]
