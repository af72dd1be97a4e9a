"""A pytest plugin that writes one JSON line per test (node id, level, outcome, seconds, reason).

`cpkit validate` and `cpkit cards status --run` load it with `-p cpkit.testing.report_plugin`
and point CPKIT_TEST_REPORT at the file to write.
"""

from __future__ import annotations

import json
import os

LEVELS = ("gpu4", "gpu2", "dist")


def _level(item) -> str:
    for name in LEVELS:
        if item.get_closest_marker(name) is not None:
            return name
    return "unit"


def pytest_collection_modifyitems(config, items):
    config._cpkit_levels = {item.nodeid: _level(item) for item in items}


def pytest_runtest_logreport(report):
    path = os.environ.get("CPKIT_TEST_REPORT")
    if not path:
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
        record = {
            "nodeid": report.nodeid,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
            "reason": reason,
        }
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CPKIT_TEST_REPORT")
    levels = getattr(session.config, "_cpkit_levels", None)
    if path and levels is not None:
        with open(path + ".levels", "w") as fh:
            json.dump(levels, fh)
