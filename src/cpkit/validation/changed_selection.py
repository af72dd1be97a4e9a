"""What `cpkit validate --changed` runs: the measured callers of what changed (the coverage map,
src/cpkit/validation/coverage_map.py) and, where the map cannot decide, the static selection
(the change map and the symbol graph, src/cpkit/validation/change_map.py::select_tests).

The change is what the diff against BASE touches united with what changed since the map was
measured (coverage_map.drift_since, from the hashes the map stores: no git needed). The map's
edges are from its own commit: a test may reach a diff's function today through code that
changed since, so every such change widens the selection, and an older map selects more.
With a format-3 map (test node ids per function):
- a cpkit module whose whole change (in the diff and since the map) is inside the bodies of
  functions the map covers selects exactly the tests (node ids) that ran them, rank processes
  included, and not its change-map row: a body edit reaches the rest of the suite only through
  calls, which the map measured;
- any other change of a module brings in the static selection of the module (its change-map
  row and the tests using the changed symbols; with --wide every test importing it) and:
  a function the map has no coverage for (new, or never run) selects its module's whole feature
  (its change-map row and every test importing the module, `--wide`); a deleted function the
  tests that ran it and the whole feature; a covered function changed beside it its node ids;
  a change outside function bodies (module or class level, a decorator, a signature, a function
  added, removed or renamed), a new or a deleted module: the whole feature plus every test file
  that ran any function of the module (module-level code runs at import, which the map cannot
  attribute);
- every module change: the checks that read the source instead of running it (change_map's
  ALWAYS and ANY_MODULE: the text check, the import-graph check), which no map can attribute;
  for a body change the import-graph file's per-module check runs for the changed modules only;
- a test file (or conftest) changed or added since the map: itself (conftest: its row);
- any other path (docs, examples, configs): its static selection.
Node ids are run as single tests (ChangedSelection.node_ids, cpkit.validation.pytest_runner
keeps only those of their files); one the suite no longer has is left out, and said so.
A format 1 or 2 map (test files per function) selects as before: the static selection of every
changed path united with the test files that ran a changed function (a deleted function: those
that ran it); a format-1 map (blob ids only) counts a module whose blob differs as wholly changed.

The since-map part applies when the diff changes a cpkit module, the only case the map decides;
a docs-only or test-only diff runs its static selection alone. A missing or unreadable map, or
one of an unknown format, runs everything when a module changed, and says why.

The report also names the GPU tests (gpu1/gpu2/gpu4) the change makes stale: those in the
selected files (and the files of the selected node ids) and those of GPU-only test files
importing a changed module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cpkit.validation.change_map import ALWAYS, ANY_MODULE, EVERYTHING, select_tests
from cpkit.validation.coverage_map import (MAP_PATH, CoverageMap, Drift, drift_since, file_of, functions_at_lines,
                                           load_map)

__all__ = ["ChangedSelection", "select_changed", "changed_since_map", "drift_selection", "selection_size", "GPU_LEVELS"]

GPU_LEVELS = ("gpu1", "gpu2", "gpu4")


@dataclass
class ChangedSelection:
    """Test files to run (or everything), why, the map's state, and per GPU level the test
    files whose GPU tests the change makes stale."""

    files: list[str]
    reasons: dict[str, str]
    everything: bool
    map_state: str  # the map's commit and its drift, or why it was not used
    gpu_stale: dict[str, list[str]] = field(default_factory=dict)
    node_ids: list[str] = field(default_factory=list)  # single tests, of files not in `files`

    def to_dict(self) -> dict:
        return {"files": self.files, "node_ids": self.node_ids, "reasons": self.reasons,
                "everything": self.everything, "coverage_map": self.map_state, "gpu_stale": self.gpu_stale}



def _whole_feature(path: str, root: Path) -> tuple[set[str], bool]:
    """(the test files of `path`'s feature, whether that is everything): --wide for the path."""
    wide = select_tests([path], root, narrow=False)
    return set(wide.files), wide.everything


@dataclass
class _Change:
    """Per cpkit module: functions whose body changed, deleted functions, and whether its
    module-level code changed (with why), from the diff and the drift together."""

    functions: dict[str, set[str]] = field(default_factory=dict)
    deleted: dict[str, set[str]] = field(default_factory=dict)
    module_level: dict[str, str] = field(default_factory=dict)


def _change(root: Path, modules: list[str], lines: dict[str, set[int] | None], drift: Drift) -> _Change:
    out = _Change()
    for path in modules:  # the diff against BASE
        file = root / path
        if not file.is_file() or lines.get(path) is None:
            out.module_level[path] = "new or deleted module"
            continue
        names, outside = functions_at_lines(file.read_text(), lines[path])
        out.functions.setdefault(path, set()).update(names)
        if outside:
            out.module_level[path] = f"lines {min(outside)}-{max(outside)} outside a function body"
    for kind in ("changed", "new"):  # since the map
        for path, names in getattr(drift, kind).items():
            out.functions.setdefault(path, set()).update(names)
    for path, names in drift.deleted.items():
        out.deleted.setdefault(path, set()).update(names)
    for path in drift.module_level:
        out.module_level.setdefault(path, "module-level code changed since the map")
    for path in drift.unhashed:
        out.module_level.setdefault(path, "file changed since the map (format 1: no hashes)")
    return out


def _precise(change: _Change, cmap: CoverageMap) -> set[str]:
    """The modules whose whole change is inside the bodies of functions the map has test node
    ids for (format 3): those select exactly their tests, and nothing static."""
    if not cmap.has_nodes:
        return set()
    return {path for path, names in change.functions.items()
            if names and path not in change.module_level and not change.deleted.get(path)
            and all(cmap.nodes_of(path, name) for name in names)}


def _measured(root: Path, change: _Change, cmap: CoverageMap) -> tuple[set[str], set[str], bool, dict[str, str]]:
    """(test files, test node ids, everything?, reason per module) the coverage map selects for
    `change`. A format-3 map names node ids for a function it covers and widens a deleted
    function to its feature; a format 1 or 2 map names test files and a deleted function's own."""
    picked: set[str] = set()
    nodes: set[str] = set()
    everything = False
    why: dict[str, list[str]] = {}
    for path in sorted({*change.functions, *change.deleted, *change.module_level}):
        for name in sorted(change.functions.get(path, ())):
            tests = cmap.tests_of(path, name)
            if tests is None:
                feature, all_ = _whole_feature(path, root)
                picked |= feature
                everything |= all_
                why.setdefault(path, []).append(f"{name} (no recorded coverage: its whole feature)")
            elif cmap.has_nodes:
                ran = cmap.nodes_of(path, name) or []
                nodes.update(ran)
                why.setdefault(path, []).append(f"{name} ({len(ran)} tests in {len(tests)} files ran it)")
            else:
                picked.update(tests)
                why.setdefault(path, []).append(f"{name} ({len(tests)} test files ran it)")
        for name in sorted(change.deleted.get(path, ())):
            if cmap.has_nodes:
                ran = cmap.nodes_of(path, name) or []
                nodes.update(ran)
                feature, all_ = _whole_feature(path, root)
                picked |= feature
                everything |= all_
                why.setdefault(path, []).append(f"{name} deleted ({len(ran)} tests ran it; its whole feature)")
            else:
                tests = cmap.tests_of(path, name) or []
                picked.update(tests)
                why.setdefault(path, []).append(f"{name} deleted ({len(tests)} test files ran it)")
        if path in change.module_level:
            feature, all_ = _whole_feature(path, root)
            picked |= feature | cmap.tests_of_module(path)
            everything |= all_
            why.setdefault(path, []).append(f"{change.module_level[path]}: its feature and every test that ran "
                                            "the module")
    return picked, nodes, everything, {path: "; ".join(parts) for path, parts in why.items()}


def _gpu_stale(root: Path, changed_modules: list[str], files: list[str], everything: bool,
               cmap: CoverageMap | None) -> dict[str, list[str]]:
    """GPU level -> test files whose tests at that level the change makes stale."""
    levels = cmap.levels if cmap is not None else {}
    candidates = set(files)
    if everything:
        candidates |= set(levels)
    for path in changed_modules:
        for test in _whole_feature(path, root)[0]:
            if levels.get(test) and not set(levels[test]) - set(GPU_LEVELS):  # a GPU-only file
                candidates.add(test)
    out: dict[str, list[str]] = {}
    for test in sorted(candidates):
        for level in GPU_LEVELS:
            if levels.get(test, {}).get(level):
                out.setdefault(level, []).append(test)
    return {level: out[level] for level in GPU_LEVELS if level in out}


def changed_since_map(root: Path) -> tuple[str, list[str]] | None:
    """For a copy without git: (the map's commit, as the base, and the repository paths changed
    since the map, from its hashes), or None when there is no readable map."""
    try:
        cmap = load_map(root)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if cmap is None:
        return None
    return cmap.commit or "the coverage map", drift_since(cmap, root).paths()


def _map_state(cmap: CoverageMap, drift: Drift) -> str:
    commit = cmap.commit[:12] or "an unknown commit"
    return (f"measured at {commit} (format {cmap.version}); since then: {drift.summary()}. The selection "
            "grows with the map's age: `cpkit validate --record-map` refreshes it")


#: The check of tests/test_import_graph.py that runs once per library module, by module name.
PER_MODULE_CHECK = "test_library_module_imports_no_test_support"


def source_check_nodes(root: Path, modules) -> list[str]:
    """The node ids of the import-graph checks (ANY_MODULE) a body change of `modules` needs:
    every test of the file except the per-module check, which runs for these modules only
    (the other modules' imports did not change)."""
    import ast

    from cpkit.validation.import_graph import module_name

    nodes = []
    for test_file in ANY_MODULE:
        path = Path(root) / test_file
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                if fn.name != PER_MODULE_CHECK:
                    nodes.append(f"{test_file}::{fn.name}")
        names = [module_name(Path(root) / m, Path(root) / "src") for m in modules]
        nodes += [f"{test_file}::{PER_MODULE_CHECK}[{name}]" for name in names]
    return nodes


def select_changed(root: Path, base: str | None, changed: list[str], lines: dict[str, set[int] | None], *,
                   wide: bool = False) -> ChangedSelection:
    """The selection for repository paths `changed` since commit `base` (`lines`: changed line
    numbers per changed module, None for an untracked one), per the module docstring. Needs no
    git: `base` only names the diff's base in the report."""
    del base  # the diff is given; the map's drift comes from its hashes
    root = Path(root).resolve()
    modules = [p for p in changed if p.startswith("src/cpkit/") and p.endswith(".py")]
    if not modules:
        static = select_tests(changed, root, narrow=not wide, lines=lines)
        return ChangedSelection(static.files, dict(static.reasons), static.everything,
                                "not used: the diff changes no cpkit module", _gpu_stale(root, [], static.files,
                                                                                        static.everything, None))
    try:
        cmap = load_map(root)
        problem = None if cmap is not None else (f"no coverage map at {MAP_PATH}; record one with "
                                                 "`cpkit validate --record-map`")
    except (ValueError, KeyError, TypeError, OSError) as exc:
        cmap, problem = None, f"the coverage map cannot be read ({exc}); re-record it with `cpkit validate --record-map`"
    if problem is not None:
        static = select_tests(changed, root, narrow=not wide, lines=lines)
        reasons = dict(static.reasons, **{"(coverage map)": problem + ": running everything"})
        return ChangedSelection(list(EVERYTHING), reasons, True, problem, _gpu_stale(root, modules, [], True, None))
    return _select_with_map(root, changed, modules, lines, wide, cmap, drift_since(cmap, root))


def _select_with_map(root: Path, changed: list[str], modules: list[str], lines: dict[str, set[int] | None],
                     wide: bool, cmap: CoverageMap, drift: Drift) -> ChangedSelection:
    """select_changed once the map is loaded: the diff (`changed`, `modules`, `lines`) united
    with `drift`, what changed since the map."""
    change = _change(root, modules, lines, drift)
    precise = _precise(change, cmap)  # a body change of covered functions: its tests, no static rows
    static = select_tests([p for p in changed if p not in precise], root, narrow=not wide, lines=lines)
    since = select_tests(drift.test_files, root) if drift.test_files else None
    picked, nodes, measured_all, why = _measured(root, change, cmap)
    files = dict.fromkeys(static.files)
    reasons = dict(static.reasons)
    for path, text in why.items():
        reasons[path] = f"{reasons.get(path, '')}; measured: {text}".lstrip("; ")
    if since is not None:
        files.update(dict.fromkeys(since.files))
        reasons["(changed since the map)"] = ", ".join(drift.test_files)
    if precise:  # the checks that read the source rather than run it: no map can see them
        files.update(dict.fromkeys(ALWAYS))
        nodes = set(nodes) | set(source_check_nodes(root, precise))
        reasons["(source checks)"] = (f"{', '.join(ALWAYS)}; {', '.join(ANY_MODULE)} (its per-module check "
                                      "for the changed modules only)")
    files.update(dict.fromkeys(sorted(picked)))
    everything = static.everything or measured_all or (since is not None and since.everything)
    chosen = list(EVERYTHING) if everything else sorted(f for f in files if f in EVERYTHING or (root / f).exists())
    whole = set(chosen)
    node_ids = [] if everything else sorted(n for n in nodes if file_of(n) not in whole and (root / file_of(n)).is_file())
    return ChangedSelection(chosen, reasons, everything, _map_state(cmap, drift),
                            _gpu_stale(root, modules, chosen + sorted({file_of(n) for n in node_ids}), everything, cmap),
                            node_ids)


def drift_selection(root: Path, cmap: CoverageMap, drift: Drift | None = None) -> ChangedSelection:
    """What every `--changed` run of a module change selects on top of the change's own tests:
    the tests `drift` (default: the drift of the working tree at `root` since `cmap`) widens
    the selection by, with the source checks (ALWAYS, ANY_MODULE) a module change always runs."""
    root = Path(root).resolve()
    drift = drift if drift is not None else drift_since(cmap, root)
    sel = _select_with_map(root, [], [], {}, False, cmap, drift)
    if not sel.everything:
        sel.files = sorted({*sel.files, *(f for f in ALWAYS if (root / f).is_file())})
        checks = source_check_nodes(root, [p for p in drift.paths() if p.startswith("src/cpkit/")
                                           and (root / p).is_file()])
        sel.node_ids = sorted({*sel.node_ids, *(n for n in checks if file_of(n) not in sel.files)})
    return sel


def selection_size(sel: ChangedSelection, cmap: CoverageMap) -> tuple[int, int]:
    """(tests `sel` runs, tests there are): the map's node table, plus the tests of files it has
    no node of (ran no cpkit function, or new), counted by their recorded levels, else as 1."""
    table = cmap.all_nodes or sorted({n for ids in cmap.nodes.values() for n in ids})
    known = {file_of(n) for n in table}
    whole = set(sel.files)

    def unrecorded(files) -> int:
        return sum(max(1, sum(cmap.levels.get(f, {}).values())) for f in files - known)

    total = len(table) + unrecorded(set(cmap.levels) | whole)
    if sel.everything:
        return total, total
    chosen = {n for n in table if file_of(n) in whole} | set(sel.node_ids)
    return len(chosen) + unrecorded(whole), total
