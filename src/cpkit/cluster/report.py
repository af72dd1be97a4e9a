"""Rank 0's report of `python -m cpkit.cluster`: every rank's outcome of a check merged into one
entry (the root cause first), the JSON file and the printed table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["Report", "merge_outcomes"]


def _table(checks: list[dict]) -> str:
    rows = [("check", "result", "seconds", "detail")]
    for c in checks:
        result = "pass" if c["passed"] else ("not run" if c["detail"].startswith("not run") else "FAIL")
        first = c["detail"].strip().splitlines()[0] if c["detail"].strip() else ""
        rows.append((c["name"], result, "-" if c["seconds"] is None else f"{c['seconds']:.1f}", first[:100]))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows)


_COMM_FRAMES = ("torch/distributed/", ".wait()", "all_reduce", "all_gather", "all_to_all", "barrier",
                "broadcast", "send(", "recv(", "synchronize")


def _failure_kind(rank: int, outcome) -> str:
    """raised, hung, waiting, stopped or silent (see merge_outcomes)."""
    if outcome is None:
        return "silent"
    detail = outcome["detail"]
    if detail.startswith(f"rank {rank}: aborted:"):
        return "stopped"
    if detail.startswith(f"rank {rank}: timed out:"):
        innermost = detail.rstrip().splitlines()[-2:]  # the last frame and its source line
        return "waiting" if any(m in line for line in innermost for m in _COMM_FRAMES) else "hung"
    return "raised"


def merge_outcomes(name: str, outcomes: dict) -> dict:
    """One report entry from every rank's outcome (rank -> dict, None when it posted nothing)."""
    failed = {r: o for r, o in outcomes.items() if o is None or not o["passed"]}
    seconds = [o["seconds"] for o in outcomes.values() if o and o.get("seconds") is not None]
    if not failed:
        return {"name": name, "passed": True, "detail": outcomes[0]["detail"], "seconds": max(seconds)}
    # The root cause first: ranks that raised, then ranks that timed out outside any
    # communication call (hung), then those stuck waiting on them, then those stopped after.
    kinds = {r: _failure_kind(r, o) for r, o in failed.items()}
    order = ("raised", "hung", "waiting", "stopped", "silent")
    labels = {"raised": "raised", "hung": "hung outside communication",
              "waiting": "timed out waiting in communication", "stopped": "stopped after another rank failed",
              "silent": "no outcome (died, or hung with no watchdog report)"}
    parts = ["; ".join(f"{labels[k]}: rank(s) {sorted(r for r in failed if kinds[r] == k)}"
                       for k in order if k in kinds.values())]
    for r in sorted(failed, key=lambda r: (order.index(kinds[r]), r)):
        parts.append(f"--- rank {r} ---\n" + (failed[r]["detail"] if failed[r] else labels["silent"]))
    return {"name": name, "passed": False, "detail": "\n".join(parts), "seconds": max(seconds, default=None)}


class Report:
    """Rank 0's report: the job's shape, then one entry per check as it ends."""

    def __init__(self, path: str, header: dict, names: list[str]):
        self.path, self.header, self.names, self.checks = Path(path), header, names, []

    def add(self, entry: dict) -> None:
        """Record one check's entry (from merge_outcomes)."""
        self.checks.append(entry)

    def write(self) -> None:
        """Write the JSON (checks not reached marked not run), print the table and the failures."""
        done = {c["name"] for c in self.checks}
        failed = next((c["name"] for c in self.checks if not c["passed"]), None)
        rest = [{"name": n, "passed": False, "detail": f"not run: {failed} failed", "seconds": None}
                for n in self.names if n not in done]
        checks = self.checks + rest
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(dict(self.header, checks=checks), indent=2) + "\n")
        print(_table(checks), flush=True)
        for c in checks:
            if not c["passed"] and not c["detail"].startswith("not run"):
                print(f"\n{c['name']}:\n{c['detail']}", file=sys.stderr, flush=True)
        print(f"wrote {self.path}", flush=True)
