"""The measured coverage map: which test files execute which cpkit function, rank processes
included, for `cpkit validate --changed`.

The map lives in the repository (MAP_PATH, JSON): per function (`path::qualname`) the tests
(pytest node ids, format 3) that ran a line of its body, in the pytest process or in a rank it
spawned. Format 3 keeps `nodes`, the sorted node ids, and per function the indices of its
tests in `nodes`, written as ranges (`encode_indices`: an int, or [first, last] for a run of
consecutive indices); formats 1 and 2 kept test files instead and still load (their test files
stand for every test in them). With it, the
commit it was measured at and what the code was then (formats 2 and 3): the git blob id of every cpkit
module and test file, and per module the short hashes of its functions and of its module-level
code (src/cpkit/validation/code_hashes.py). `drift_since` compares those with the code now, without git:
which functions changed, are new or were deleted since, which modules' module-level code and
which test files changed. `cpkit validate --changed` (src/cpkit/validation/changed_selection.py) widens its
selection by that drift, so an old map still selects soundly, only more; `cpkit validate
--record-map` (src/cpkit/validation/coverage_record.py) measures a fresh one. A format-1 map (blob ids
only) still loads: a module whose blob differs counts as wholly changed.

Rank processes: coverage.py's multiprocessing support starts measurement in every spawned rank;
a rank's data carries the test that launched it, and a pooled rank names each case's test
(cpkit.harness.attribution: the harness attributes a rank's work, the map only reads it).
"""

from __future__ import annotations

import ast
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cpkit.validation.code_hashes import git_blob_id, iter_functions, source_hashes

__all__ = ["MAP_PATH", "MAP_VERSION", "encode_indices", "decode_indices", "file_of", "function_spans", "functions_at_lines", "blob_hash", "is_test_dependency",
           "tracked_files", "CoverageMap", "load_map", "Drift", "drift_since", "code_state"]

#: Where the map is kept, relative to the repository root.
MAP_PATH = "evidence/coverage-map.json"
#: The format `cpkit validate --record-map` writes (3: test node ids per function; 2: test files
#: per function, with per-function and module-level hashes; 1: test files and blob ids only).
MAP_VERSION = 3
#: The folders whose test files and modules the map depends on.
TEST_FOLDERS = ("tests", "functional")


def encode_indices(indices) -> list:
    """Sorted distinct `indices` as a compact JSON list: an int alone, [first, last] for a run
    of two or more consecutive ones (a function run by a whole test file is one pair)."""
    out: list = []
    for i in sorted(set(indices)):
        last = out[-1] if out else None
        if isinstance(last, list) and last[1] == i - 1:
            last[1] = i
        elif isinstance(last, int) and last == i - 1:
            out[-1] = [last, i]
        else:
            out.append(i)
    return out


def decode_indices(encoded: list) -> list[int]:
    """The indices `encode_indices` wrote."""
    out: list[int] = []
    for item in encoded:
        out.extend(range(item[0], item[1] + 1) if isinstance(item, list) else (item,))
    return out


def file_of(nodeid: str) -> str:
    """The test file of a pytest node id (`tests/test_x.py::test_y[p]` -> `tests/test_x.py`)."""
    return nodeid.split("::", 1)[0]


def function_spans(source: str) -> list[tuple[int, int, str]]:
    """(first body line, last line, qualified name) of every function of `source`, methods and
    nested functions included (`Cls.method`, `outer.inner`), outer before inner. A function's
    body excludes its decorators and signature: those run when the `def` runs."""
    return [(node.body[0].lineno, node.end_lineno or node.body[-1].lineno, name)
            for name, node in iter_functions(ast.parse(source).body)]


def _innermost(spans: list[tuple[int, int, str]], line: int) -> str | None:
    best = None
    for first, last, name in spans:
        if first <= line <= last and (best is None or first >= best[0]):
            best = (first, name)
    return best[1] if best else None


def functions_at_lines(source: str, lines: set[int]) -> tuple[set[str], set[int]]:
    """(qualified names of the functions whose body holds one of `lines`, the lines in no
    function body: module or class level, a signature, a decorator)."""
    spans = function_spans(source)
    names, outside = set(), set()
    for line in lines:
        name = _innermost(spans, line)
        if name is None:
            outside.add(line)
        else:
            names.add(name)
    return names, outside


