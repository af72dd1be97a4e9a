"""`cpkit validate` on a throw-away tree: a failing test is a fail row and exit 1, a test that
crashes pytest is named (with its level), and pytest-xdist does not count a test twice."""

import argparse
import textwrap

import pytest

from cpkit.commands import validate

PYPROJECT = textwrap.dedent("""
    [tool.pytest.ini_options]
    markers = ["dist: multi-process", "gpu2: two GPUs", "gpu4: four GPUs"]
""")


def _tree(tmp_path, files: dict[str, str]):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "src" / "cpkit").mkdir(parents=True)
    for folder in ("tests", "functional", "cards", "skills"):
        (tmp_path / folder).mkdir()
    for rel, text in files.items():
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path


def _validate(tmp_path, monkeypatch, capsys, pytest_args=""):
    monkeypatch.chdir(tmp_path)
    json_path = tmp_path / "report.json"
    rc = validate.run(argparse.Namespace(markers="", pytest_args=pytest_args, json=str(json_path)))
    import json

    rows = json.loads(json_path.read_text())["rows"]
    return rc, {(r["feature"], r["check"]): r for r in rows}, capsys.readouterr().out


def test_failing_test_is_a_fail_row_and_exit_1(tmp_path, monkeypatch, capsys):
    _tree(tmp_path, {"tests/test_a.py": """
        def test_ok():
            pass
        def test_bad():
            assert 0
    """})
    rc, rows, out = _validate(tmp_path, monkeypatch, capsys)
    assert rc == 1
    row = rows[("foundation", "unit tests")]
    assert not row["ok"] and row["result"].startswith("fail (1 failed, 1 passed)")
    assert row["failures"] == ["tests/test_a.py::test_bad"]
    assert "cpkit validate: FAIL" in out


def test_test_that_crashes_pytest_is_named_with_its_level(tmp_path, monkeypatch, capsys):
    _tree(tmp_path, {
        "tests/test_a.py": """
            def test_ok():
                pass
        """,
        "functional/test_b.py": """
            import os
            import pytest

            @pytest.mark.dist
            def test_crash():
                os.abort()
        """,
    })
    rc, rows, out = _validate(tmp_path, monkeypatch, capsys)
    assert rc == 1
    assert rows[("foundation", "unit tests")]["ok"]
    row = rows[("foundation", "dist tests")]  # the level survives the crash
    assert not row["ok"]
    assert len(row["failures"]) == 1 and row["failures"][0].startswith("functional/test_b.py::test_crash")
    assert "pytest stopped" in row["failures"][0]
    assert "FAILED [foundation / dist tests] functional/test_b.py::test_crash" in out


def test_xdist_counts_each_test_once(tmp_path, monkeypatch, capsys):
    pytest.importorskip("xdist")
    _tree(tmp_path, {"tests/test_a.py": """
        import pytest

        def test_one():
            pass
        def test_two():
            pass
        @pytest.mark.dist
        def test_three():
            pass
    """})
    rc, rows, _ = _validate(tmp_path, monkeypatch, capsys, pytest_args="-n 2")
    assert rc == 0
    assert rows[("foundation", "unit tests")]["result"] == "pass (2 passed)"
    assert rows[("foundation", "dist tests")]["result"] == "pass (1 passed)"
