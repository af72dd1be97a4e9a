"""Which tests reach a changed function: cpkit's top-level symbols and what each one uses, read
from the source with `ast` (nothing is imported), for the narrow `cpkit validate --changed`.

A symbol is a top-level def, class or assignment of a module, plus `<module>` for the rest of
its top-level code. A symbol uses another when its source names it: a name of its own module,
a name imported from a cpkit module (followed through re-exports), or an attribute of an
imported cpkit module (`kernels.attn_fwd`). A use that cannot be pinned to one symbol (a
module passed around whole, a name a package hands out through `__getattr__`) counts as a use
of every symbol of that module. `affected_tests` follows the uses backwards from the changed
symbols to the test files (tests/, functional/) and example runners that use one of them.

What the source does not show (a function looked up by a string, a scenario a test runs by
name) is not seen: the change map's rows add those tests (src/cpkit/validation/change_map.py).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from cpkit.validation.import_graph import SCRIPT_RUNNERS, TEST_FOLDERS, module_name, package_modules

__all__ = ["MODULE", "ALL", "symbols_at_lines", "affected_tests"]

MODULE = "<module>"
"""The pseudo-symbol of a module's top-level code that is no def, class or assignment."""
ALL = "*"
"""A use of a whole module (every symbol of it)."""


@dataclass
class _File:
    name: str  # module name (cpkit.x) or repository path for a test file
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # symbol -> line ranges
    uses: dict[str, set[tuple[str, str]]] = field(default_factory=dict)  # symbol -> (module, symbol)
    # imported name -> (module, symbol) of each import binding it (a name imported in two
    # functions from two modules is either)
    bindings: dict[str, set[tuple[str, str]]] = field(default_factory=dict)


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return []


