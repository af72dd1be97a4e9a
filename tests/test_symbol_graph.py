"""The symbol graph (src/cpkit/validation/symbol_graph.py) behind the narrow `cpkit validate --changed`:
which tests use a changed function, on a small package written for the test and on cpkit."""

from __future__ import annotations

from pathlib import Path

from cpkit.validation.change_map import ALWAYS, ANY_MODULE, select_tests
from cpkit.validation.import_graph import named_imports, package_modules
from cpkit.validation.symbol_graph import MODULE, affected_tests, symbols_at_lines

ROOT = Path(__file__).resolve().parents[1]

_TREE = {
    "src/cpkit/__init__.py": "",
    "src/cpkit/feat/__init__.py": "from cpkit.feat.core import api\n",
    "src/cpkit/feat/core.py": "def helper():\n    return 1\n\n\ndef api():\n    return helper()\n\n\n"
                              "def other():\n    return 2\n",
    "src/cpkit/feat/extra.py": "from cpkit.feat import core\n\n\ndef wrap():\n    return core.other()\n",
    "src/cpkit/user.py": "from cpkit.feat import api\n\n\ndef build():\n    return api()\n",
    "tests/test_api.py": "from cpkit.feat import api\n\n\ndef test_api():\n    assert api() == 1\n",
    "tests/test_other.py": "def test_wrap():\n    from cpkit.feat.extra import wrap\n    assert wrap() == 2\n",
    "tests/test_user.py": "from cpkit.user import build\n\n\ndef test_build():\n    build()\n",
    "tests/test_whole.py": "def test_m(monkeypatch):\n    from cpkit.feat import core\n    monkeypatch.setattr(core, 'x', 1)\n",
}
CORE = "src/cpkit/feat/core.py"


def _tree(root: Path) -> Path:
    for name, text in _TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_changed_function_selects_the_tests_that_reach_it(tmp_path):
    root = _tree(tmp_path)
    # helper -> api (re-exported by the package) -> test_api and, through cpkit.user, test_user;
    # test_whole takes the whole module; test_other only uses `other`.
    assert affected_tests({CORE: {"helper"}}, root) == ["tests/test_api.py", "tests/test_user.py",
                                                         "tests/test_whole.py"]
    assert affected_tests({CORE: {"other"}}, root) == ["tests/test_other.py", "tests/test_whole.py"]
    # Only through the feature's own package: cpkit.user is not followed.
    inside = affected_tests({CORE: {"helper"}}, root, through=lambda m: m.startswith("cpkit.feat"))
    assert inside == ["tests/test_api.py", "tests/test_whole.py"]


def test_changed_lines_name_their_symbols_and_an_import_changes_every_user(tmp_path):
    root = _tree(tmp_path)
    assert symbols_at_lines(CORE, {2}, root) == {"helper"}
    assert symbols_at_lines(CORE, {3, 4}, root) == set()  # blank lines between functions
    assert symbols_at_lines("src/cpkit/feat/__init__.py", {1}, root) == {MODULE}
    assert affected_tests({CORE: set()}, root) == ["tests/test_whole.py"]  # a comment: whole-module users only
    # The package's re-export changed: whoever takes `api` from it is affected.
    assert affected_tests({"src/cpkit/feat/__init__.py": {MODULE}}, root) == ["tests/test_api.py",
                                                                             "tests/test_user.py"]


def test_the_narrow_selection_keeps_direct_importers_inside_the_wide_one():
    # For every module of cpkit: each test file whose own imports name the module is selected,
    # and the narrow selection never selects what the import closure (--wide) does not.
    src = ROOT / "src"
    modules = package_modules(src)
    names = {p.relative_to(ROOT).as_posix(): named_imports(p, ROOT, src)
             for folder in ("tests", "functional") for p in sorted((ROOT / folder).glob("test_*.py"))}
    problems = {}
    narrow_total = wide_total = 0
    for module, path in modules.items():
        path = path.relative_to(ROOT).as_posix()
        wide, narrow = select_tests([path]), select_tests([path], narrow=True)
        if wide.everything:
            assert narrow.everything, path
            continue
        narrow_total, wide_total = narrow_total + len(narrow.files), wide_total + len(wide.files)
        missed = sorted(t for t, named in names.items() if module in named and t not in narrow.files)
        extra = sorted(set(narrow.files) - set(wide.files))
        if missed or extra:
            problems[path] = {"missed": missed, "not in --wide": extra}
    assert problems == {}
    assert narrow_total < wide_total * 0.75, (narrow_total, wide_total)


def test_a_change_inside_one_function_selects_its_users_only():
    path = "src/cpkit/attention/kernels.py"
    start = next(i for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
                 if line.startswith("def kernel_candidates("))
    inside = select_tests([path], narrow=True, lines={path: {start + 1}})
    for test in ("tests/test_attention_unit.py", "tests/test_cudnn_fe.py", "tests/test_attention_module.py"):
        assert test in inside.files, test  # name it, or run attention through it
    assert "tests/test_flex_band.py" not in inside.files and not inside.everything
    everything = select_tests([path], narrow=True)
    assert set(inside.files) <= set(everything.files) < set(select_tests([path]).files)
    assert set(ALWAYS) | set(ANY_MODULE) <= set(inside.files)
