"""The measured coverage map: which test files execute which cpkit function, rank processes
included, for `cpkit validate --changed`.

The map lives in the repository (MAP_PATH, JSON): per function (`path::qualname`) the test files
whose tests ran a line of its body, in the pytest process or in a rank it spawned. It is keyed
by the commit it was measured at and by the git blob hash of every file it depends on: each
cpkit module the run executed and each test file. `cpkit validate --record-map`
(src/cpkit/coverage_record.py) measures it. A map whose files differ from the code it is used
on is stale, and a stale map selects nothing: `--changed` then runs everything and says why.

Rank processes: coverage.py's multiprocessing support starts measurement in every spawned rank;
a rank's data carries the test that launched it (CONTEXT_ENV, read by the rank's coverage
config when it starts). A rank that runs cases for several tests (a pool that outlives one
test) names each case's test with `rank_case_context(test_id)`, the test id being what
`current_test_id()` returned in the pytest process that asked for the case.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["MAP_PATH", "CONTEXT_ENV", "current_test_id", "rank_case_context", "function_spans",
           "functions_at_lines", "blob_hash", "tracked_files", "CoverageMap", "load_map", "staleness"]

#: Where the map is kept, relative to the repository root.
MAP_PATH = "evidence/coverage-map.json"
#: Set in the pytest process to the running test's node id while a map is recorded; a rank
#: spawned then inherits it (its coverage config reads it as the rank's context).
CONTEXT_ENV = "CPKIT_COVERAGE_CONTEXT"
#: The folders whose test files and modules the map depends on.
TEST_FOLDERS = ("tests", "functional")


def current_test_id() -> str | None:
    """The test being measured in this (pytest) process, or None when no map is being recorded.
    A rank pool sends it with each case, for `rank_case_context` on the rank side."""
    return os.environ.get(CONTEXT_ENV) or None


@contextlib.contextmanager
def rank_case_context(test_id: str | None) -> Iterator[None]:
    """In a rank process: attribute what runs inside the block to `test_id` (a pytest node id)
    in the coverage map being recorded; restores the previous attribution after. A no-op when
    `test_id` is None or nothing is being measured (coverage.py missing or not started)."""
    cov = None
    if test_id:
        try:
            import coverage

            cov = coverage.Coverage.current()
        except ImportError:  # coverage is a test extra: nothing can be measuring
            cov = None
    if cov is None:
        yield
        return
    previous = cov.switch_context(test_id)
    try:
        yield
    finally:
        cov.switch_context(previous or "")


def _qualified(nodes: list[ast.AST], prefix: str, out: list[tuple[int, int, str]]) -> None:
    """Collect the functions among `nodes` and inside their compound statements (an `if`, a
    `try`), not looking into a function or class except through its own name."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            out.append((node.body[0].lineno, node.end_lineno or node.body[-1].lineno, name))
            _qualified(node.body, name + ".", out)
        elif isinstance(node, ast.ClassDef):
            _qualified(node.body, prefix + node.name + ".", out)
        elif isinstance(node, ast.stmt):
            _qualified(list(ast.iter_child_nodes(node)), prefix, out)
        elif isinstance(node, ast.excepthandler | ast.match_case):
            _qualified(node.body, prefix, out)


def function_spans(source: str) -> list[tuple[int, int, str]]:
    """(first body line, last line, qualified name) of every function of `source`, methods and
    nested functions included (`Cls.method`, `outer.inner`), outer before inner. A function's
    body excludes its decorators and signature: those run when the `def` runs."""
    out: list[tuple[int, int, str]] = []
    _qualified(ast.parse(source).body, "", out)
    return out


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
    """git's blob id of `data` (what `git ls-tree` shows), so that a file can be compared with a
    commit without checking it out."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_test_dependency(path: str) -> bool:
    parts = path.split("/")
    return parts[0] in TEST_FOLDERS and path.endswith(".py")


def tracked_files(root: Path, commit: str | None) -> dict[str, str]:
    """Repository path -> blob id of every .py file under src/cpkit, tests and functional: at
    `commit`, or in the working tree (tracked and untracked, not ignored) when None."""
    folders = ["src/cpkit", *TEST_FOLDERS]
    if commit is not None:
        out = subprocess.run(["git", "ls-tree", "-r", commit, "--", *folders], cwd=root, capture_output=True,
                             text=True, check=True).stdout
        return {line.split("\t", 1)[1]: line.split()[2] for line in out.splitlines()
                if line.endswith(".py")}
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *folders],
                            cwd=root, capture_output=True, text=True)
    if listed.returncode == 0:
        paths = set(listed.stdout.splitlines())
    else:  # not a git checkout (an unpacked archive): every file there, caches aside
        paths = {f.relative_to(root).as_posix() for folder in folders for f in (root / folder).rglob("*.py")
                 if "__pycache__" not in f.parts}
    return {p: blob_hash((root / p).read_bytes()) for p in sorted(paths)
            if p.endswith(".py") and (root / p).is_file()}


@dataclass
class CoverageMap:
    """A loaded map: `functions` path::qualname -> test files; `files` the blob id of every file
    it depends on; `levels` test file -> {level: number of tests}; the rest is provenance."""

    commit: str
    files: dict[str, str]
    functions: dict[str, list[str]]
    levels: dict[str, dict[str, int]]
    recorded: dict

    def tests_of(self, path: str, qualname: str) -> list[str] | None:
        """The test files that ran a line of `qualname` in module `path`; None when none did."""
        return self.functions.get(f"{path}::{qualname}")

    def tests_of_module(self, path: str) -> set[str]:
        """The test files that ran a line of any function of module `path`."""
        prefix = path + "::"
        return {t for key, tests in self.functions.items() if key.startswith(prefix) for t in tests}

    def measured(self, path: str) -> bool:
        """True when the recorded run executed module `path` (imported it, at least)."""
        return path in self.files and path.startswith("src/")


def load_map(root: Path) -> CoverageMap | None:
    """The map at root/MAP_PATH, None when there is none. Raises ValueError on a malformed one."""
    path = Path(root) / MAP_PATH
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if raw.get("version") != 1:
        raise ValueError(f"{MAP_PATH}: version {raw.get('version')!r}, expected 1; re-record it with "
                         "`cpkit validate --record-map`")
    tests = raw["tests"]
    functions = {key: [tests[i] for i in idx] for key, idx in raw["functions"].items()}
    return CoverageMap(raw["commit"], raw["files"], functions, raw.get("levels", {}), raw.get("recorded", {}))


def staleness(cmap: CoverageMap | None, current: dict[str, str]) -> str | None:
    """Why `cmap` cannot be trusted for code whose files are `current` (tracked_files), or None
    when it can: a module it measured or a test file changed, was removed, or a test file was
    added since it was recorded. A module the run never executed may change freely: no measured
    test reached it (a call into it would have to come from a changed, measured file)."""
    if cmap is None:
        return f"no coverage map at {MAP_PATH}; record one with `cpkit validate --record-map`"
    changed = sorted(p for p, blob in cmap.files.items() if current.get(p) != blob)
    added = sorted(p for p in current if p not in cmap.files and _is_test_dependency(p))
    drift = changed + added
    if not drift:
        return None
    named = ", ".join(drift[:4]) + (f" and {len(drift) - 4} more" if len(drift) > 4 else "")
    return (f"the coverage map ({MAP_PATH}, measured at {cmap.commit[:12]}) is older than the code: "
            f"{named} changed since; refresh it with `cpkit validate --record-map`")
