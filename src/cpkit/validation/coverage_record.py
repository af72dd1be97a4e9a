"""Measure the coverage map (src/cpkit/validation/coverage_map.py): `cpkit validate --record-map`.

Why coverage.py itself rather than pytest-cov or pytest-testmon: the map must see into every
process a test starts (ranks that `multiprocessing` spawns, torchrun and its ranks, the examples,
nested pytest runs), attribute each to the test that launched it, and end up as a small
reviewable JSON in the repository. coverage.py starts measuring in any Python process that
starts with COVERAGE_PROCESS_START set (its .pth file), and its config expands environment
variables when a process reads it, so a process's static context is the test that started it
(CONTEXT_ENV, inherited) and a rank pool can switch per case
(cpkit.harness.attribution.rank_case_context). The pytest process itself starts measuring the
same way. pytest-cov adds only the
per-test context switch, which this module's hooks do; testmon keeps its own SQLite database of fingerprints,
needs a plugin in every CI run and does not attribute spawned ranks to tests.

`cpkit validate --record-map` is the full validation with its own pytest run measured
(`MapRecording`): one run gives the table and a fresh map, so a developer who runs the full
validation before a merge refreshes the map at no second run. One pytest process, no xdist
workers (`-n 0`): a worker's tests would be measured apart from the process that records their
contexts. The run's time is in the map's `recorded.seconds`; what measuring costs over the same
run unmeasured is in the coverage map's evidence (`evidence/README.md`). CI's test command does
not measure.

Each test's work is recorded under its node id (format 3 of the map: node ids per function), a
rank's under the test that sent its case (cpkit.harness.attribution: a grid case under its own
test, not the test that happened to start the grid). Fixtures of module or wider scope are set
up once, during whichever test needs them first: what they run is recorded under
`fixture:<name>` and counted for every test using it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from cpkit.harness.attribution import CONTEXT_ENV, TESTS_LABEL
from cpkit.validation.coverage_map import (MAP_PATH, MAP_VERSION, TEST_FOLDERS, code_state, encode_indices, file_of,
                                           function_spans)

__all__ = ["map_recording", "MapRecording", "RECORDING_ENV", "build_map", "coverage_rcfile", "measured_env", "pytest_runtest_protocol", "pytest_fixture_setup"]

_FIXTURE_USES_ENV = "CPKIT_COVERAGE_FIXTURES"  # where the hooks write node id -> fixture names
#: Set in a run that writes the map: its own tests see the map it is about to replace.
RECORDING_ENV = "CPKIT_RECORDING_MAP"
_contexts: list[str] = []


def _switch(context: str) -> None:
    import coverage

    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(context)
    os.environ[CONTEXT_ENV] = context


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Attribute everything the test runs (setup, call, teardown, ranks it spawns) to its node id."""
    path = os.environ.get(_FIXTURE_USES_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps([item.nodeid, sorted(item.fixturenames)]) + "\n")
    _contexts.append(item.nodeid)
    _switch(item.nodeid)
    try:
        yield
    finally:
        _contexts.pop()
        _switch(_contexts[-1] if _contexts else "")


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture set up once for many tests is counted for every test that uses it."""
    if fixturedef.scope == "function":
        yield
        return
    _contexts.append(f"fixture:{fixturedef.argname}")
    _switch(_contexts[-1])
    try:
        yield
    finally:
        _contexts.pop()
        _switch(_contexts[-1] if _contexts else "")


def coverage_rcfile(tmp: Path, source: Path) -> Path:
    """Write the coverage.py config a map is recorded with (data under `tmp`, measuring `source`):
    run with `measured_env(rc)`, every Python process is measured, each under the test that
    started it. Returns its path."""
    rc = tmp / "coveragerc"
    rc.write_text("\n".join([
        "[run]",
        f"data_file = {tmp / 'data' / '.coverage'}",
        f"source = {source}",
        "parallel = true",
        # Not "multiprocessing": spawned ranks start measuring through COVERAGE_PROCESS_START, as
        # every other Python process does; its patch would start a second measurement in them.
        "concurrency = thread",
        "patch = _exit",
        "sigterm = true",
        # Expanded when each process reads this file: a spawned rank gets the test that spawned it.
        f"context = ${{{CONTEXT_ENV}}}",
        "",
    ]))
    (tmp / "data").mkdir()
    return rc


def measured_env(rcfile: Path) -> dict[str, str]:
    """The environment that makes every Python process started with it measure itself with
    `rcfile` (coverage.py's .pth file reads it at start-up). Raises RuntimeError where that
    .pth file is missing (coverage.py older than 7.10, or installed without it)."""
    env = {"COVERAGE_PROCESS_START": str(rcfile)}
    probe = subprocess.run([sys.executable, "-c", "import coverage.control as c; print(hasattr(c.process_startup, 'coverage'))"],
                           env={**os.environ, **env, CONTEXT_ENV: ""}, capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        raise RuntimeError("coverage.py does not start in new Python processes here (its a1_coverage.pth is missing "
                           f"from site-packages): the map would miss every rank and subprocess. Reinstall it: "
                           f"`{sys.executable} -m pip install --force-reinstall 'coverage>=7.16'`. {probe.stderr[-400:]}")
    return env


#: Where coverage.py joins a static and a dynamic context ("static|dynamic"): a "|" followed by
#: a test id or a fixture label (a node id's own parameters may hold a "|", but not followed by these).
_JOIN = re.compile(r"\|(?=(?:%s)/|fixture:|%s)" % ("|".join(TEST_FOLDERS), TESTS_LABEL))


def _test_of(context: str, fixture_users: dict[str, set[str]]) -> set[str]:
    """Test node ids a coverage context stands for ("static|dynamic": the dynamic part wins;
    `fixture:<name>`: every test using the fixture; a TESTS_LABEL context: the tests it lists,
    cpkit.harness.attribution.measured_as)."""
    parts = [part for part in _JOIN.split(context) if part]
    if not parts:
        return set()
    label = parts[-1]
    if label.startswith("fixture:"):
        return fixture_users.get(label.removeprefix("fixture:"), set())
    if label.startswith(TESTS_LABEL):
        return set(label.removeprefix(TESTS_LABEL).split("\n"))
    return {label}


def build_map(data, root: Path, fixture_users: dict[str, set[str]], commit: str,
              levels: dict[str, dict[str, int]], recorded: dict, state: dict | None = None) -> dict:
    """The map's JSON (format MAP_VERSION) from combined CoverageData `data`: per function the
    test node ids that ran a line of its body (indices into `nodes`, cpkit.validation.coverage_map.encode_indices);
    `fixture_users`: fixture name -> node ids using it; `blobs`, `modules` and `hashes` describe the code it
    was measured on (`state`, default: cpkit.validation.coverage_map.code_state now), for `--changed` to see
    what changed since."""
    root = Path(root).resolve()
    functions: dict[str, set[str]] = {}
    for measured in data.measured_files():
        try:
            path = Path(measured).resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        if not path.startswith("src/cpkit/") or not (root / path).is_file():
            continue
        spans = function_spans((root / path).read_text())
        for line, contexts in data.contexts_by_lineno(measured).items():
            inner = [s for s in spans if s[0] <= line <= s[1]]
            if not inner:
                continue
            name = max(inner, key=lambda s: s[0])[2]
            tests = set().union(*(_test_of(c, fixture_users) for c in contexts))
            if tests:
                functions.setdefault(f"{path}::{name}", set()).update(tests)
    nodes = sorted({t for ts in functions.values() for t in ts})
    index = {t: i for i, t in enumerate(nodes)}
    return {"version": MAP_VERSION, "commit": commit, "recorded": recorded, "nodes": nodes, "levels": levels,
            **(state or code_state(root)),
            "functions": {k: encode_indices(index[t] for t in v) for k, v in sorted(functions.items())}}


class MapRecording:
    """One pytest run measured for the map, in the run's own process and every process it starts:
    pass `env` to `run_pytest` (cpkit.validation.pytest_runner) and put
    `pytest_args` on its command line; `write(run, seconds)` then builds the map from what the run
    recorded and writes MAP_PATH. Use it through `map_recording`, which owns its scratch folder."""

    def __init__(self, root: Path, tmp: Path):
        self.root, self.tmp = root, tmp
        self.rcfile = coverage_rcfile(tmp, root / "src" / "cpkit")
        self.uses = tmp / "fixtures.jsonl"
        # One process (no xdist workers, whose tests this process could not switch contexts for).
        self.pytest_args = ["-n", "0", "-p", "no:randomly", "-p", "cpkit.validation.coverage_record"]
        self.env = {**measured_env(self.rcfile), _FIXTURE_USES_ENV: str(self.uses), CONTEXT_ENV: "", RECORDING_ENV: "1"}
        self.commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                     text=True).stdout.strip()
        self.state = code_state(root)  # the code measured: taken before an edit during the run can change it

    def write(self, run, seconds: float, paths: list[str], out=sys.stderr) -> dict:
        """Build the map from the run (`PytestRun`) and write MAP_PATH; returns the map. A failing
        test still counts for the map; the outcome counts are in `recorded`."""
        import coverage

        combined = coverage.Coverage(config_file=str(self.rcfile))
        combined.combine(keep=False)
        fixture_users: dict[str, set[str]] = {}
        if self.uses.exists():
            for line in self.uses.read_text().splitlines():
                nodeid, names = json.loads(line)
                for name in names:
                    fixture_users.setdefault(name, set()).add(nodeid)
        outcomes: dict[str, int] = {}
        for rec in run.records:
            outcomes[rec["outcome"]] = outcomes.get(rec["outcome"], 0) + 1
        levels: dict[str, dict[str, int]] = {}
        for nodeid, level in run.levels.items():
            per = levels.setdefault(file_of(nodeid), {})
            per[level] = per.get(level, 0) + 1
        recorded = {"seconds": round(seconds, 1), "pytest_exit": run.exit_code, "outcomes": outcomes,
                    "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "coverage": coverage.__version__, "paths": paths}
        result = build_map(combined.get_data(), self.root, fixture_users, self.commit, levels, recorded, self.state)
        target = self.root / MAP_PATH
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, separators=(",", ":"), sort_keys=True) + "\n")
        files = {file_of(n) for n in result["nodes"]}
        print(f"coverage map: {len(result['functions'])} functions, {len(result['nodes'])} tests in {len(files)} "
              f"files, {target.stat().st_size // 1024} KiB, from a run of {seconds:.0f} s -> {MAP_PATH}", file=out)
        return result


@contextlib.contextmanager
def map_recording(root: Path) -> Iterator[MapRecording]:
    """A `MapRecording` for one pytest run at `root`, its scratch folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="cpkit-covmap-") as tmp:
        yield MapRecording(Path(root).resolve(), Path(tmp))
