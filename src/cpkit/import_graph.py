"""cpkit's import graph, read from the source with `ast` (nothing is imported, so a lazy import
inside a function counts as much as one at the top of a module).

Used by the checks that library modules import no test support (tests/test_import_graph.py) and
that the change map selects every test file that imports a module, directly or through the
cpkit modules it imports (tests/test_change_map.py).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Iterable

__all__ = ["module_name", "imports", "package_modules", "cpkit_imports", "transitive_cpkit_imports",
           "TEST_FOLDERS", "SCRIPT_RUNNERS", "importing_tests"]

#: The folders of test files (test_*.py) whose imports select them.
TEST_FOLDERS = ("tests", "functional")
#: Scripts a test runs in a subprocess (so its own imports do not show them): folder -> that test.
SCRIPT_RUNNERS = {"examples": "functional/test_examples.py"}


def module_name(path: Path, root: Path) -> str:
    """Dotted name of the module at `path` below the import root `root` (a package's
    `__init__.py` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, as absolute names (`from a import b` counts `a` and `a.b`,
    since b may be a submodule); relative imports are resolved against `root`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def package_modules(src: Path, package: str = "cpkit") -> dict[str, Path]:
    """Module name -> file of every module of `package` under the import root `src`."""
    return {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}


def cpkit_imports(names: Iterable[str], modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that the imported `names` reach: each name that is a module, and
    every package on the way to it (importing `a.b.c` runs `a/__init__` and `a/b/__init__`)."""
    out = set()
    for name in names:
        parts = name.split(".")
        out.update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules)
    return out


@lru_cache(maxsize=None)
def _closure(src: Path, package: str) -> dict[str, frozenset[str]]:
    modules = package_modules(src, package)
    direct = {m: cpkit_imports(imports(p, src), modules) for m, p in modules.items()}
    closure: dict[str, frozenset[str]] = {}
    for start in modules:
        seen, todo = {start}, [start]
        while todo:
            for nxt in direct[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        closure[start] = frozenset(seen)
    return closure


def transitive_cpkit_imports(path: Path, root: Path, src: Path, package: str = "cpkit") -> set[str]:
    """Every module of `package` (under import root `src`) that importing the file `path`
    (module names relative to `root`) loads, directly or through the package's own imports."""
    closure = _closure(src.resolve(), package)
    modules = package_modules(src, package)
    out: set[str] = set()
    for m in cpkit_imports(imports(path, root), modules):
        out |= closure[m]
    return out


@lru_cache(maxsize=4)
def _tests_by_module(root: Path) -> dict[str, frozenset[str]]:
    src = root / "src"
    modules = package_modules(src)
    files = {m: p.relative_to(root).as_posix() for m, p in modules.items()}
    out: dict[str, set[str]] = {}
    for folder in TEST_FOLDERS:
        for test in sorted((root / folder).glob("test_*.py")):
            for m in transitive_cpkit_imports(test, root, src):
                out.setdefault(files[m], set()).add(test.relative_to(root).as_posix())
    for folder, runner in SCRIPT_RUNNERS.items():
        for script in sorted((root / folder).glob("*.py")):
            for m in transitive_cpkit_imports(script, root, src):
                out.setdefault(files[m], set()).add(runner)
    return {path: frozenset(tests) for path, tests in out.items()}


def importing_tests(module_path: str, root: Path) -> list[str]:
    """Test files of the repository at `root` (tests/ and functional/, test_*.py) that import the
    module at repository path `module_path` (e.g. "src/cpkit/sharding.py"), directly or through
    the cpkit modules they import, and the runner of each script (SCRIPT_RUNNERS) that does;
    sorted. Read once per root and process."""
    return sorted(_tests_by_module(Path(root).resolve()).get(module_path, ()))
