"""The measured coverage map (cpkit.validation.coverage_map, cpkit.validation.code_hashes) and what
`cpkit validate --changed` selects from it (cpkit.validation.changed_selection): functions by
their body lines, what changed since the map (from its hashes, no git), the rule that widens the
selection by that drift, the format-1 fallback, and rank-side attribution (cpkit.harness.attribution)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cpkit.harness.attribution import rank_case_context
from cpkit.validation.changed_selection import _Change, _measured, changed_since_map, select_changed
from cpkit.validation.code_hashes import function_hashes, module_level_hash
from cpkit.validation.coverage_map import (
    MAP_PATH,
    blob_hash,
    decode_indices,
    drift_since,
    function_spans,
    functions_at_lines,
    load_map,
)
from cpkit.validation.coverage_record import build_map

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


def test_hashes_see_code_not_comments_and_put_signatures_at_module_level():
    before, module = function_hashes(SOURCE), module_level_hash(SOURCE)
    commented = SOURCE.replace("return y + LIMIT", "return y + LIMIT  # a comment\n\n")
    assert function_hashes(commented) == before and module_level_hash(commented) == module
    body = SOURCE.replace("return y + LIMIT", "return y - LIMIT")
    changed = {q for q, h in function_hashes(body).items() if before[q] != h}
    assert changed == {"outer", "outer.inner"} and module_level_hash(body) == module
    for edit in (SOURCE.replace("def outer(x):", "def outer(x=1):"),
                 SOURCE.replace("    @property\n", ""),
                 SOURCE.replace("LIMIT = 3", "LIMIT = 4"),
                 SOURCE + "\n\ndef added():\n    return 0\n"):
        assert module_level_hash(edit) != module


# ------------------------------------------------------------- a small repository, no git
MODULE = "src/cpkit/devices.py"  # a path with a change-map row: tests/test_devices.py
DEVICES = textwrap.dedent('''\
    """Doc."""
    LIMIT = 3


    def f(x):
        return x + 1


    def g(x):
        return x * 2


    def h(x):
        return x - LIMIT
''')
TESTS = {
    "tests/test_alpha.py": "def test_a():\n    assert True\n",  # runs f: reached only at run time
    "tests/test_beta.py": "def test_b():\n    assert True\n",  # runs g
    "tests/test_gamma.py": "def test_c():\n    assert True\n",  # runs h
    "tests/test_importer.py": "import cpkit.devices\n\ndef test_i():\n    assert cpkit.devices.LIMIT == 3\n",
    "tests/test_devices.py": "from cpkit.devices import f\n\ndef test_d():\n    assert f(1) == 2\n",
}
RUNS = {"tests/test_alpha.py::test_a": ["f"], "tests/test_beta.py::test_b": ["g"],
        "tests/test_gamma.py::test_c": ["h"], "tests/test_devices.py::test_d": ["f"]}
FEATURE = {"tests/test_devices.py", "tests/test_importer.py"}  # the row and the importing tests


def _record(root: Path, runs: dict[str, list[str]]) -> None:
    """Write root's map as `cpkit validate --record-map` would after `runs` (test -> functions
    of MODULE it ran), through coverage.py's own data type and build_map."""
    coverage = pytest.importorskip("coverage")
    data = coverage.CoverageData(no_disk=True)
    spans = {name: first for first, _, name in function_spans((root / MODULE).read_text())}
    for test, names in runs.items():
        data.set_context(test)
        data.add_lines({str(root / MODULE): [spans[n] for n in names]})
    result = build_map(data, root, {}, "c0ffee" * 6 + "c0de", {}, {})
    (root / MAP_PATH).parent.mkdir(parents=True, exist_ok=True)
    (root / MAP_PATH).write_text(json.dumps(result))


def make_repo(root: Path, tests: dict, runs: dict) -> Path:
    """A fake repository at `root`: the module, the test files `tests`, and a map where each
    test of `runs` ran the functions it names."""
    (root / "src" / "cpkit").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "src/cpkit/__init__.py").write_text("")
    (root / MODULE).write_text(DEVICES)
    for path, text in tests.items():
        (root / path).write_text(text)
    _record(root, runs)
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path, TESTS, RUNS)


