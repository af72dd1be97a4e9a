"""The changed_recall bench's own logic (cpkit.bench.validation.changed_recall): probes that change no
behaviour, and the verdicts that recall is computed from."""

from __future__ import annotations

import sys
import types

import pytest

from cpkit.bench.validation.changed_recall import _segment, _summarise, probe_source
from cpkit.validation.mutants import find_mutants

SOURCE = '''\
def f(a, b):
    total = a + b
    if total > 3:
        return total * 2
    return -total
'''


def test_probes_record_each_site_and_change_no_result(monkeypatch):
    mutants, spans = [], []  # sites that do not overlap, as the bench samples them
    for m in find_mutants(SOURCE):
        start, end, _ = _segment(SOURCE, m)
        if not any(start < b and a < end for a, b in spans):
            mutants.append(m)
            spans.append((start, end))
    assert len(mutants) >= 3
    probed = probe_source(SOURCE, list(enumerate(mutants)))
    assert probed is not None and probed != SOURCE
    hits = []
    monkeypatch.setitem(sys.modules, "cpkit_recall_probe", types.SimpleNamespace(hit=hits.append))
    plain, with_probes = {}, {}
    exec(SOURCE, plain)
    exec(probed, with_probes)
    for a, b in [(1, 1), (3, 4), (-5, 2)]:
        assert with_probes["f"](a, b) == plain["f"](a, b)
    assert set(hits) <= set(range(len(mutants))) and hits


def _item(i):
    return {"id": f"src/cpkit/m.py:{i}", "focus": False}


def test_verdicts_from_the_log():
    items = [_item(i) for i in range(5)]
    ids = [it["id"] for it in items]
    log = {
        ("changed", ids[0]): {"caught": True, "seconds": 30.0, "run": ["tests/a.py"]},
        ("changed", ids[1]): {"caught": None, "everything": True, "seconds": None, "run": ["tests"]},
        # survivors: one reached only by its own selection, one reached outside it and caught there
        ("changed", ids[2]): {"caught": False, "seconds": 50.0, "run": ["tests/a.py"]},
        ("changed", ids[3]): {"caught": False, "seconds": 70.0, "run": ["tests/a.py"]},
        ("complement", ids[3]): {"caught": True},
        # a survivor reached outside its selection with no complement run yet: undecided
        ("changed", ids[4]): {"caught": False, "seconds": 90.0, "run": ["tests/a.py"]},
        ("probe", None): {"ids": ids[2:], "unprobed": [],
                          "reach": {ids[2]: ["tests/a.py"], ids[3]: ["tests/b.py"], ids[4]: ["tests/c.py"]}},
    }
    rows, summary = _summarise(items, log, full_seconds=800.0)
    assert [r["full"] for r in rows] == [True, "same run", False, True, None]
    assert summary["caught_by_full"] == 2 and summary["caught_by_changed"] == 1
    assert summary["recall"] == 0.5 and summary["misses"] == [ids[3]]
    assert summary["undecided"] == [ids[4]] and summary["selected_everything"] == 1
    assert summary["median_survivor_changed_s"] == 70.0  # survivors ran their whole selection
    assert rows[1]["time_ratio"] == 1.0 and rows[0]["time_ratio"] == round(30 / 800, 3)


def test_precision_is_the_share_of_the_suites_tests_each_selection_ran():
    from cpkit.bench.validation.changed_recall import selected_share

    counts = {"tests/a.py": 6, "tests/b.py": 3, "functional/c.py": 1}
    assert selected_share(["tests/a.py"], counts) == 0.6
    assert selected_share(["tests", "functional"], counts) == 1.0  # selected everything
    assert selected_share(["tests/"], counts) == 0.9 and selected_share(["tests/ab.py"], counts) == 0.0
    assert selected_share(["tests/a.py"], {}) is None
    items = [_item(i) for i in range(3)]
    ids = [it["id"] for it in items]
    log = {("suite", None): {"tests_per_file": counts},
           ("changed", ids[0]): {"caught": True, "seconds": 30.0, "run": ["tests/b.py"]},
           ("changed", ids[1]): {"caught": None, "everything": True, "seconds": None, "run": ["tests", "functional"]},
           ("changed", ids[2]): {"caught": False, "seconds": 90.0, "run": ["tests/a.py"]}}
    rows, summary = _summarise(items, log, full_seconds=800.0)
    assert [r["selected_share"] for r in rows] == [0.3, 1.0, 0.6]
    assert summary["median_selected_share"] == 0.6 and summary["worst_selected_share"] == 1.0
    assert summary["worst_selected_mutant"] == ids[1] and summary["worst_changed_s"] == 90.0


