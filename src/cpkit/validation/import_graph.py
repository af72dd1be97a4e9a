"""cpkit's import graph, read from the source with `ast` (nothing is imported, so a lazy import
inside a function counts as much as one at the top of a module).

Used by the checks that each layer (LAYERS) imports only the layers below it and that library
modules import no test support (tests/test_import_graph.py), and that the change map selects
every test file that imports a module, directly or through the cpkit modules it imports
(tests/test_change_map.py).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["module_name", "imports", "package_modules", "cpkit_imports", "reach", "transitive_cpkit_imports",
           "TEST_FOLDERS", "SCRIPT_RUNNERS", "importing_tests", "named_imports", "import_cycles", "LAYERS",
           "layer_of", "layer_violations", "FEATURES", "BUILDS_ON", "feature_of", "feature_violations"]

#: The folders of test files (test_*.py) whose imports select them.
TEST_FOLDERS = ("tests", "functional")
#: Scripts tests run in a subprocess (so their own imports do not show them): folder -> those tests
#: (the examples as written, and with a fault planted in the path each one's skill names).
SCRIPT_RUNNERS = {"examples": ("functional/test_examples.py", "functional/test_example_faults.py")}

#: cpkit's layers, lowest first: (name, module-name prefixes). A module belongs to the layer whose
#: prefix names it most closely (the product, `cpkit`, is every module no other layer names) and
#: imports only from its own layer and the ones below. The product is what a training loop
#: imports; the harness runs code on many ranks; the validation tooling decides which tests a
#: change runs and judges what runs say; the consumers on top (test support, the cluster runner,
#: the benchmarks, the cards and skills checks, the commands and the CLI, the bundle tools) may
#: import anything.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the product", ("cpkit",)),
    ("the harness", ("cpkit.harness",)),
    ("the validation tooling", ("cpkit.validation",)),
    ("the consumers", ("cpkit.testing", "cpkit.cluster", "cpkit.bench", "cpkit.cards", "cpkit.skills",
                       "cpkit.commands", "cpkit.cli", "cpkit.tools")),
)


#: Inside the product: one package per CP feature, on the shared base (every other product module:
#: `cpkit.parallel`, `cpkit.upstream` and the modules at the top of `cpkit`). The base imports no
#: feature; a feature imports the base and only the features it builds on (BUILDS_ON).
FEATURES = ("cpkit.attention", "cpkit.hierarchical", "cpkit.eval_cp", "cpkit.dynamic", "cpkit.hybrid")
#: feature -> the features it builds on: dynamic CP switches groups per micro-batch with eval-time
#: CP's rebinding (cpkit.eval_cp.rebind); hybrid CP uses the attention's collectives and runs its
#: attention layers in zigzag.
BUILDS_ON = {"cpkit.dynamic": ("cpkit.eval_cp",), "cpkit.hybrid": ("cpkit.attention",)}

def module_name(path: Path, root: Path) -> str:
    """Dotted name of the module at `path` below the import root `root` (a package's
    `__init__.py` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_statements(path: Path, root: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) per import: (n, `a.b`, []) for `import a.b`, (n, `a`, [b, c]) for
    `from a import b, c`, with relative imports resolved against `root`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, base, [alias.name for alias in node.names]


def imports(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, as absolute names (`from a import b` counts `a` and `a.b`,
    since b may be a submodule); relative imports are resolved against `root`."""
    out: set[str] = set()
    for _, base, names in _import_statements(path, root):
        out.add(base)
        out.update(f"{base}.{n}" for n in names)
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


def reach(direct: dict[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    """Node -> every node it reaches through `direct` (node -> its direct successors), itself included."""
    closure: dict[str, frozenset[str]] = {}
    for start in direct:
        seen, todo = {start}, [start]
        while todo:
            for nxt in direct[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        closure[start] = frozenset(seen)
    return closure


@lru_cache(maxsize=None)
def _closure(src: Path, package: str) -> dict[str, frozenset[str]]:
    modules = package_modules(src, package)
    return reach({m: cpkit_imports(imports(p, src), modules) for m, p in modules.items()})


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
    for folder, runners in SCRIPT_RUNNERS.items():
        for script in sorted((root / folder).glob("*.py")):
            for m in transitive_cpkit_imports(script, root, src):
                out.setdefault(files[m], set()).update(runners)
    return {path: frozenset(tests) for path, tests in out.items()}


def importing_tests(module_path: str, root: Path) -> list[str]:
    """Test files of the repository at `root` (tests/ and functional/, test_*.py) that import the
    module at repository path `module_path` (e.g. "src/cpkit/sharding.py"), directly or through
    the cpkit modules they import, and the runner of each script (SCRIPT_RUNNERS) that does;
    sorted. Read once per root and process."""
    return sorted(_tests_by_module(Path(root).resolve()).get(module_path, ()))



def _longest_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def named_imports(path: Path, root: Path, src: Path | None = None, package: str = "cpkit") -> set[str]:
    """The modules of `package` (under import root `src`, default `root`) that the file `path`
    (module names relative to `root`) names in its imports: `import a.b` names a.b, `from a
    import b` names a.b when b is a submodule, else a. Unlike cpkit_imports, the packages on the
    way are not counted: Python imports a submodule while its package is still initializing, so
    that edge closes no circle."""
    modules = package_modules(src or root, package)
    out: set[str] = set()
    for _, base, names in _import_statements(path, root):
        out.update(_named_targets(base, names, modules))
    out.discard(module_name(path, root))
    return out


def _named_targets(base: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
    if len(targets) < len(names) or not names:  # something other than a submodule: base itself
        targets.append(_longest_module(base, modules))
    return [t for t in targets if t is not None]


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in `layers` of the layer `module` belongs to (its most specific prefix), None
    when no layer names it (a module of another package)."""
    found = [(len(p), i) for i, (_, prefixes) in enumerate(layers) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


def layer_violations(src: Path, layers=LAYERS, package: str = "cpkit") -> list[str]:
    """Every import of a module of `package` (under import root `src`) that reaches a layer above
    its own, lazy imports included, one line each, sorted: where (`src/cpkit/x.py:12`), the
    module and its layer, and the module it imports with that one's layer."""
    modules = package_modules(src, package)
    out = []
    for name, path in modules.items():
        own = layer_of(name, layers)
        for line, base, names in _import_statements(path, src):
            for target in _named_targets(base, names, modules):
                there = layer_of(target, layers)
                if own is not None and there is not None and there > own:
                    where = f"{path.relative_to(src.parent).as_posix()}:{line}"
                    out.append(f"{where}: {name} ({layers[own][0]}) imports {target} ({layers[there][0]})")
    return sorted(out)


def import_cycles(src: Path, package: str = "cpkit") -> list[list[str]]:
    """Every import circle among the modules of `package` under import root `src`: the strongly
    connected groups of two or more modules of the named_imports graph (a lazy import inside a
    function counts too), each sorted, the list sorted; empty when the layers only import down."""
    modules = package_modules(src, package)
    edges = {m: sorted(named_imports(p, src, src, package)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit)
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return sorted(out)


def feature_of(module: str) -> str | None:
    """The feature package (FEATURES) `module` belongs to, None for the shared base and others."""
    return next((f for f in FEATURES if module == f or module.startswith(f + ".")), None)


def feature_violations(src: Path, package: str = "cpkit") -> list[str]:
    """Every import inside the product (LAYERS[0]) that crosses features the wrong way, lazy
    imports included, one line each, sorted: a base module importing a feature, or a feature
    importing a feature it does not build on (BUILDS_ON)."""
    modules = package_modules(src, package)
    out = []
    for name, path in modules.items():
        if layer_of(name) != 0:
            continue
        own = feature_of(name)
        allowed = {own, None, *BUILDS_ON.get(own, ())}
        for line, base, names in _import_statements(path, src):
            for target in _named_targets(base, names, modules):
                there = feature_of(target)
                if layer_of(target) == 0 and there not in allowed:
                    where = f"{path.relative_to(src.parent).as_posix()}:{line}"
                    out.append(f"{where}: {name} ({own or 'the shared base'}) imports {target} ({there})")
    return sorted(out)