def _edit(root: Path, old: str, new: str, path: str = MODULE) -> set[int]:
    """Replace `old` by `new` in `path`; the new text's line numbers (the diff's lines)."""
    text = (root / path).read_text()
    assert old in text
    first = text[:text.index(old)].count("\n") + 1
    (root / path).write_text(text.replace(old, new))
    return set(range(first, first + new.count("\n") + 1))


def _select(root: Path, lines: set[int] | None, changed: list[str] | None = None):
    changed = changed or [MODULE]
    return select_changed(root, None, changed, {p: lines for p in changed if p.startswith("src/")})


def _tests(selection) -> set[str]:
    """The test files the selection runs tests of: whole, or some of their node ids."""
    return {f for f in [*selection.files, *(n.split("::")[0] for n in selection.node_ids)] if f.startswith("tests/test_")}


def _tests_whole(selection) -> set[str]:
    return {f for f in selection.files if f.startswith("tests/test_")}


def as_format(raw: dict, version: int) -> dict:
    """A format-3 map's JSON as format 2 (test files per function) or 1 (blob ids only)."""
    nodes = raw["nodes"]
    files = {k: sorted({nodes[i].split("::")[0] for i in decode_indices(v)}) for k, v in raw["functions"].items()}
    tests = sorted({t for ts in files.values() for t in ts})
    functions = {k: [tests.index(t) for t in ts] for k, ts in files.items()}
    if version == 1:
        return {"version": 1, "commit": raw["commit"], "tests": tests, "functions": functions, "files": raw["blobs"],
                "levels": {}, "recorded": {}}
    return {"version": 2, "commit": raw["commit"], "tests": tests, "functions": functions, "blobs": raw["blobs"],
            "modules": raw["modules"], "hashes": raw["hashes"], "levels": {}, "recorded": {}}


def test_a_body_edit_selects_the_tests_that_ran_the_function(repo):
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert not sel.everything
    assert sel.node_ids == ["tests/test_alpha.py::test_a", "tests/test_devices.py::test_d"] and not _tests_whole(sel)
    assert "1 functions changed" in sel.map_state and "c0ffeec0ffee" in sel.map_state


def test_a_call_edge_added_since_the_map_selects_the_tests_of_the_changed_caller(repo):
    """Since the map, g calls f: test_beta now reaches f, which the map cannot know; g changed
    since the map, so its tests run when the diff changes f."""
    _edit(repo, "return x * 2", "return f(x) * 2")  # committed since the map: not in the diff
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert {"tests/test_alpha.py", "tests/test_beta.py"} <= _tests(sel)
    assert "tests/test_gamma.py" not in _tests(sel)


def test_a_new_function_selects_the_whole_feature(repo):
    lines = _edit(repo, "def h(x):", "def k(x):\n    return 0\n\n\ndef h(x):")
    sel = _select(repo, lines)
    assert FEATURE <= _tests(sel) and "no recorded coverage" in sel.reasons[MODULE]
    assert "1 new" in sel.map_state


def test_a_module_level_edit_selects_the_feature_and_every_test_that_ran_the_module(repo):
    sel = _select(repo, _edit(repo, "LIMIT = 3", "LIMIT = 4"))
    assert _tests(sel) == FEATURE | {"tests/test_alpha.py", "tests/test_beta.py", "tests/test_gamma.py"}
    assert "outside a function body" in sel.reasons[MODULE]


def test_a_deleted_function_selects_the_tests_that_ran_it(repo):
    _edit(repo, "def g(x):\n    return x * 2\n", "")  # since the map
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert "tests/test_beta.py" in _tests(sel) and "g deleted" in sel.reasons[MODULE]


def test_test_files_changed_or_added_since_the_map_are_selected(repo):
    _edit(repo, "assert True", "assert 1", path="tests/test_gamma.py")
    (repo / "tests/test_new.py").write_text("def test_n():\n    pass\n")
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert {"tests/test_gamma.py", "tests/test_new.py"} <= _tests(sel)
    assert "tests/test_beta.py" not in _tests(sel)


