"""The one way cpkit's checkers run pytest: a subprocess at the repository root with
`cpkit.testing.report_plugin`, which records per test its level and outcome.

`cpkit validate`, `cpkit cards status --run` and `cpkit cards check` (collection) all go through
`run_pytest`; what each makes of the records is their own business.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["PytestRun", "run_pytest", "BASE_FLAGS"]

#: Flags every run gets: quiet, no cache folder in the tree, and the per-test report.
BASE_FLAGS = ("-q", "-p", "no:cacheprovider", "-p", "cpkit.testing.report_plugin")


@dataclass
class PytestRun:
    """What one pytest subprocess did.

    `records`: one dict per test (nodeid, outcome passed/failed/skipped, seconds, reason); a test
    that started and never reported (it took the process down, or was running at a kill) is a
    failure naming the exit code. `levels`: node id -> unit/dist/gpu1/gpu2/gpu4 for every collected
    test (written at collection, so `--collect-only` runs fill it too). `output`: pytest's own
    output when captured, else "". `command`: the argv, for reports.
    """

    exit_code: int | str
    records: list[dict] = field(default_factory=list)
    levels: dict[str, str] = field(default_factory=dict)
    output: str = ""
    command: list[str] = field(default_factory=list)

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
) -> PytestRun:
    """Run `python -m pytest <BASE_FLAGS> --rootdir root *args` at `root`.

    output: "inherit" prints pytest's output on this process's stdout, "stderr" sends it to
    stderr (keeps stdout clean for --json), "capture" returns it in `.output`. `pythonpath` goes
    first on PYTHONPATH (the mutation driver's mutated copy of src/). A run that cannot start or
    times out has the reason as its exit code (a string).
    """
    root = Path(root).resolve()
    cmd = [sys.executable, "-m", "pytest", *BASE_FLAGS, "--rootdir", str(root), *args]
    with tempfile.TemporaryDirectory(prefix="cpkit-pytest-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        env = dict(os.environ, CPKIT_TEST_REPORT=report)
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])
        run = PytestRun(exit_code=0, command=["python", "-m", "pytest", *BASE_FLAGS, *args])
        try:
            stdout = _stderr_fd() if output == "stderr" else None
            if output == "capture" or (output == "stderr" and stdout is None):
                proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
                run.output = proc.stdout + proc.stderr
                if output == "stderr":  # stderr is not a real file (captured): pass the text on
                    sys.stderr.write(run.output)
                    run.output = ""
            else:
                proc = subprocess.run(cmd, cwd=root, env=env, timeout=timeout, stdout=stdout)
            run.exit_code = proc.returncode
        except subprocess.TimeoutExpired:
            run.exit_code = f"timed out after {timeout:g} s"
        except OSError as exc:
            run.exit_code = f"could not run ({exc})"
        run.records = _read_records(report, run.exit_code)
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
