"""`cpkit validate` on a throw-away tree: a failing test is a fail row and exit 1, a test that
crashes pytest is named (with its level), and pytest-xdist does not count a test twice; and
`--changed` in a copy without `.git` or a shallow clone selects from the coverage map's hashes."""

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from cpkit.cli import build_parser
from cpkit.commands import validate
from cpkit.validation.change_base import GIT, MAP_HASHES, change_base, history_gap
from cpkit.validation.changed_selection import select_changed, selection_size
from cpkit.validation.coverage_map import MAP_PATH, load_map
from tests.test_coverage_map import MODULE, RUNS, TESTS, _edit, make_repo

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
    args = build_parser().parse_args(["validate", "--json", str(json_path), "--pytest-args", pytest_args])
    rc = validate.run(args)
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



def test_an_expected_failure_is_counted_as_xfailed_not_as_skipped(tmp_path, monkeypatch, capsys):
    _tree(tmp_path, {"tests/test_a.py": """
        import pytest

        def test_one():
            pass
        @pytest.mark.xfail(strict=True, raises=AssertionError, reason="upstream defect")
        def test_upstream():
            assert 0
        @pytest.mark.xfail(strict=False, raises=AssertionError, reason="sometimes")
        def test_loose():
            pass
        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass
        @pytest.mark.dist
        @pytest.mark.xfail(strict=True, raises=AssertionError, reason="upstream defect")
        def test_dist_upstream():
            assert 0
    """})
    rc, rows, _ = _validate(tmp_path, monkeypatch, capsys)
    assert rc == 0
    assert rows[("foundation", "unit tests")]["result"] == "pass (1 passed, 1 xfailed, 1 xpassed, 1 skipped)"
    assert rows[("foundation", "dist tests")]["result"] == "pass (1 xfailed)"  # it ran: not "skipped"

def _git(repo, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_changed_runs_only_the_changed_test_and_prints_json(tmp_path, monkeypatch, capsys):
    import json

    _tree(tmp_path, {
        "tests/test_a.py": "def test_a():\n    pass\n",
        "tests/test_b.py": "def test_b():\n    assert 0\n",  # broken, but not changed: not run
    })
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "base")
    _git(tmp_path, "checkout", "-qb", "work")
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n\ndef test_a2():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["validate", "--changed", "--json"])
    assert validate.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["changed"]["paths"] == ["tests/test_a.py"]
    assert report["changed"]["run"] == ["tests/test_a.py"]  # and the text check, where the tree has it
    assert report["rows"][0]["result"] == "pass (2 passed)"