def test_a_diff_without_a_cpkit_module_needs_no_map(repo):
    (repo / MAP_PATH).unlink()
    sel = select_changed(repo, None, ["README.md"], {})
    assert not sel.everything and sel.map_state.startswith("not used")
    sel = _select(repo, {6})
    assert sel.everything and "no coverage map" in sel.map_state


def test_a_format_1_map_counts_a_module_whose_blob_differs_as_wholly_changed(repo):
    old = as_format(json.loads((repo / MAP_PATH).read_text()), 1)
    (repo / MAP_PATH).write_text(json.dumps(old))
    sel = _select(repo, {6})  # the module is as measured: its blob vouches for every function
    assert _tests(sel) == {"tests/test_alpha.py", "tests/test_devices.py"} and "format 1" in sel.map_state
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert _tests(sel) == FEATURE | {"tests/test_alpha.py", "tests/test_beta.py", "tests/test_gamma.py"}
    (repo / MAP_PATH).write_text(json.dumps(dict(old, version=0)))
    sel = _select(repo, {6})
    assert sel.everything and "cannot be read" in sel.map_state


def test_without_git_the_change_since_the_map_is_the_change(repo):
    assert not (repo / ".git").exists()
    _edit(repo, "return x * 2", "return x * 3")
    base, changed = changed_since_map(repo)
    assert changed == [MODULE] and base.startswith("c0ffee")
    sel = select_changed(repo, base, changed, {MODULE: set()})
    assert "tests/test_beta.py" in _tests(sel) and "tests/test_alpha.py" not in _tests(sel)
    drift = drift_since(load_map(repo), repo)
    assert drift.changed == {MODULE: {"g"}} and not drift.module_level and not drift.test_files


def test_the_map_stores_what_the_code_was(repo):
    raw = json.loads((repo / MAP_PATH).read_text())
    assert raw["version"] == 3 and raw["blobs"][MODULE] == blob_hash(DEVICES.encode())
    assert raw["hashes"][MODULE] == function_hashes(DEVICES) and raw["modules"][MODULE] == module_level_hash(DEVICES)


# ------------------------------------------------------------- the committed map, ranks
def test_the_committed_map_loads_and_reports_its_drift():
    """Any map in the repository stays usable: an older one selects more, never runs everything
    by itself. Refresh: `cpkit validate --record-map`."""
    cmap = load_map(ROOT)
    assert cmap is not None and cmap.commit and cmap.functions
    assert "functions changed" in drift_since(cmap, ROOT).summary()


def test_rebind_code_run_inside_dist_ranks_selects_the_dist_tests():
    """Rebind code that the `dist` tests reach only inside their ranks (a scenario run by name),
    which the static selection missed: the map records it against the functional tests that
    spawned the ranks, so a change there runs them."""
    cmap = load_map(ROOT)
    path, name = "src/cpkit/eval_cp/rebind.py", "install_pg_collection"
    spawning = {"functional/test_eval_cp.py", "functional/test_dynamic_cp.py"}
    assert spawning <= set(cmap.tests_of(path, name) or ()), "rank processes not measured?"
    picked, nodes, everything, _ = _measured(ROOT, _Change(functions={path: {name}}), cmap)
    assert spawning <= picked | {n.split("::")[0] for n in nodes} and not everything


def test_rank_case_context_attributes_a_case_to_its_test(tmp_path):
    coverage = pytest.importorskip("coverage")
    if coverage.Coverage.current() is not None:
        pytest.skip("coverage is measuring this process already (a map being recorded): one tracer at a time")
    with rank_case_context("tests/test_x.py::t"):  # nothing measuring: no coverage context to switch
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