def blob_hash(data: bytes) -> str:
    """git's blob id of `data` (src/cpkit/validation/code_hashes.py::git_blob_id)."""
    return git_blob_id(data)


def is_test_dependency(path: str) -> bool:
    """True for a .py file under tests/ or functional/ (a test file, conftest or helper)."""
    return path.split("/")[0] in TEST_FOLDERS and path.endswith(".py")


def tracked_files(root: Path) -> dict[str, str]:
    """Repository path -> blob id of every .py file under src/cpkit, tests and functional in the
    working tree (tracked and untracked, not ignored; every file there without git)."""
    folders = ["src/cpkit", *TEST_FOLDERS]
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *folders],
                                cwd=root, capture_output=True, text=True)
    except OSError:  # no git installed
        listed = None
    if listed is not None and listed.returncode == 0:
        paths = set(listed.stdout.splitlines())
    else:  # not a git checkout (an unpacked archive): every file there, caches aside
        paths = {f.relative_to(root).as_posix() for folder in folders if (root / folder).is_dir()
                 for f in (root / folder).rglob("*.py") if "__pycache__" not in f.parts}
    return {p: blob_hash((root / p).read_bytes()) for p in sorted(paths)
            if p.endswith(".py") and (root / p).is_file()}


@dataclass
class CoverageMap:
    """A loaded map. `functions`: path::qualname -> test files that ran a line of its body;
    `nodes` (format 3, else empty): path::qualname -> the test node ids that did;
    `blobs`: blob id per file when measured (formats 2 and 3: every cpkit module and test file; format
    1: the modules the run executed and every test file); `module_hashes` and `function_hashes`
    (formats 2 and 3, else empty): cpkit.validation.code_hashes of every cpkit module when measured;
    `levels`: test file -> {level: number of tests}; `recorded`: provenance."""

    commit: str
    version: int
    blobs: dict[str, str]
    functions: dict[str, list[str]]
    module_hashes: dict[str, str] = field(default_factory=dict)
    function_hashes: dict[str, dict[str, str]] = field(default_factory=dict)
    levels: dict[str, dict[str, int]] = field(default_factory=dict)
    recorded: dict = field(default_factory=dict)
    nodes: dict[str, list[str]] = field(default_factory=dict)
    all_nodes: list[str] = field(default_factory=list)  # format 3: every test node id it recorded

    @property
    def has_nodes(self) -> bool:
        """True for a map that names test node ids (format 3), not only test files."""
        return self.version >= 3

    def nodes_of(self, path: str, qualname: str) -> list[str] | None:
        """The test node ids that ran a line of `qualname` in module `path`; None when none did
        or the map names only files (format 1 or 2)."""
        return self.nodes.get(f"{path}::{qualname}")

    def tests_of(self, path: str, qualname: str) -> list[str] | None:
        """The test files that ran a line of `qualname` in module `path`; None when none did."""
        return self.functions.get(f"{path}::{qualname}")

    def tests_of_module(self, path: str) -> set[str]:
        """The test files that ran a line of any function of module `path`."""
        prefix = path + "::"
        return {t for key, tests in self.functions.items() if key.startswith(prefix) for t in tests}


def load_map(root: Path) -> CoverageMap | None:
    """The map at root/MAP_PATH, None when there is none. Raises ValueError on a malformed one
    or a format this code cannot read (not 1, 2 or MAP_VERSION)."""
    path = Path(root) / MAP_PATH
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    version = raw.get("version")
    if version not in (1, 2, MAP_VERSION):
        raise ValueError(f"{MAP_PATH}: format {version!r}, this cpkit reads 1 to {MAP_VERSION}; re-record it "
                         "with `cpkit validate --record-map`")
    if version == 3:
        table = raw["nodes"]
        nodes = {key: [table[i] for i in decode_indices(idx)] for key, idx in raw["functions"].items()}
        files = {key: sorted({file_of(n) for n in ids}) for key, ids in nodes.items()}
        return CoverageMap(raw["commit"], version, raw["blobs"], files, raw["modules"], raw["hashes"],
                           raw.get("levels", {}), raw.get("recorded", {}), nodes, list(table))
    tests = raw["tests"]
    functions = {key: [tests[i] for i in idx] for key, idx in raw["functions"].items()}
    if version == 1:  # blob ids only: a module whose blob differs counts as wholly changed
        return CoverageMap(raw["commit"], 1, raw["files"], functions, levels=raw.get("levels", {}),
                           recorded=raw.get("recorded", {}))
    return CoverageMap(raw["commit"], version, raw["blobs"], functions, raw["modules"], raw["hashes"],
                       raw.get("levels", {}), raw.get("recorded", {}))


