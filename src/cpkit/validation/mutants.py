"""Mutants of a Python module: small faults injected into its syntax tree, each a minimal text
edit. A flipped comparison (`<` -> `>=`), an integer constant off by one, `and` <-> `or`, a
dropped `not`, `+` <-> `-`, `*` <-> `//`, a return value replaced by None, or a statement (an
assignment or a call) replaced by `pass`.

Library code (no test support): `python -m cpkit.testing.mutation` runs a module's tests against
them, `python -m cpkit.bench changed_recall` runs `cpkit validate --changed` against them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

__all__ = ["Mutant", "find_mutants", "apply_mutant", "mutant_source"]

_COMPARE_FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}
_SYMBOL = {ast.Lt: "<", ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
           ast.FloorDiv: "//", ast.And: "and", ast.Or: "or"}


@dataclass(frozen=True)
class Mutant:
    """One fault: the `index`-th mutation site in walk order, at `line` and `col`, described by
    `change`."""

    index: int
    line: int
    col: int
    change: str

    @property
    def key(self) -> str:
        """`line:col: change`, the form --only and --equivalent take."""
        return f"{self.line}:{self.col}: {self.change}"


class _Sites(ast.NodeTransformer):
    """Walks a tree in a fixed order, numbering every mutation site; with `target` set, applies
    the mutation at that number instead."""

    def __init__(self, target: int | None = None):
        self.count = 0
        self.found: list[Mutant] = []
        self.target = target
        self.hit: ast.AST | None = None  # the mutated node, as it stood in the source
        self.replacement: ast.AST | None = None  # what takes its place

    def _site(self, node: ast.AST, change: str) -> bool:
        index = self.count
        self.count += 1
        self.found.append(Mutant(index, getattr(node, "lineno", 0), getattr(node, "col_offset", 0), change))
        if index == self.target:
            self.hit = self.replacement = node  # mutated in place unless a visitor says otherwise
        return index == self.target

    def _docstring(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    def visit_Compare(self, node):
        self.generic_visit(node)
        for i, op in enumerate(node.ops):
            flipped = _COMPARE_FLIP.get(type(op))
            if flipped and self._site(node, f"{_SYMBOL[type(op)]} -> {_SYMBOL[flipped]}"):
                node.ops[i] = flipped()
        return node

    def visit_Constant(self, node):
        if isinstance(node.value, int) and not isinstance(node.value, bool):
            if self._site(node, f"{node.value} -> {node.value + 1}"):
                self.replacement = ast.copy_location(ast.Constant(node.value + 1), node)
                return self.replacement
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        other = ast.Or if isinstance(node.op, ast.And) else ast.And
        if self._site(node, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[other]}"):
            node.op = other()
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and self._site(node, "drop not"):
            self.replacement = node.operand
            return node.operand
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        swapped = _BINOP_SWAP.get(type(node.op))
        if swapped and self._site(node, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[swapped]}"):
            node.op = swapped()
        return node

    def visit_Return(self, node):
        self.generic_visit(node)
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            if self._site(node, "return None"):
                node.value = None
        return node

    def _statement(self, node):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return node  # the export list: deleting it changes only `import *`
        self.generic_visit(node)
        if self._docstring(node):
            return node
        if self._site(node, f"delete {type(node).__name__.lower()}"):
            self.replacement = ast.copy_location(ast.Pass(), node)
            return self.replacement
        return node

    visit_Assign = visit_AugAssign = visit_Expr = _statement

    def visit_FunctionDef(self, node):
        # Decorators and default values are evaluated once at import: leave them alone.
        node.body = [self.visit(stmt) for stmt in node.body]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef


def find_mutants(source: str) -> list[Mutant]:
    """Every mutation site of `source`, in a fixed order."""
    sites = _Sites()
    sites.visit(ast.parse(source))
    return sites.found


def apply_mutant(source: str, mutant: Mutant) -> str:
    """`source` with `mutant` applied (formatting and comments are not kept)."""
    tree = ast.parse(source)
    _Sites(target=mutant.index).visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


def mutant_source(source: str, mutant: Mutant) -> str | None:
    """`source` with `mutant` applied as a minimal text edit (only the mutated expression or
    statement is rewritten; formatting, comments and line numbers elsewhere are kept), so that a
    diff against `source` shows the fault alone. None when the edit cannot be made faithfully
    (checked: the result parses to the same tree as `apply_mutant`), e.g. inside an f-string."""
    tree = ast.parse(source)
    sites = _Sites(target=mutant.index)
    mutated = ast.fix_missing_locations(sites.visit(tree))
    node, replacement = sites.hit, sites.replacement
    if node is None or not hasattr(node, "end_lineno"):
        return None
    text = ast.unparse(replacement)
    if isinstance(replacement, ast.expr):
        text = f"({text})"  # keeps precedence wherever the expression sits
    data = source.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    begin = starts[node.lineno - 1] + node.col_offset
    end = starts[node.end_lineno - 1] + node.end_col_offset
    edited = (data[:begin] + text.encode() + data[end:]).decode()
    try:
        same = ast.dump(ast.parse(edited)) == ast.dump(mutated)
    except SyntaxError:
        same = False
    return edited if same else None
