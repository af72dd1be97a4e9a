"""Code anchors: `path` and `path::symbol` references from cards and skills into the repository.

An anchor names a file or folder relative to the repository root, optionally followed by `::` and a
symbol inside a Python file. The symbol may be dotted (`Class.method`) or use pytest's `::` form
(`TestClass::test_x`); a trailing parametrization (`test_x[p2p-2]`) is ignored, so a pytest node id
is also an anchor. Symbols are found by parsing the file with `ast`, never by importing it, so
checking an anchor has no side effects and works without GPUs or optional dependencies.

A path may be a glob (`tests/test_*.py`) or a template with `<placeholders>`
(`cards/<feature>/card.yaml`); it then resolves when it matches at least one path.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

__all__ = [
    "ANCHOR_PREFIXES",
    "is_anchor_token",
    "split_anchor",
    "resolve_anchor",
    "python_symbol_exists",
]

#: A backticked token that starts with one of these, or contains `::`, is an anchor.
ANCHOR_PREFIXES = ("src/", "tests/", "functional/", "skills/", "cards/", ".ci/")

_PARAM_SUFFIX = re.compile(r"\[.*\]$")
_PLACEHOLDER = re.compile(r"<[^<>/]+>")


def is_anchor_token(token: str) -> bool:
    """True when `token` (one whitespace-free word) is meant as a repository anchor."""
    return token.startswith(ANCHOR_PREFIXES) or "::" in token


def split_anchor(anchor: str) -> tuple[str, list[str]]:
    """Split `path::A.b` or `path::A::b[param]` into `("path", ["A", "b"])`."""
    path, _, symbol = anchor.partition("::")
    parts: list[str] = []
    for chunk in symbol.split("::") if symbol else []:
        chunk = _PARAM_SUFFIX.sub("", chunk)
        parts.extend(chunk.split("."))
    return path, parts


def resolve_anchor(root: str | Path, anchor: str) -> str | None:
    """Check one anchor against the tree at `root`.

    Returns None when it resolves, else a short reason (e.g. "no symbol 'Foo.bar' in src/x.py").
    """
    root = Path(root)
    path, parts = split_anchor(anchor)
    if not path:
        return "empty path"
    if path.startswith("/") or ".." in Path(path).parts:
        return "must be a path relative to the repository root"
    if "*" in path or _PLACEHOLDER.search(path):
        if parts:
            return "a glob or <template> path cannot carry a ::symbol"
        pattern = _PLACEHOLDER.sub("*", path).rstrip("/")
        return None if any(root.glob(pattern)) else "matches no path"
    target = root / path
    if not target.exists():
        return "does not exist"
    if path.endswith("/") and not target.is_dir():
        return "is not a folder"
    if not parts:
        return None
    if any(not p.isidentifier() for p in parts):
        return f"symbol {'.'.join(parts)!r} is not a dotted Python name"
    if target.suffix != ".py" or not target.is_file():
        return "a ::symbol needs a .py file"
    try:
        found = python_symbol_exists(target, parts)
    except SyntaxError as exc:
        return f"cannot parse {path}: {exc.msg} (line {exc.lineno})"
    return None if found else f"no symbol {'.'.join(parts)!r} in {path}"


def python_symbol_exists(file: str | Path, parts: list[str]) -> bool:
    """True when the dotted name `parts` is defined in the Python file (found with `ast`).

    Module level: functions, classes, assignments and imported names, also inside top-level
    `if`/`try`/`with` blocks. Inside a class: methods, nested classes and class attributes.
    Inside a function: nested functions and classes.
    """
    file = Path(file)
    tree = _parse(str(file.resolve()), file.stat().st_mtime_ns)
    body: list[ast.stmt] = tree.body
    defs_only = False
    for i, name in enumerate(parts):
        node = _find(body, name, defs_only)
        if node is None:
            return False
        if i < len(parts) - 1:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                return False
            body = node.body
            # A function's locals are not addressable; its nested defs are.
            defs_only = not isinstance(node, ast.ClassDef)
    return True


@functools.lru_cache(maxsize=256)
def _parse(path: str, _mtime_ns: int) -> ast.Module:
    # mtime is part of the key so an edited file is parsed again.
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def _find(body: list[ast.stmt], name: str, defs_only: bool = False) -> ast.stmt | None:
    """The statement in `body` (or its if/try/with blocks) that binds `name`, else None."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if stmt.name == name:
                return stmt
        elif defs_only:
            pass
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if name in _bound_names(targets):
                return stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound == name:
                    return stmt
        elif type(stmt).__name__ == "TypeAlias" and getattr(stmt.name, "id", None) == name:
            return stmt  # Python 3.12 `type X = ...`
        for block in _nested_blocks(stmt):
            found = _find(block, name, defs_only)
            if found is not None:
                return found
    return None


def _nested_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    if isinstance(stmt, ast.If):
        return [stmt.body, stmt.orelse]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [stmt.body]
    if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
        return [stmt.body, stmt.orelse, stmt.finalbody] + [h.body for h in stmt.handlers]
    return []


def _bound_names(targets: list[ast.expr]) -> set[str]:
    names: set[str] = set()
    for target in targets:
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            names |= _bound_names(list(target.elts))
    return names
