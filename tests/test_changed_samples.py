"""The one-function-change bench (cpkit.bench.validation.changed_samples): where its no-op goes, and its
refusal of a function that is not there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cpkit.bench.validation.changed_samples import DEFAULT_FUNCTIONS, insert_noop, main

ROOT = Path(__file__).resolve().parents[1]
SOURCE = '''\
def plain(x):
    return x + 1


def documented(x):
    """Says why.

    At length."""
    y = x * 2
    return y


class Box:
    def method(self):
        return 3
'''


def _body_names(source: str, qualname: str) -> list[str]:
    node = ast.parse(source)
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part)
    return [ast.unparse(s).split("\n")[0] for s in node.body]


@pytest.mark.parametrize("name,position", [("plain", 0), ("documented", 1), ("Box.method", 0)])
def test_the_noop_is_the_functions_first_statement_after_its_docstring(name, position):
    changed = insert_noop(SOURCE, name)
    assert _body_names(changed, name)[position] == "_sampled_change = None"
    assert len(changed.splitlines()) == len(SOURCE.splitlines()) + 1
    # nothing else moves: every other function's body is the same
    for other in {"plain", "documented", "Box.method"} - {name}:
        assert _body_names(changed, other) == _body_names(SOURCE, other)


@pytest.mark.parametrize("name,says", [("missing", "no function 'missing'"), ("Box", "a class, not a function")])
def test_a_name_that_is_no_function_is_refused(name, says):
    with pytest.raises(ValueError, match=says):
        insert_noop(SOURCE, name)


def test_the_default_functions_exist_and_a_bad_one_is_named_before_any_run(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the bench works on the checkout it runs in
    root_source = {path: (ROOT / path).read_text() for path in {f.split("::")[0] for f in DEFAULT_FUNCTIONS}}
    for change in DEFAULT_FUNCTIONS:
        path, name = change.split("::")
        insert_noop(root_source[path], name)  # raises if a default went missing
    with pytest.raises(SystemExit) as exc:
        main(["--function", "src/cpkit/loss.py::no_such_function", "--function", "nowhere.py::f"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no function 'no_such_function'" in err and "'nowhere.py::f'" in err and DEFAULT_FUNCTIONS[0] in err
