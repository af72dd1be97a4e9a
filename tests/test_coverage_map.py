"""The measured coverage map (cpkit.coverage_map) and what `cpkit validate --changed` selects
from it (cpkit.changed_selection): functions by their body lines, staleness, rank-side
attribution, and the union that never selects fewer tests than the static selection."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from cpkit.change_map import select_tests
from cpkit.changed_selection import _measured
from cpkit.coverage_map import (
    CoverageMap,
    function_spans,
    functions_at_lines,
    load_map,
    rank_case_context,
    staleness,
    tracked_files,
)

ROOT = Path(__file__).resolve().parents[1]

SOURCE = textwrap.dedent('''\
    """Doc."""
    LIMIT = 3


    def outer(x):
        """Doc."""
        def inner(y):
            return y + LIMIT
        return inner(x)


    class Box:
        size = 2

        @property
        def area(self):
            return self.size * self.size

        async def fetch(self):
            if self.size:
                def later():
                    return 1
            return None
''')


def test_functions_are_named_by_qualified_name_and_body_lines():
    assert [name for _, _, name in function_spans(SOURCE)] == [
        "outer", "outer.inner", "Box.area", "Box.fetch", "Box.fetch.later"]
    names, outside = functions_at_lines(SOURCE, {8, 9, 17, 22})
    assert names == {"outer.inner", "outer", "Box.area", "Box.fetch.later"}
    assert not outside
    # Module and class level, a signature and a decorator run when the module is imported.
    names, outside = functions_at_lines(SOURCE, {2, 5, 13, 15})
    assert names == set() and outside == {2, 5, 13, 15}


def _map(functions: dict[str, list[str]], files: dict[str, str] | None = None) -> CoverageMap:
    return CoverageMap("0" * 40, files or {}, functions, {}, {})


def test_a_map_is_stale_when_a_measured_module_or_a_test_file_changed():
    cmap = _map({}, {"src/cpkit/a.py": "1", "tests/test_a.py": "2"})
    assert staleness(cmap, {"src/cpkit/a.py": "1", "tests/test_a.py": "2", "src/cpkit/never_run.py": "9"}) is None
    assert "src/cpkit/a.py" in staleness(cmap, {"src/cpkit/a.py": "X", "tests/test_a.py": "2"})
    assert "tests/test_new.py" in staleness(cmap, {"src/cpkit/a.py": "1", "tests/test_a.py": "2",
                                                   "tests/test_new.py": "3"})
    assert "record-map" in staleness(None, {})


def test_the_committed_map_is_not_older_than_the_code_it_covers():
    """CI's check: a map measured before the last change of a module it ran, or of a test file,
    would let `--changed` miss that change's callers. Refresh: `cpkit validate --record-map`."""
    cmap = load_map(ROOT)
    assert staleness(cmap, tracked_files(ROOT, None)) is None


def test_a_changed_function_selects_the_tests_that_ran_it_and_no_fewer_than_the_static_selection():
    path = "src/cpkit/rebind.py"
    source = (ROOT / path).read_text()
    first, last, name = next(s for s in function_spans(source) if "." not in s[2])
    cmap = _map({f"{path}::{name}": ["functional/test_made_up.py"]})
    picked, everything, why = _measured(path, ROOT, {first}, cmap)
    assert picked == {"functional/test_made_up.py"} and not everything and name in why


def test_a_function_without_coverage_or_a_module_level_change_selects_the_whole_feature():
    path = "src/cpkit/rebind.py"
    source = (ROOT / path).read_text()
    first, _, name = function_spans(source)[0]
    feature = set(select_tests([path], ROOT, narrow=False).files)
    picked, everything, why = _measured(path, ROOT, {first}, _map({}))
    assert picked >= feature and "no recorded coverage" in why
    cmap = _map({f"{path}::somewhere": ["functional/test_made_up.py"]})
    picked, _, why = _measured(path, ROOT, {1}, cmap)  # the module docstring: outside any function
    assert picked >= feature | {"functional/test_made_up.py"} and "outside a function body" in why


def test_rebind_code_run_inside_dist_ranks_selects_the_dist_tests():
    """Rebind code that the `dist` tests reach only inside their ranks (a scenario run by name),
    which the static selection missed: the map records it against the functional tests that
    spawned the ranks, so a change there runs them."""
    cmap = load_map(ROOT)
    path, name = "src/cpkit/rebind.py", "install_pg_collection"
    spawning = {"functional/test_eval_cp.py", "functional/test_dynamic_cp.py"}
    assert spawning <= set(cmap.tests_of(path, name) or ()), "rank processes not measured?"
    first = next(s[0] for s in function_spans((ROOT / path).read_text()) if s[2] == name)
    picked, everything, _ = _measured(path, ROOT, {first}, cmap)
    assert spawning <= picked and not everything


def test_rank_case_context_attributes_a_case_to_its_test(tmp_path):
    coverage = pytest.importorskip("coverage")
    if coverage.Coverage.current() is not None:
        pytest.skip("coverage is measuring this process already (a map being recorded): one tracer at a time")
    with rank_case_context("tests/test_x.py::t"):  # nothing measuring: a no-op
        pass
    module = tmp_path / "probe_mod.py"
    module.write_text("def f():\n    return 1\n")
    cov = coverage.Coverage(data_file=str(tmp_path / ".coverage"), include=[str(module)])
    cov.start()
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("probe_mod", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        with rank_case_context("tests/test_x.py::t"):
            mod.f()
    finally:
        cov.stop()
    contexts = cov.get_data().contexts_by_lineno(str(module))
    assert "tests/test_x.py::t" in contexts[2]