def _bind(node: ast.stmt, package: str, modules: set[str], out: dict[str, set[tuple[str, str]]]) -> None:
    """Record the cpkit names an import statement binds (anywhere in the file)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                out.setdefault(alias.asname, set()).add((alias.name, ALL))
            else:  # `import a.b` binds a; attribute chains are resolved on use
                out.setdefault(alias.name.split(".")[0], set()).add((alias.name.split(".")[0], ALL))
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.setdefault(alias.asname or alias.name, set()).add((sub, ALL) if sub in modules else (base, alias.name))


def _attribute_chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _resolve_chain(chain: list[str], bindings: dict, modules: set[str]) -> set[tuple[str, str]]:
    """(module, symbol) of each cpkit symbol a name or attribute chain of this file may denote."""
    out = set()
    for mod, sym in bindings.get(chain[0], ()):
        rest = chain[1:]
        if sym != ALL:
            if mod in modules:
                out.add((mod, sym))
            continue
        while rest and f"{mod}.{rest[0]}" in modules:  # a.b.c through submodules
            mod, rest = f"{mod}.{rest[0]}", rest[1:]
        if mod in modules:
            out.add((mod, rest[0]) if rest else (mod, ALL))
    return out


def _uses(node: ast.AST, name: str, own: set[str], bindings: dict, modules: set[str]) -> set[tuple[str, str]]:
    """(module, symbol) of every cpkit symbol `node` names: a whole attribute chain is one use
    (`kernels.attn_fwd` uses attn_fwd, not all of kernels)."""
    out: set[tuple[str, str]] = set()
    todo = [node]
    while todo:
        sub = todo.pop()
        chain = _attribute_chain(sub) if isinstance(sub, (ast.Attribute, ast.Name)) else None
        if chain is None:
            todo.extend(ast.iter_child_nodes(sub))
            continue
        out |= {(name, chain[0])} if chain[0] in own else _resolve_chain(chain, bindings, modules)
    return out


def _parse(path: Path, name: str, package: str, modules: set[str]) -> _File:
    tree = ast.parse(path.read_text(), filename=str(path))
    info = _File(name)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _bind(node, package, modules, info.bindings)
    own = {t for node in tree.body for t in _targets(node)}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # a changed import changes every symbol
            info.spans.setdefault(MODULE, []).append((node.lineno, node.end_lineno or node.lineno))
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        symbols = _targets(node) or [MODULE]
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        uses = _uses(node, name, own, info.bindings, modules)
        for sym in symbols:
            info.spans.setdefault(sym, []).append((start, node.end_lineno or node.lineno))
            info.uses.setdefault(sym, set()).update(uses)
    return info


def _resolve(target: tuple[str, str], files: dict[str, _File]) -> tuple[set[tuple[str, str]], set[str]]:
    """Follow re-exports: (package, name) bound by an import in the package -> where it lives.
    Returns (the symbols it may be, the modules whose imports it passed through)."""
    out: set[tuple[str, str]] = set()
    passed: set[str] = set()
    seen: set[tuple[str, str]] = set()
    todo = [target]
    while todo:
        mod, sym = todo.pop()
        if (mod, sym) in seen:
            continue
        seen.add((mod, sym))
        info = files.get(mod)
        if sym == ALL or info is None or sym in info.spans:
            out.add((mod, sym))
        elif sym in info.bindings:
            passed.add(mod)
            todo.extend(info.bindings[sym])
        else:
            out.add((mod, ALL))  # handed out dynamically (module __getattr__) or gone: the whole module
    return out, passed


@lru_cache(maxsize=4)
def _graph(root: Path, package: str = "cpkit") -> tuple[dict[str, _File], dict[str, tuple[str, ...]]]:
    """(module or test path -> parsed file, test or script path -> the test files it selects)."""
    src = root / "src"
    paths = package_modules(src, package)
    modules = set(paths)
    files = {m: _parse(p, m, m if p.name == "__init__.py" else m.rsplit(".", 1)[0], modules)
             for m, p in paths.items()}
    selects: dict[str, tuple[str, ...]] = {}
    for folder in TEST_FOLDERS:
        for test in sorted((root / folder).glob("test_*.py")):
            rel = test.relative_to(root).as_posix()
            files[rel] = _parse(test, module_name(test, root), folder, modules)
            selects[rel] = (rel,)
    for folder, runners in SCRIPT_RUNNERS.items():
        for script in sorted((root / folder).glob("*.py")):
            rel = script.relative_to(root).as_posix()
            files[rel] = _parse(script, module_name(script, root), folder, modules)
            selects[rel] = tuple(runners)
    return files, selects


def symbols_at_lines(module_path: str, lines: set[int], root: Path) -> set[str]:
    """The symbols of the cpkit module at repository path `module_path` whose source (decorators
    included) covers one of `lines` (1-based); MODULE where a line is in an import or other
    top-level code; lines of comments, blank lines and docstrings between symbols cover none."""
    src = Path(root).resolve() / "src"
    files, _ = _graph(Path(root).resolve())
    info = files[module_name(src.parent / module_path, src)]
    return {sym for sym, spans in info.spans.items() if any(a <= ln <= b for a, b in spans for ln in lines)}


def affected_tests(changed: dict[str, set[str]], root: Path,
                   through: Callable[[str], bool] | None = None) -> list[str]:
    """Test files (and example runners) that use, directly or through other cpkit symbols, one of
    the `changed` symbols: repository path of a module -> names of its changed symbols (a changed
    MODULE symbol changes every symbol of that module; a use of the whole module, or of a name
    it no longer defines, counts even when no symbol changed). `through`: the modules a use may
    pass through (default: every one). Sorted."""
    root = Path(root).resolve()
    src = root / "src"
    files, selects = _graph(root)
    modules = {m for m in files if not m.endswith(".py")}
    hit: set[tuple[str, str]] = set()
    touched: set[str] = set()  # modules with an affected symbol
    for path, names in changed.items():
        mod = module_name(src.parent / path, src)
        names = set(files[mod].spans) | {MODULE} if MODULE in names else set(names)
        hit |= {(mod, n) for n in names}
        touched.add(mod)
    # Resolve every use once (a use through a changed import counts as a use of the module whose
    # import it passed), then propagate to a fixpoint.
    uses: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for f, info in files.items():
        for s, targets in info.uses.items():
            uses[(f, s)] = set()
            for t in targets:
                final, passed = _resolve(t, files)
                uses[(f, s)] |= final | {(m, MODULE) for m in passed}
    grew = True
    while grew:
        grew = False
        for key, targets in uses.items():
            if key in hit or (through is not None and key[0] in modules and not through(key[0])):
                continue
            if any(t in hit or (t[1] == ALL and t[0] in touched) or (t[0], MODULE) in hit for t in targets):
                hit.add(key)
                touched.add(key[0])
                grew = True
    return sorted({t for f, _ in hit if f in selects for t in selects[f]})
