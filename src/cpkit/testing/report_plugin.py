"""A pytest plugin that writes one JSON line per test (node id, level, outcome, seconds, reason).
Outcomes: passed, failed, skipped, xfailed (an expected failure that failed as expected: it ran)
and xpassed (a non-strict xfail that passed; a strict one that passes is failed).

`cpkit validate` loads it with `-p cpkit.testing.report_plugin` and points CPKIT_TEST_REPORT at
the file to write. A "started" line precedes each test's result, so a test that crashed the
pytest process (a segfault, an abort, a kill) is the one started and never finished; the levels
file (node id -> level) is written right after collection, so it survives such a crash too.
Under pytest-xdist only the controller writes results (workers would write every line twice).
"""

from __future__ import annotations

import json
import os

LEVELS = ("gpu4", "gpu2", "gpu1", "dist")
_worker = False  # an xdist worker: its reports reach the controller, which writes them


def pytest_configure(config):
    global _worker
    _worker = hasattr(config, "workerinput")


def _level(item) -> str:
    for name in LEVELS:
        if item.get_closest_marker(name) is not None:
            return name
    return "unit"


def pytest_collection_finish(session):
    path = os.environ.get("CPKIT_TEST_REPORT")
    if not path:
        return
    levels = {item.nodeid: _level(item) for item in session.items}
    tmp = f"{path}.levels.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(levels, fh)
    os.replace(tmp, path + ".levels")  # xdist workers collect the same items: any one will do


def _write(path: str, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    path = os.environ.get("CPKIT_TEST_REPORT")
    if path and not _worker:
        _write(path, {"nodeid": nodeid, "outcome": "started", "seconds": 0.0, "reason": ""})


def pytest_runtest_logreport(report):
    path = os.environ.get("CPKIT_TEST_REPORT")
    if not path or _worker:
        return
    # One record per test: the call phase, or setup when it failed or skipped, or a failed teardown.
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
        report.when == "teardown" and report.failed
    ):
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            reason = str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""
        outcome = report.outcome
        if hasattr(report, "wasxfail"):  # pytest reports an xfail as skipped, an xpass as passed
            outcome = {"skipped": "xfailed", "passed": "xpassed"}.get(outcome, outcome)
            reason = report.wasxfail[:300]
        record = {
            "nodeid": report.nodeid,
            "outcome": outcome,
            "seconds": round(report.duration, 3),
            "reason": reason,
        }
        _write(path, record)
