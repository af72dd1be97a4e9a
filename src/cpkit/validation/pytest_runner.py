"""The one way cpkit's checkers run pytest: a subprocess at the repository root with
`cpkit.testing.report_plugin`, which records per test its level and outcome.

`cpkit validate`, `cpkit cards status --run` and `cpkit cards check` (collection) all go through
`run_pytest`; what each makes of the records is their own business.

`run_pytest(node_ids=...)` runs single tests by node id (what `cpkit validate --changed` selects
from a format-3 coverage map): their files are collected and this module, loaded as a plugin in
that run, deselects every other test of those files. Unlike node ids on pytest's command line,
an id the suite no longer has (a test renamed or removed since the map) is no error: it is left
out and listed in `PytestRun.missing`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping

import pytest

from cpkit.validation.stoppable import run_stoppable

__all__ = ["PytestRun", "run_pytest", "BASE_FLAGS", "NODE_IDS_ENV", "pytest_collection_modifyitems"]

#: Flags every run gets: quiet, no cache folder in the tree, and the per-test report.
BASE_FLAGS = ("-q", "-p", "no:cacheprovider", "-p", "cpkit.testing.report_plugin")
#: Names the JSON file of node ids a run keeps (with this module as a plugin).
NODE_IDS_ENV = "CPKIT_NODE_IDS"


@dataclass
class PytestRun:
    """What one pytest subprocess did.

    `records`: one dict per test (nodeid, outcome passed/failed/skipped, seconds, reason); a test
    that started and never reported (it took the process down, or was running at a kill) is a
    failure naming the exit code. `levels`: node id -> unit/dist/gpu1/gpu2/gpu4 for every collected
    test (written at collection, so `--collect-only` runs fill it too). `output`: pytest's own
    output when captured, else "". `command`: the argv, for reports. `missing`: the node ids
    asked for (`node_ids`) that the collection did not have.
    """

    exit_code: int | str
    records: list[dict] = field(default_factory=list)
    levels: dict[str, str] = field(default_factory=dict)
    output: str = ""
    command: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def outcomes(self) -> dict[str, str]:
        """node id -> outcome."""
        return {rec["nodeid"]: rec["outcome"] for rec in self.records}


def run_pytest(
    root: str | Path,
    args: list[str],
    *,
    output: Literal["inherit", "stderr", "capture"] = "inherit",
    timeout: float | None = None,
    pythonpath: str | Path | None = None,
    node_ids: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> PytestRun:
    """Run `python -m pytest <BASE_FLAGS> --rootdir root *args` at `root`.

    output: "inherit" prints pytest's output on this process's stdout, "stderr" sends it to
    stderr (keeps stdout clean for --json), "capture" returns it in `.output`. `pythonpath` goes
    first on PYTHONPATH (the mutation driver's mutated copy of src/). `node_ids`: single tests to
    run besides `args`, none of them in a file `args` names whole (see the module docstring). A
    run that cannot start or times out has the reason as its exit code (a string).
    `env` goes into its environment (a measured run: cpkit.validation.coverage_record.measured_env).
    """
    root = Path(root).resolve()
    if node_ids:
        files = list(dict.fromkeys(n.split("::", 1)[0] for n in node_ids))
        args = [*args, "-p", "cpkit.validation.pytest_runner", *files]
    cmd = [sys.executable, "-m", "pytest", *BASE_FLAGS, "--rootdir", str(root), *args]
    with tempfile.TemporaryDirectory(prefix="cpkit-pytest-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        env = dict(os.environ, **(env or {}), CPKIT_TEST_REPORT=report)
        if node_ids:
            env[NODE_IDS_ENV] = os.path.join(tmp, "node_ids.json")
            with open(env[NODE_IDS_ENV], "w") as fh:
                json.dump(sorted(set(node_ids)), fh)
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])
        run = PytestRun(exit_code=0, command=["python", "-m", "pytest", *BASE_FLAGS, *args])
        try:  # the pytest and its ranks stop with this process (SIGTERM, Ctrl-C, the timeout)
            stdout = _stderr_fd() if output == "stderr" else None
            capture = output == "capture" or (output == "stderr" and stdout is None)
            run.exit_code, run.output = run_stoppable(cmd, cwd=root, env=env, timeout=timeout, capture=capture,
                                                      stdout=stdout)
            if capture and output == "stderr":  # stderr is not a real file (captured): pass the text on
                sys.stderr.write(run.output)
                run.output = ""
        except subprocess.TimeoutExpired:
            run.exit_code = f"timed out after {timeout:g} s"
        except OSError as exc:
            run.exit_code = f"could not run ({exc})"
        run.records = _read_records(report, run.exit_code)
        if node_ids and os.path.exists(env[NODE_IDS_ENV] + ".missing"):
            with open(env[NODE_IDS_ENV] + ".missing") as fh:
                run.missing = json.load(fh)
        if os.path.exists(report + ".levels"):
            with open(report + ".levels") as fh:
                run.levels = json.load(fh)
    return run


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _read_records(path: str, exit_code: int | str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        raw = [json.loads(line) for line in fh if line.strip()]
    finished = {rec["nodeid"] for rec in raw if rec["outcome"] != "started"}
    unfinished = list(dict.fromkeys(rec["nodeid"] for rec in raw
                                    if rec["outcome"] == "started" and rec["nodeid"] not in finished))
    return [rec for rec in raw if rec["outcome"] != "started"] + [
        {"nodeid": n, "outcome": "failed", "seconds": 0.0, "unfinished": True,
         "reason": f"pytest stopped (exit code {exit_code}) while this test ran"} for n in unfinished]


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: an id they drop is not "missing"
def pytest_collection_modifyitems(config, items):
    """In a run with `node_ids` (NODE_IDS_ENV): of the files holding one of them, keep only those
    tests; tests of other files stay. Writes the ids not collected to `<that file>.missing`.
    The unit tests (tests/) run first, in their order: under `-x` a fault a unit test catches
    stops the run in seconds, not after the multi-rank tests that sort before it by name."""
    path = os.environ.get(NODE_IDS_ENV)
    if not path:
        return
    with open(path) as fh:
        wanted = set(json.load(fh))
    files = {n.split("::", 1)[0] for n in wanted}
    keep = [item for item in items if item.nodeid in wanted or item.nodeid.split("::", 1)[0] not in files]
    dropped = [item for item in items if item.nodeid not in wanted and item.nodeid.split("::", 1)[0] in files]
    with open(path + ".missing", "w") as fh:
        json.dump(sorted(wanted - {item.nodeid for item in items}), fh)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = sorted(keep, key=lambda item: not item.nodeid.startswith("tests/"))  # stable: the order within each
