"""The mutation driver (cpkit.testing.mutation) on a throw-away package: which faults it injects,
and that it tells killed mutants from survivors and leaves known-equivalent ones out of the score."""

import ast
import io
import json
import textwrap

from cpkit.testing.mutation import Mutant, apply_mutant, find_mutants, main, mutant_source, run

SOURCE = textwrap.dedent('''
    """A module."""
    __all__ = ["add", "unused"]


    def add(a, b):
        """Sum."""
        if not a < b and b:
            print(a)
        return a + b


    def unused():
        return 1
''')


def test_sites_in_a_fixed_order_and_the_export_list_left_alone():
    assert [m.key for m in find_mutants(SOURCE)] == [
        "8:11: < -> >=", "8:7: drop not", "8:7: and -> or", "9:8: delete expr", "10:11: + -> -",
        "10:4: return None", "14:11: 1 -> 2", "14:4: return None",
    ]


def test_apply_mutant_changes_exactly_one_site():
    mutated = apply_mutant(SOURCE, Mutant(4, 10, 11, "+ -> -"))
    assert "return a - b" in mutated and "not a < b and b" in mutated and "return 1" in mutated
    assert "return a" not in apply_mutant(SOURCE, Mutant(5, 10, 4, "return None")).replace("return a +", "")


def test_mutant_source_edits_only_the_mutated_text():
    """A diff of the edit names the fault's lines alone (the changed-tests recall bench relies on it)."""
    for mutant in find_mutants(SOURCE):
        edited = mutant_source(SOURCE, mutant)
        assert edited is not None, mutant
        assert ast.dump(ast.parse(edited)) == ast.dump(ast.parse(apply_mutant(SOURCE, mutant))), mutant
        differ = [i + 1 for i, (a, b) in enumerate(zip(SOURCE.splitlines(), edited.splitlines())) if a != b]
        assert differ == [mutant.line], mutant
    assert '"""Sum."""' in mutant_source(SOURCE, find_mutants(SOURCE)[4])  # docstrings kept


def test_run_tells_killed_from_survived_and_skips_equivalent_ones(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("from pkg.mod import add\n\n\ndef test_add():\n"
                                                    "    assert add(3, 2) == 5\n")
    keys = {"10:11: + -> -", "14:4: return None", "14:11: 1 -> 2"}
    report = run("src/pkg/mod.py", ["tests/test_mod.py"], root=tmp_path, only=keys, equivalent={"14:11: 1 -> 2"},
                 out=io.StringIO())
    outcome = {f"{r['line']}:{r['col']}: {r['change']}": r["outcome"] for r in report["results"]}
    assert outcome == {"10:11: + -> -": "killed", "14:4: return None": "survived", "14:11: 1 -> 2": "equivalent"}
    assert (report["mutants"], report["killed"], report["equivalent"], report["score"]) == (3, 1, 1, 0.5)


def test_pytest_options_after_the_double_dash_reach_the_test_run(tmp_path, monkeypatch):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("from pkg.mod import add, unused\n\n\n"
                                                    "def test_add():\n    assert add(3, 2) == 5\n\n\n"
                                                    "def test_unused():\n    assert unused() == 1\n")
    monkeypatch.chdir(tmp_path)
    key = "10:11: + -> -"
    # -k leaves out the one test that notices the fault: the mutant survives (exit 1).
    assert main(["src/pkg/mod.py", "--only", key, "--json", "k.json", "--",
                 "tests/test_mod.py", "-k", "unused"]) == 1
    report = json.loads((tmp_path / "k.json").read_text())
    assert report["tests"] == ["tests/test_mod.py", "-k", "unused"]
    assert [r["outcome"] for r in report["results"]] == ["survived"]
    assert main(["src/pkg/mod.py", "--only", key, "--", "tests/test_mod.py", "-k", "add"]) == 0