@dataclass
class Drift:
    """What changed in the code since the map was measured. Per cpkit module: `changed` and
    `new` and `deleted` functions (by qualified name); `module_level`: modules whose code
    outside function bodies changed, new or deleted modules; `unhashed`: modules of a format-1
    map whose blob differs (or that it did not execute): every function in them counts as
    changed. `test_files`: test files (and conftest, helpers) changed or new."""

    changed: dict[str, set[str]] = field(default_factory=dict)
    new: dict[str, set[str]] = field(default_factory=dict)
    deleted: dict[str, set[str]] = field(default_factory=dict)
    module_level: set[str] = field(default_factory=set)
    unhashed: set[str] = field(default_factory=set)
    test_files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """e.g. '12 functions changed, 3 new, 1 deleted, module-level code of 4 modules, 2 test files'."""
        count = lambda d: sum(len(v) for v in d.values())  # noqa: E731
        parts = [f"{count(self.changed)} functions changed", f"{count(self.new)} new", f"{count(self.deleted)} deleted",
                 f"module-level code of {len(self.module_level)} modules", f"{len(self.test_files)} test files"]
        if self.unhashed:
            parts.append(f"{len(self.unhashed)} modules changed as whole files (a format-1 map has no hashes)")
        return ", ".join(parts)

    def size(self) -> int:
        """How far the map is behind the code: functions changed, new or deleted, plus modules
        whose module-level code changed (new and deleted modules included) or, for a format-1
        map, whose blob differs."""
        return sum(len(v) for d in (self.changed, self.new, self.deleted) for v in d.values()) + \
            len(self.module_level | self.unhashed)

    def paths(self) -> list[str]:
        """Every repository path that changed since the map."""
        return sorted({*self.changed, *self.new, *self.deleted, *self.module_level, *self.unhashed,
                       *self.test_files})


def _is_module(path: str) -> bool:
    return path.startswith("src/cpkit/") and path.endswith(".py")


def drift_since(cmap: CoverageMap, root: Path) -> Drift:
    """What changed in the working tree at `root` since `cmap` was measured, from the hashes the
    map stores (no git needed). A module whose blob is unchanged is not parsed."""
    root = Path(root)
    current = tracked_files(root)
    out = Drift()
    out.test_files = sorted(p for p, blob in current.items() if is_test_dependency(p) and cmap.blobs.get(p) != blob)
    known = cmap.module_hashes if cmap.version >= 2 else cmap.blobs
    for path in sorted({p for p in current if _is_module(p)} | {p for p in known if _is_module(p)}):
        blob = current.get(path)
        if blob is not None and cmap.blobs.get(path) == blob:
            continue
        if cmap.version < 2:
            out.unhashed.add(path)
            continue
        before = cmap.function_hashes.get(path, {})
        if blob is None:  # deleted since
            out.module_level.add(path)
            if before:
                out.deleted[path] = set(before)
            continue
        module_hash, now = source_hashes((root / path).read_text())
        if cmap.module_hashes.get(path) != module_hash:
            out.module_level.add(path)
        for kind, names in (("changed", {q for q in now if q in before and before[q] != now[q]}),
                            ("new", set(now) - set(before)), ("deleted", set(before) - set(now))):
            if names:
                getattr(out, kind)[path] = names
    return out


def code_state(root: Path) -> dict:
    """The fields (formats 2 and 3) describing the code at `root` now: `blobs` of every cpkit module and
    test file, `modules` (module-level hash) and `hashes` (function hashes) of every cpkit module."""
    root = Path(root)
    blobs = tracked_files(root)
    modules, hashes = {}, {}
    for path in blobs:
        if _is_module(path):
            modules[path], functions = source_hashes((root / path).read_text())
            if functions:
                hashes[path] = functions
    return {"blobs": blobs, "modules": modules, "hashes": hashes}