def test_changed_docs_only_runs_no_tests(tmp_path, monkeypatch, capsys):
    _tree(tmp_path, {"tests/test_b.py": "def test_b():\n    assert 0\n"})
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "base")
    (tmp_path / "README.md").write_text("# notes\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "docs")  # on main itself: the base falls back to HEAD~1
    monkeypatch.chdir(tmp_path)
    assert validate.run(build_parser().parse_args(["validate", "--changed"])) == 0
    out = capsys.readouterr().out
    assert "1 paths; running no tests" in out and "unit tests" not in out


def _main_with_two_commits(tmp_path):
    _tree(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n", "tests/test_b.py": "def test_b():\n    pass\n"})
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "base")
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    assert True\n")
    _git(tmp_path, "commit", "-qam", "last commit")
    return tmp_path


def _head(repo, rev="HEAD"):
    import subprocess

    return subprocess.run(["git", "rev-parse", rev], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("uncommitted", ["unstaged", "staged", "untracked"])
def test_changed_on_main_with_uncommitted_changes_compares_with_head(tmp_path, uncommitted):
    repo = _main_with_two_commits(tmp_path)
    path = repo / "tests" / ("test_new.py" if uncommitted == "untracked" else "test_b.py")
    path.write_text("def test_b():\n    assert 1\n")
    if uncommitted == "staged":
        _git(repo, "add", ".")
    base, paths = validate.changed_paths(repo, None)
    assert base == _head(repo)
    assert paths == [str(path.relative_to(repo))]  # not the last commit's tests/test_a.py


def test_changed_on_a_clean_main_compares_with_the_last_commit(tmp_path):
    repo = _main_with_two_commits(tmp_path)
    assert validate.changed_paths(repo, None) == (_head(repo, "HEAD~1"), ["tests/test_a.py"])


def test_changed_on_main_with_one_commit_and_uncommitted_changes_needs_no_parent(tmp_path):
    _tree(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n"})
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "base")
    (tmp_path / "README.md").write_text("# notes\n")
    assert validate.changed_paths(tmp_path, None) == (_head(tmp_path), ["README.md"])


def test_gpu_tests_skipped_here_are_reported_as_owed():
    records = [{"nodeid": "functional/test_h.py::test_x[nccl4]", "outcome": "skipped"},
               {"nodeid": "functional/test_h.py::test_y[nccl4]", "outcome": "skipped"},
               {"nodeid": "functional/test_k.py::test_kernel", "outcome": "skipped"},
               {"nodeid": "functional/test_h.py::test_x[gloo4]", "outcome": "passed"}]
    levels = {"functional/test_h.py::test_x[nccl4]": "gpu4", "functional/test_h.py::test_y[nccl4]": "gpu4",
              "functional/test_k.py::test_kernel": "gpu1", "functional/test_h.py::test_x[gloo4]": "dist"}
    assert validate.gpu_owed(records, levels) == {"gpu1": {"functional/test_k.py": 1},
                                                  "gpu4": {"functional/test_h.py": 2}}


def test_changed_lines_are_the_lines_of_the_file_as_it_is_now(tmp_path):
    from cpkit.commands.validate import changed_lines

    _tree(tmp_path, {"m.py": "".join(f"line{i}\n" for i in range(1, 11))})
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    lines = [f"line{i}\n" for i in range(1, 11)]
    lines[2] = "changed3\n"  # line 3 changed
    del lines[6]  # old line 7 deleted: now between lines 6 and 7
    lines.insert(8, "new\n")  # a line added as line 9
    (tmp_path / "m.py").write_text("".join(lines))
    assert changed_lines(tmp_path, base, "m.py") == {3, 6, 7, 9}
    (tmp_path / "new.py").write_text("x\n")  # untracked: no hunk, every line counts
    assert changed_lines(tmp_path, base, "new.py") is None


def test_wide_is_an_option_of_changed():
    args = build_parser().parse_args(["validate", "--changed", "--wide"])
    assert args.wide and args.changed == ""
    assert not build_parser().parse_args(["validate", "--changed"]).wide


WALK = {
    "src/cpkit/walk.py": "def step(n):\n    return n + 1\n\n\ndef idle():\n    return 0\n",
    # The tree's module by path: the installed cpkit is another tree.
    "tests/test_walk.py": """
        import os
        import pathlib
        import sys

        sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "src" / "cpkit"))
        import walk


        def test_step():
            assert walk.step(1) == 2


        def test_other():  # the run knows it records the map (tests/test_coverage_map_fresh.py reads it)
            assert os.environ.get("CPKIT_RECORDING_MAP") == "1"
        """,
}


def test_record_map_is_the_full_validation_and_writes_the_map_from_its_own_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("coverage")
    import json

    from cpkit.validation.coverage_map import MAP_PATH, decode_indices

    _tree(tmp_path, WALK)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["validate", "--record-map", "--json", str(tmp_path / "report.json")])
    assert validate.run(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and any(r["check"] == "unit tests" and r["result"] == "pass (2 passed)" for r in report["rows"])
    recorded = json.loads((tmp_path / MAP_PATH).read_text())
    ran = {name: [recorded["nodes"][i] for i in decode_indices(v)] for name, v in recorded["functions"].items()}
    assert ran == {"src/cpkit/walk.py::step": ["tests/test_walk.py::test_step"]}  # idle ran under no test
    assert recorded["recorded"]["outcomes"] == {"passed": 2}
    assert "coverage map: 1 functions, 1 tests" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--changed"], ["-m", "not dist"], ["--pytest-args=-x"]])
def test_record_map_refuses_a_partial_run(tmp_path, monkeypatch, capsys, flags):
    _tree(tmp_path, WALK)
    monkeypatch.chdir(tmp_path)
    assert validate.run(build_parser().parse_args(["validate", "--record-map", *flags])) == 2
    assert "--record-map measures the whole suite" in capsys.readouterr().err
    assert not (tmp_path / "evidence").exists()


# ------------------------------------------------ --changed where git's history cannot give the base
# Any clone works: a copy without `.git` and a `git clone --depth 1` whose history lacks the
# coverage map's commit select by function from the map's hashes (cpkit.validation.change_base),
# and say so.

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

#: 20 recorded tests: the fake suite's own and 16 more that ran f or h, none g, so that a change
#: of g alone selects 1 of 20 (5%), as a one-function change should (at most 10%).
FILLERS = {f"tests/test_fill{i}.py": "def test_x():\n    assert True\n" for i in range(16)}
FILLER_RUNS = {f"tests/test_fill{i}.py::test_x": ["f" if i % 2 else "h"] for i in range(16)}


def _fake_repo(root: Path) -> Path:
    return make_repo(root, {**TESTS, **FILLERS}, {**RUNS, **FILLER_RUNS})


def _git_out(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _selected_by_changing_g(root: Path, base: str | None = None):
    _edit(root, "return x * 2", "return x * 3")
    found = change_base(root, base)
    sel = select_changed(root, found.base, found.paths, found.lines)
    return found, sel


def _assert_only_gs_tests(root: Path, sel) -> None:
    assert not sel.everything and not [f for f in sel.files if f.startswith("tests/test_")]
    assert sel.node_ids == ["tests/test_beta.py::test_b"]
    chosen, total = selection_size(sel, load_map(root))
    assert (chosen, total) == (1, 20) and chosen / total <= 0.10


def test_without_git_a_one_function_change_selects_that_functions_tests_from_the_maps_hashes(tmp_path):
    root = _fake_repo(tmp_path)
    assert not (root / ".git").exists()
    assert history_gap(root) == "not a git checkout"
    found, sel = _selected_by_changing_g(root)
    assert found.source == MAP_HASHES and found.paths == [MODULE] and found.base.startswith("c0ffee")
    assert "not a git checkout" in found.describe() and "per-function hashes" in found.describe()
    _assert_only_gs_tests(root, sel)


def test_without_git_or_a_map_the_error_says_what_to_do(tmp_path):
    (tmp_path / "src" / "cpkit").mkdir(parents=True)
    with pytest.raises(ValueError, match="no readable coverage map.*pass BASE"):
        change_base(tmp_path, None)


@needs_git
def test_a_depth_1_clone_without_the_maps_commit_selects_by_the_maps_hashes(tmp_path):
    origin = _fake_repo(tmp_path / "origin")
    _git_out(origin, "init", "-q", "-b", "main")
    _git_out(origin, "add", "-A")
    _git_out(origin, "commit", "-qm", "the code the map measures")
    measured = _git_out(origin, "rev-parse", "HEAD")
    raw = json.loads((origin / MAP_PATH).read_text())
    (origin / MAP_PATH).write_text(json.dumps(dict(raw, commit=measured)))
    _git_out(origin, "commit", "-qam", "the map, recorded at the commit before")
    (origin / "README.md").write_text("notes\n")
    _git_out(origin, "add", "README.md")
    _git_out(origin, "commit", "-qm", "a later commit")

    clone = tmp_path / "clone"
    _git_out(tmp_path, "clone", "-q", "--depth", "1", f"file://{origin}", str(clone))
    assert _git_out(clone, "rev-parse", "--is-shallow-repository") == "true"
    gap = history_gap(clone)
    assert gap == f"the history lacks the coverage map's commit {measured[:12]} (a shallow clone)"
    assert change_base(clone, None).paths == []  # the code is as the map measured it
    found, sel = _selected_by_changing_g(clone)
    assert found.source == MAP_HASHES and found.paths == [MODULE] and found.base == measured
    assert gap in found.why
    _assert_only_gs_tests(clone, sel)
    with pytest.raises(ValueError, match="shallow.*--unshallow"):
        change_base(clone, measured)  # a BASE the clone lacks: the error names the ways out

    # The full history has the map's commit: git's diff, with the same selection.
    found, sel = _selected_by_changing_g(origin)
    assert history_gap(origin) is None and found.source == GIT and found.lines[MODULE]
    _assert_only_gs_tests(origin, sel)


def test_validate_changed_without_git_runs_the_functions_tests_and_names_the_base(tmp_path, monkeypatch, capsys):
    """The command end to end in a copy without `.git`: one function changed runs its one test."""
    root = _fake_repo(tmp_path / "copy")
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "cards").mkdir()
    (root / "skills").mkdir()
    _edit(root, "return x * 2", "return x * 3")
    monkeypatch.chdir(root)
    assert validate.run(build_parser().parse_args(["validate", "--changed", "--json"])) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)["changed"]
    assert report["base_source"] == MAP_HASHES and report["base_why"].startswith("not a git checkout")
    assert report["paths"] == [MODULE] and not report["everything"]
    assert report["run_node_ids"] == ["tests/test_beta.py::test_b"] and report["run"] == []
    assert f"(base: {MAP_HASHES} (not a git checkout" in captured.err


def test_every_feature_with_a_card_owns_test_files_in_the_table():
    """`cpkit validate` prints a row per feature: a feature whose card exists but whose tests fall
    to "foundation" would be silently missing from it. MCore's hybrid CP is its dynamic CP."""
    from cpkit.commands.validate import feature_of

    root = Path(__file__).resolve().parents[1]
    files = [p.relative_to(root).as_posix() for d in ("tests", "functional") for p in (root / d).glob("test_*.py")]
    owned = {feature_of(f) for f in files}
    cards = {p.parent.name for p in (root / "cards").glob("*/card.yaml")} - {"validating-context-parallel-changes"}
    assert cards <= owned, sorted(cards - owned)
    assert feature_of("functional/test_hybrid_gdn.py::test_x") == "hybrid-context-parallel"
    assert feature_of("functional/test_mlm_gdn_cp.py") == "hybrid-context-parallel"
    assert feature_of("functional/test_mcore_hybrid_cp.py") == "dynamic-context-parallel"