def test_precision_counts_the_node_ids_a_selection_ran_singly():
    from cpkit.bench.validation.changed_recall import selected_share

    counts = {"tests/a.py": 6, "tests/b.py": 3, "functional/c.py": 1}
    suite = [f"tests/a.py::t{i}" for i in range(6)] + [f"tests/b.py::u{i}" for i in range(3)] + ["functional/c.py::v"]
    assert selected_share([], counts, ["tests/a.py::t0", "functional/c.py::v"]) == 0.2
    # a node id of a file run whole counts once; one the suite no longer has counts as nothing
    assert selected_share(["tests/b.py"], counts, ["tests/b.py::u0", "tests/a.py::t1", "tests/a.py::gone"], suite) == 0.4
    items = [_item(0)]
    log = {("suite", None): {"tests_per_file": counts, "nodeids": suite},
           ("changed", items[0]["id"]): {"caught": True, "seconds": 20.0, "run": [], "node_ids": ["tests/a.py::t0"]}}
    rows, summary = _summarise(items, log, full_seconds=800.0)
    assert rows[0]["selected_share"] == 0.1 and rows[0]["run_node_ids"] == 1
    assert summary["median_selected_share"] == 0.1 and summary["worst_selected_share"] == 0.1


def test_a_survivor_reached_by_an_unselected_test_of_a_file_it_ran_partly_needs_that_test():
    """With node ids, a file --changed ran some tests of is not covered whole: a reaching test
    outside its node ids decides the verdict (run there), one inside does not."""
    items = [_item(0), _item(1)]
    ids = [it["id"] for it in items]
    changed = {"caught": False, "seconds": 10.0, "run": ["tests/b.py"], "node_ids": ["tests/a.py::t0"]}
    log = {("changed", ids[0]): changed, ("changed", ids[1]): changed,
           ("probe", None): {"ids": ids, "unprobed": [],
                             "reach": {ids[0]: ["tests/a.py::t0", "tests/b.py::u1"], ids[1]: ["tests/a.py::t1"]}}}
    rows, _ = _summarise(items, log, full_seconds=800.0)
    assert [r["full"] for r in rows] == [False, None]  # the second waits for its complement run on tests/a.py::t1
    log[("complement", ids[1])] = {"caught": True}
    rows, summary = _summarise(items, log, full_seconds=800.0)
    assert [r["full"] for r in rows] == [False, True] and summary["misses"] == [ids[1]]


def test_a_nested_runs_hits_are_credited_to_the_suite_test_that_started_it(tmp_path, monkeypatch):
    # functional/test_children.py and test_rank_pool.py start pytest runs in scratch folders,
    # whose tests have ids like "test_tree.py::..." (an earlier probe took them for suite tests).
    import importlib.util

    from cpkit.bench.validation import changed_recall

    (tmp_path / "probe_module.py").write_text(changed_recall._PROBE_SOURCE)
    spec = importlib.util.spec_from_file_location("probe_module", tmp_path / "probe_module.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    hits = tmp_path / "hits.tsv"
    monkeypatch.setenv(changed_recall._PROBE_ENV, str(hits))
    monkeypatch.setenv(changed_recall._OUTER_ENV, "")  # restored after: the plugin hook sets it
    probe.pytest_runtest_setup(types.SimpleNamespace(nodeid="functional/test_children.py::test_stop[pool]"))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "test_tree.py::test_starts_a_rank_pool (call)")  # the nested run
    probe.hit(3)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_b (call)")  # a pooled case of another test
    probe.hit(4)
    assert hits.read_text().splitlines() == ["3\tfunctional/test_children.py::test_stop[pool]",
                                             "4\ttests/test_a.py::test_b"]


def test_a_focus_module_with_every_site_taken_leaves_the_sample_its_size(tmp_path):
    from cpkit.bench.validation import changed_recall

    (tmp_path / "src/cpkit").mkdir(parents=True)
    (tmp_path / "src/cpkit/big.py").write_text(SOURCE * 4)
    (tmp_path / "src/cpkit/tiny.py").write_text("def g(x):\n    return x + 1\n")  # one site
    focus = ("src/cpkit/tiny.py", "src/cpkit/big.py")
    old, changed_recall.FOCUS = changed_recall.FOCUS, focus
    try:
        sample = changed_recall.sample_mutants(tmp_path, 6, seed=1)
    finally:
        changed_recall.FOCUS = old
    assert len(sample) == 6 and sum(item["path"] == "src/cpkit/tiny.py" for item in sample) == 1


def test_only_refuses_an_id_the_sample_does_not_hold(capsys, monkeypatch):
    """`--only` re-times mutants of the sample; an id outside it is named, with one that is in it."""
    from pathlib import Path

    from cpkit.bench.validation.changed_recall import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit) as exc:
        main(["--sample", "3", "--seed", "58", "--only", "src/cpkit/nowhere.py:1:0: nothing"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'src/cpkit/nowhere.py:1:0: nothing'" in err and "e.g. 'src/cpkit/" in err