def test_a_pooled_case_runs_under_the_id_of_the_test_that_sent_it(monkeypatch):
    """A pool's rank inherited PYTEST_CURRENT_TEST from the test that started it; each case must
    see the test that sent it (the changed_recall bench's probes read it), and the rank's own
    value comes back after the case."""
    from cpkit.harness.attribution import CONTEXT_ENV, current_test_id

    monkeypatch.delenv(CONTEXT_ENV, raising=False)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_second.py::t (call)")
    assert current_test_id() == "tests/test_second.py::t"
    monkeypatch.setenv(CONTEXT_ENV, "tests/test_recorded.py::t")  # a map being recorded names it
    assert current_test_id() == "tests/test_recorded.py::t"
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    monkeypatch.delenv(CONTEXT_ENV)
    assert current_test_id() is None

    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_first.py::t (call)")  # started the pool
    with rank_case_context("tests/test_second.py::t"):
        assert os.environ["PYTEST_CURRENT_TEST"] == "tests/test_second.py::t (call)"
    assert os.environ["PYTEST_CURRENT_TEST"] == "tests/test_first.py::t (call)"
    with rank_case_context(None):
        assert os.environ["PYTEST_CURRENT_TEST"] == "tests/test_first.py::t (call)"


POOL_SCRIPT = textwrap.dedent('''\
    import os
    from cpkit.harness.attribution import CONTEXT_ENV
    from cpkit.harness.rank_pool import RankPool

    if __name__ == "__main__":  # a spawned rank imports this file too
        os.environ[CONTEXT_ENV] = "tests/test_first.py::t"  # the test that starts the pool
        pool = RankPool(1, "gloo")  # one rank: attribution is per rank, the same on every one
        pool.start()
        os.environ[CONTEXT_ENV] = "tests/test_second.py::t"  # a later test reuses it
        run = pool.run("probe:case", 7, timeout=60)
        pool.close()
        assert not run.errors, run.errors
''')


def _measured_run(tmp_path, probe_source: str, cmd: list[str], env: dict, timeout: float) -> set[str]:
    """Run `cmd` at `tmp_path` as `--record-map` measures a run (coverage_rcfile, measured_env)
    with `probe.py` (`probe_source`) importable; the tests credited with the probe's line 2."""
    coverage = pytest.importorskip("coverage")
    from cpkit.validation.coverage_record import _test_of, coverage_rcfile, measured_env

    probe = tmp_path / "probe.py"
    probe.write_text(probe_source)
    rc = coverage_rcfile(tmp_path, tmp_path)
    env = {**__import__("os").environ, **measured_env(rc), "PYTHONPATH": f"{ROOT / 'src'}:{tmp_path}", **env}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    combined = coverage.Coverage(config_file=str(rc))
    combined.combine(keep=False)
    contexts = combined.get_data().contexts_by_lineno(str(probe))
    assert contexts.get(2), f"the child's coverage was not saved: {contexts}"
    return {t for c in contexts[2] for t in _test_of(c, {})}


@pytest.mark.dist
def test_a_pool_rank_credits_each_case_to_the_test_that_sent_it(tmp_path):
    """Recorded as `--record-map` records: a pool started under one test runs a case for the
    next; the case's lines belong to the second test (a rank's static context is the first)."""
    (tmp_path / "run_pool.py").write_text(POOL_SCRIPT)
    tests = _measured_run(tmp_path, "def case(n):\n    return n + 1\n", [sys.executable, str(tmp_path / "run_pool.py")],
                          {}, timeout=240)
    assert tests == {"tests/test_second.py::t"}  # its node id, not the first test's


def test_a_python_process_a_test_starts_is_credited_to_that_test(tmp_path):
    """Recorded as `--record-map` records: torchrun, the examples, the cluster runner and nested
    pytest runs are plain subprocesses; each measures itself (coverage.py's .pth file reads
    COVERAGE_PROCESS_START) under the test whose id it inherited. Here a grandchild."""
    from cpkit.harness.attribution import CONTEXT_ENV

    grandchild = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.run("
                  "[sys.executable, '-c', 'import probe; probe.f(3)']).returncode)"]
    tests = _measured_run(tmp_path, "def f(n):\n    return n * 2\n", grandchild,
                          {CONTEXT_ENV: "functional/test_x.py::t[a]"}, timeout=120)
    assert tests == {"functional/test_x.py::t[a]"}
