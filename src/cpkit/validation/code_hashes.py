"""Short content hashes of a module's functions and of its module-level code, so that the
coverage map (src/cpkit/validation/coverage_map.py) can tell which functions changed since it was
measured without git: compare the hashes it stored with the code's now.

- A function's hash covers its whole definition: decorators, signature and body, nested
  functions included (`outer` changes when `outer.inner` does). Several definitions under one
  qualified name (a property's getter and setter) hash together.
- A module's module-level hash covers everything outside function bodies: imports, constants,
  class statements, and each `def`'s decorators and signature, which run at import. So adding,
  removing or renaming a function, or changing a default, is a module-level change.

Hashes are over the syntax tree (`ast.dump` without positions): a comment, a blank line or a
moved function changes nothing; a docstring is code and counts.
"""

from __future__ import annotations

import ast
import hashlib
from typing import Iterator

__all__ = ["HASH_CHARS", "git_blob_id", "iter_functions", "function_hashes", "module_level_hash", "source_hashes"]

#: Hex characters kept of each sha1: enough that two versions of one function never collide in practice.
HASH_CHARS = 12

_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def git_blob_id(data: bytes) -> str:
    """git's blob id of a file's bytes (what `git ls-tree` shows), computed without git, so that
    a file can be compared with a commit in a copy that has no history."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def iter_functions(nodes: list[ast.AST], prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function among `nodes` and inside their compound
    statements (`if`, `try`, classes as `Cls.method`, nested functions as `outer.inner`), outer
    before inner."""
    for node in nodes:
        if isinstance(node, _FUNCTION):
            name = prefix + node.name
            yield name, node
            yield from iter_functions(node.body, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from iter_functions(node.body, prefix + node.name + ".")
        elif isinstance(node, ast.stmt):
            yield from iter_functions(list(ast.iter_child_nodes(node)), prefix)
        elif isinstance(node, ast.excepthandler | ast.match_case):
            yield from iter_functions(node.body, prefix)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:HASH_CHARS]


def function_hashes(source: str) -> dict[str, str]:
    """Qualified name -> hash of its definition(s) in `source`; SyntaxError for invalid Python."""
    dumps: dict[str, list[str]] = {}
    for name, node in iter_functions(ast.parse(source).body):
        dumps.setdefault(name, []).append(ast.dump(node, include_attributes=False))
    return {name: _digest("\n".join(parts)) for name, parts in dumps.items()}


class _StripBodies(ast.NodeTransformer):
    """Replace every function body by `...`: what stays runs at import."""

    def _strip(self, node):
        node.body = [ast.Expr(ast.Constant(...))]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _strip


def module_level_hash(source: str) -> str:
    """Hash of `source` outside function bodies (see the module docstring)."""
    tree = _StripBodies().visit(ast.parse(source))
    return _digest(ast.dump(tree, include_attributes=False))


def source_hashes(source: str) -> tuple[str, dict[str, str]]:
    """(module-level hash, function hashes) of `source`; an unparsable file hashes its text as
    module-level code (any edit then changes it) and has no functions."""
    try:
        return module_level_hash(source), function_hashes(source)
    except SyntaxError:
        return "text:" + _digest(source), {}
