"""Which test a rank's work belongs to: the harness's side of measuring the coverage map
(cpkit.validation.coverage_map), and of any tool that reads the running test's id in a rank.

A rank spawned while a map is recorded inherits CONTEXT_ENV, the test that launched it (its
coverage config reads it as the rank's context when it starts). A rank that runs cases for
several tests (a pool that outlives one test) names each case's test with
`rank_case_context(test_id)`, the test id being what `current_test_id()` returned in the pytest
process that asked for the case, or, for a case of a parametrized grid (one test per case,
the whole grid run when its first test asks), the id of the case's own test: `case_test_id`,
from what the pytest plugin registered at collection (`register_case_test`). The same record
tells a grid which of its cases the session runs at all (`collected_case_ids`): a run of some of
a grid's tests (`cpkit validate --changed` selecting node ids, `pytest -k`) runs only their
cases. Here, in the harness, because the rank pools call both: the
harness does not import the validation tooling, which stands on it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["CONTEXT_ENV", "TESTS_LABEL", "current_test_id", "rank_case_context", "register_case_test",
           "case_test_id", "clear_case_tests", "collected_case_ids", "measured_as"]

#: Set in the pytest process to the running test's node id while a map is recorded; a rank
#: spawned then inherits it (its coverage config reads it as the rank's context).
CONTEXT_ENV = "CPKIT_COVERAGE_CONTEXT"
_PYTEST_CURRENT = "PYTEST_CURRENT_TEST"  # pytest's "<node id> (<phase>)" of the running test
#: A coverage context standing for several tests: this prefix, then their node ids, one a line.
TESTS_LABEL = "tests:"


# (test function's id, backend, world size, case id) and (test file, backend, world size, case
# id) -> the node id of the test that checks that case.
_by_function: dict[tuple[str, str, int, str], str] = {}
_by_file: dict[tuple[str, str, int, str], str] = {}
_cases: dict[tuple[str, str, int], set[str]] = {}  # (test file, backend, world size) -> case ids collected


def clear_case_tests() -> None:
    """Forget every registered case (a new collection)."""
    _by_function.clear()
    _by_file.clear()
    _cases.clear()


def register_case_test(nodeid: str, backend: str, world_size: int, case_id: str) -> None:
    """Record at collection that test `nodeid` checks grid case `case_id` at (backend, world size)."""
    function = nodeid.split("[", 1)[0]
    _by_function[(function, backend, int(world_size), str(case_id))] = nodeid
    _by_file.setdefault((function.split("::", 1)[0], backend, int(world_size), str(case_id)), nodeid)
    _cases.setdefault((function.split("::", 1)[0], backend, int(world_size)), set()).add(str(case_id))


def collected_case_ids(test: str | None, backend: str, world_size: int) -> set[str] | None:
    """The case ids at (backend, world size) of the tests collected in the file of `test` (a
    node id or a file), or None when none is registered there (run every case)."""
    if not test:
        return None
    return _cases.get((test.split("::", 1)[0], backend, int(world_size))) or None


def case_test_id(asker: str | None, backend: str, world_size: int, case_id: str) -> str | None:
    """The test a grid case is credited to: the registered test of the asking test's function
    (or, for a grid several test functions read, of its file) for that case, else `asker`."""
    if not asker:
        return asker
    function = asker.split("[", 1)[0]
    key = (backend, int(world_size), str(case_id))
    return _by_function.get((function, *key)) or _by_file.get((function.split("::", 1)[0], *key)) or asker


def current_test_id() -> str | None:
    """The test being measured in this (pytest) process while a map is recorded, else the test
    pytest is running, else None. A rank pool sends it with each case, for `rank_case_context`."""
    return os.environ.get(CONTEXT_ENV) or os.environ.get(_PYTEST_CURRENT, "").split(" ")[0] or None


@contextlib.contextmanager
def rank_case_context(test_id: str | None) -> Iterator[None]:
    """In a rank process: attribute what runs inside the block to `test_id` (a pytest node id):
    in the coverage map being recorded, and in PYTEST_CURRENT_TEST (a pooled rank inherited the
    id of the test that started the pool; tools that read it, such as the changed_recall bench's
    probes, must see the test that sent the case). Restores both after. `test_id` None: a no-op."""
    if not test_id:
        yield
        return
    try:
        import coverage

        cov = coverage.Coverage.current()
    except ImportError:  # coverage is a test extra: nothing can be measuring
        cov = None
    before = os.environ.get(_PYTEST_CURRENT)
    os.environ[_PYTEST_CURRENT] = f"{test_id} (call)"
    previous = cov.switch_context(test_id) if cov is not None else None
    try:
        yield
    finally:
        if cov is not None:
            cov.switch_context(previous or "")
        if before is None:
            os.environ.pop(_PYTEST_CURRENT, None)
        else:
            os.environ[_PYTEST_CURRENT] = before


@contextlib.contextmanager
def measured_as(test_ids: list[str]) -> Iterator[None]:
    """In the pytest process, while a map is recorded: attribute what runs inside the block to
    `test_ids` (one: its node id; several: a TESTS_LABEL context naming each), then back to the
    running test. A grid run by its first test credits its own code to every case's test this
    way, and each case's part to that case's test. A no-op when no map is being recorded."""
    if not test_ids or CONTEXT_ENV not in os.environ:
        yield
        return
    try:
        import coverage

        cov = coverage.Coverage.current()
    except ImportError:
        cov = None
    if cov is None:
        yield
        return
    ids = sorted(set(test_ids))
    cov.switch_context(ids[0] if len(ids) == 1 else TESTS_LABEL + "\n".join(ids))
    try:
        yield
    finally:
        cov.switch_context(os.environ.get(CONTEXT_ENV, ""))
