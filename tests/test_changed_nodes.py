"""`cpkit validate --changed` with a format-3 coverage map (test node ids per function): a change
inside covered function bodies runs exactly the tests that ran them; everything else the map
cannot decide widens to the static selection; an older map keeps its file-level behaviour; node
ids are run as single tests, and one the suite no longer has is left out, not an error.
(src/cpkit/validation/changed_selection.py, coverage_map.py, coverage_record.py, pytest_runner.py)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpkit.harness import attribution
from cpkit.validation.coverage_map import MAP_PATH, decode_indices, encode_indices, load_map
from cpkit.validation.coverage_record import _test_of
from cpkit.validation.pytest_runner import run_pytest
from tests.test_coverage_map import FEATURE, MODULE, TESTS, _edit, _select, as_format, make_repo

# test_alpha.py has two tests: only test_a1 runs f. test_devices.py (f's static user) runs f too.
NODE_TESTS = dict(TESTS, **{"tests/test_alpha.py": "def test_a1():\n    pass\n\n\ndef test_a2():\n    pass\n"})
NODE_RUNS = {"tests/test_alpha.py::test_a1": ["f"], "tests/test_alpha.py::test_a2": ["g"],
             "tests/test_beta.py::test_b": ["g"], "tests/test_devices.py::test_d": ["f"]}  # nothing runs h


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path, NODE_TESTS, NODE_RUNS)


def _whole(selection) -> set[str]:
    return {f for f in selection.files if f.startswith("tests/test_")}


def test_the_map_keeps_node_ids_as_index_ranges(repo):
    raw = json.loads((repo / MAP_PATH).read_text())
    assert raw["version"] == 3 and raw["nodes"] == sorted(NODE_RUNS)
    assert load_map(repo).nodes_of(MODULE, "g") == ["tests/test_alpha.py::test_a2", "tests/test_beta.py::test_b"]
    assert load_map(repo).tests_of(MODULE, "g") == ["tests/test_alpha.py", "tests/test_beta.py"]
    assert encode_indices([7, 1, 2, 3, 5, 6, 9]) == [[1, 3], [5, 7], 9]
    for indices in ([], [0], [0, 2], list(range(50)), [1, 2, 4, 8, 9, 10]):
        assert decode_indices(encode_indices(indices)) == indices


def test_a_body_change_of_a_covered_function_selects_exactly_its_node_ids(repo):
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert sel.node_ids == ["tests/test_alpha.py::test_a1", "tests/test_devices.py::test_d"]
    assert not _whole(sel) and not sel.everything  # not the change-map row (tests/test_devices.py whole)
    # the checks that read the source run with every module change (this fake repo has none of them)
    assert sel.reasons["(source checks)"].startswith("tests/test_repo_text.py; tests/test_import_graph.py")
    assert "2 tests in 2 files ran it" in sel.reasons[MODULE]


def test_a_module_level_change_widens_to_the_row_and_every_test_of_the_module(repo):
    sel = _select(repo, _edit(repo, "LIMIT = 3", "LIMIT = 4"))
    assert _whole(sel) == FEATURE | {"tests/test_alpha.py", "tests/test_beta.py"}
    assert "outside a function body" in sel.reasons[MODULE]


def test_a_signature_change_is_module_level(repo):
    sel = _select(repo, _edit(repo, "def g(x):", "def g(x, y=0):"))
    assert FEATURE <= _whole(sel) and "outside a function body" in sel.reasons[MODULE]


def test_a_function_no_test_reached_widens_to_the_feature(repo):
    sel = _select(repo, _edit(repo, "return x - LIMIT", "return x - LIMIT - 1"))
    assert FEATURE <= _whole(sel) and "h (no recorded coverage" in sel.reasons[MODULE]


def test_a_covered_and_an_uncovered_change_together_widen_and_keep_the_node_ids(repo):
    lines = _edit(repo, "return x + 1", "return x + 2") | _edit(repo, "return x - LIMIT", "return x - 4")
    sel = _select(repo, lines)
    assert FEATURE <= _whole(sel)
    assert sel.node_ids == ["tests/test_alpha.py::test_a1"]  # test_devices.py runs whole


def test_a_function_changed_since_the_map_adds_its_node_ids(repo):
    _edit(repo, "return x * 2", "return f(x) * 2")  # since the map: g now calls f
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert sel.node_ids == ["tests/test_alpha.py::test_a1", "tests/test_alpha.py::test_a2",
                            "tests/test_beta.py::test_b", "tests/test_devices.py::test_d"]
    assert "2 functions changed" in sel.map_state  # g, and f in the working tree


def test_a_function_deleted_since_the_map_widens_to_the_feature(repo):
    _edit(repo, "def g(x):\n    return x * 2\n", "")  # since the map
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert FEATURE | {"tests/test_beta.py"} <= _whole(sel) and "g deleted" in sel.reasons[MODULE]


def test_a_test_file_changed_since_the_map_selects_itself_whole(repo):
    _edit(repo, "def test_b():\n    assert True", "def test_b():\n    assert 1", path="tests/test_beta.py")
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert _whole(sel) == {"tests/test_beta.py"} and "tests/test_alpha.py::test_a1" in sel.node_ids


def test_a_node_id_of_a_deleted_test_file_is_not_selected(repo):
    (repo / "tests/test_devices.py").unlink()
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    assert sel.node_ids == ["tests/test_alpha.py::test_a1"]


def test_a_format_2_map_selects_as_before(repo):
    (repo / MAP_PATH).write_text(json.dumps(as_format(json.loads((repo / MAP_PATH).read_text()), 2)))
    sel = _select(repo, _edit(repo, "return x + 1", "return x + 2"))
    # whole test files: the ones that ran f, and the static selection (the row's user of f)
    assert not sel.node_ids and _whole(sel) == {"tests/test_alpha.py", "tests/test_devices.py"}
    assert "format 2" in sel.map_state and "(2 test files ran it)" in sel.reasons[MODULE]


def test_a_context_names_the_test_node_id_a_rank_or_a_fixture_ran_for():
    users = {"world": {"tests/test_a.py::t1", "tests/test_b.py::t2"}}
    assert _test_of("tests/test_a.py::t[x|y]", users) == {"tests/test_a.py::t[x|y]"}
    assert _test_of("functional/test_a.py::t[p]|functional/test_a.py::u[q|r]", users) == {"functional/test_a.py::u[q|r]"}
    assert _test_of("functional/test_a.py::t[p]", users) == {"functional/test_a.py::t[p]"}  # a rank between cases
    assert _test_of("fixture:world", users) == users["world"] and _test_of("", users) == set()


def test_a_grid_case_is_credited_to_its_own_test(monkeypatch):
    """A grid runs whole when its first test asks: each case must count for the test that checks it."""
    monkeypatch.setattr(attribution, "_by_function", {})
    monkeypatch.setattr(attribution, "_by_file", {})
    for cid in ("a", "b"):
        attribution.register_case_test(f"functional/test_g.py::test_x[gloo2-{cid}]", "gloo", 2, cid)
    asker = "functional/test_g.py::test_x[gloo2-a]"
    assert attribution.case_test_id(asker, "gloo", 2, "b") == "functional/test_g.py::test_x[gloo2-b]"
    # a grid another test function of the file reads (grid_cases_for): the case's own test there
    assert attribution.case_test_id("functional/test_g.py::test_y[gloo2-z]", "gloo", 2, "b") == \
        "functional/test_g.py::test_x[gloo2-b]"
    assert attribution.case_test_id(asker, "gloo", 4, "b") == asker  # not registered: the asker
    assert attribution.case_test_id(None, "gloo", 2, "b") is None


def test_node_ids_run_alone_and_a_vanished_one_is_left_out(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "functional").mkdir()
    (tmp_path / "functional/test_slow.py").write_text("def test_s():\n    pass\n")
    (tmp_path / "tests/test_some.py").write_text("def test_one():\n    pass\n\n\ndef test_two():\n    assert False\n")
    (tmp_path / "tests/test_whole.py").write_text("def test_w():\n    pass\n")
    run = run_pytest(tmp_path, ["-p", "no:randomly", "-v", "functional/test_slow.py", "tests/test_whole.py"],
                     output="capture", timeout=120,
                     node_ids=["tests/test_some.py::test_one", "tests/test_some.py::test_gone"])
    assert run.exit_code == 0, run.output
    assert run.outcomes() == {"tests/test_some.py::test_one": "passed", "tests/test_whole.py::test_w": "passed",
                              "functional/test_slow.py::test_s": "passed"}
    assert run.missing == ["tests/test_some.py::test_gone"]
    # the unit tests ran first, though functional/ came first on the command line
    order = [line.split(" ")[0] for line in run.output.splitlines() if line.startswith(("tests/", "functional/"))]
    assert order == ["tests/test_whole.py", "tests/test_some.py", "functional/test_slow.py"], run.output


def test_a_grid_runs_only_the_cases_the_session_collected(monkeypatch):
    """Selecting some of a grid's node ids runs only their cases (the grid runs whole, with
    every case, when nothing is registered for its file: a run of all its tests, or a caller
    outside pytest), and the case a test asks for always."""
    from cpkit.testing.params import _run_cases

    monkeypatch.setattr(attribution, "_by_function", {})
    monkeypatch.setattr(attribution, "_by_file", {})
    monkeypatch.setattr(attribution, "_cases", {})
    cases_for = lambda backend, n: [{"id": "a"}, {"id": "b"}, {"id": "c"}]  # noqa: E731
    test = "functional/test_g.py::test_x[gloo2-b]"
    assert [c["id"] for c in _run_cases(cases_for, "gloo", 2, test)] == ["a", "b", "c"]
    attribution.register_case_test(test, "gloo", 2, "b")
    assert [c["id"] for c in _run_cases(cases_for, "gloo", 2, test)] == ["b"]
    assert [c["id"] for c in _run_cases(cases_for, "gloo", 2, test, own="c")] == ["b", "c"]
    assert len(_run_cases(cases_for, "gloo", 4, test)) == 3 and len(_run_cases(cases_for, "gloo", 2, None)) == 3
    attribution.clear_case_tests()
    assert attribution.collected_case_ids(test, "gloo", 2) is None


def test_a_context_of_several_tests_names_each():
    from cpkit.harness.attribution import TESTS_LABEL

    label = TESTS_LABEL + "functional/test_g.py::t[gloo2-a]\nfunctional/test_g.py::t[gloo2-b]"
    assert _test_of(label, {}) == {"functional/test_g.py::t[gloo2-a]", "functional/test_g.py::t[gloo2-b]"}
    assert _test_of("functional/test_g.py::t[gloo2-a]|" + label, {}) == _test_of(label, {})


def test_measured_as_switches_the_context_only_while_a_map_is_recorded(tmp_path, monkeypatch):
    coverage = pytest.importorskip("coverage")
    if coverage.Coverage.current() is not None:
        pytest.skip("coverage is measuring this process already (a map being recorded): one tracer at a time")
    monkeypatch.delenv(attribution.CONTEXT_ENV, raising=False)
    with attribution.measured_as(["tests/test_x.py::t"]):  # not recording: nothing to switch
        pass
    module = tmp_path / "probe_grid.py"
    module.write_text("def f():\n    return 1\n\n\ndef g():\n    return 2\n")
    monkeypatch.setenv(attribution.CONTEXT_ENV, "tests/test_x.py::first")
    cov = coverage.Coverage(data_file=str(tmp_path / ".coverage"), include=[str(module)])
    cov.start()
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("probe_grid", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cov.switch_context("tests/test_x.py::first")
        with attribution.measured_as(["tests/test_x.py::a", "tests/test_x.py::b"]):
            mod.f()
        mod.g()  # back to the running test
    finally:
        cov.stop()
    contexts = cov.get_data().contexts_by_lineno(str(module))
    assert _test_of(contexts[2][0], {}) == {"tests/test_x.py::a", "tests/test_x.py::b"}
    assert contexts[6] == ["tests/test_x.py::first"]


def test_a_body_change_runs_the_import_graph_checks_with_the_per_module_one_for_its_module_only():
    """The per-module import check runs for the changed module, not for every library module
    (a body change cannot change another module's imports); the file's other checks all run."""
    from pathlib import Path

    from cpkit.validation.changed_selection import PER_MODULE_CHECK, source_check_nodes

    root = Path(__file__).resolve().parents[1]
    nodes = source_check_nodes(root, ["src/cpkit/eval_cp/loop.py", "src/cpkit/attention/__init__.py"])
    per_module = sorted(n for n in nodes if PER_MODULE_CHECK in n)
    assert per_module == [f"tests/test_import_graph.py::{PER_MODULE_CHECK}[cpkit.attention]",
                          f"tests/test_import_graph.py::{PER_MODULE_CHECK}[cpkit.eval_cp.loop]"]
    assert "tests/test_import_graph.py::test_each_layer_imports_only_layers_below" in nodes
    assert "tests/test_import_graph.py::test_no_import_circle_in_the_package" in nodes
