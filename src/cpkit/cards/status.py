"""`cpkit cards status`: per card, the follow-ups and the tests that cover them; with `run=True`
the covering tests that fit this machine run in one pytest subprocess (cpkit.pytest_runner)."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import textwrap
from pathlib import Path

from cpkit.cards.check import node_matches
from cpkit.cards.schema import GPUS_NEEDED, CardError, card_dirs, load_cards
from cpkit.devices import cuda_device_count
from cpkit.pytest_runner import run_pytest

__all__ = ["FAILING_RESULTS", "status_report", "card_status", "format_status_table", "write_report"]

#: Display width of `cpkit cards status`.
WIDTH = 100
_RANK = {"passed": 0, "skipped": 1, "not collected": 2, "failed": 3, "error": 4}
#: Results that make `cpkit cards status --run` exit non-zero.
FAILING_RESULTS = ("failed", "error", "not collected")


def _node_outcomes(node: str, outcomes: dict[str, str]) -> list[str]:
    return [o for n, o in outcomes.items() if node_matches(node, n)]


def status_report(
    root: str | Path,
    feature: str | None = None,
    run: bool = False,
    *,
    gpu_count: int | None = None,
    ids: list[str] | None = None,
) -> dict:
    """Follow-up status of every card (or one `feature`), as a JSON-able report; `ids` keeps
    only those follow-ups (and runs only their tests).

    With `run=True`, the covering tests that fit this machine (unit and dist always; gpu1/gpu2/gpu4
    when at least 1/2/4 CUDA devices are visible) run in ONE pytest subprocess; each row's
    `result` is then passed, failed, error, skipped, "not collected", "no tests" or "needs gpuN".
    Raises KeyError for an unknown feature and CardError when a card does not load.
    """
    root = Path(root).resolve()
    known = [d.name for d in card_dirs(root)]
    if feature is not None and feature not in known:
        raise KeyError(f"no card for feature {feature!r}; known: {', '.join(known) or 'none'}")
    cards, problems = load_cards(root, feature)
    if problems:
        raise CardError(problems)
    if run and gpu_count is None:
        needs_gpu = any(i.needs in GPUS_NEEDED and i.covered_by for c in cards for i in c.follow_up_validation)
        gpu_count = cuda_device_count() if needs_gpu else 0
    rows: list[dict] = []
    for card in cards:
        for item in card.follow_up_validation:
            if ids is not None and item.id not in ids:
                continue
            fits = gpu_count is not None and gpu_count >= GPUS_NEEDED.get(item.needs, 0)
            rows.append({
                "feature": card.feature,
                "validation_status": card.validation_status,
                "id": item.id,
                "status": item.status,
                "needs": item.needs,
                "text": item.text,
                "covered_by": list(item.covered_by),
                "result": None,
                "last_result": item.last_result,
                "results": {},
                "_run": run and fits and bool(item.covered_by),
                "_why": None if fits else f"needs {item.needs}",
            })
    report: dict = {
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "feature": feature,
        "run": run,
        "cuda_device_count": gpu_count,
        "python": platform.python_version(),
        "host": platform.node(),
        "pytest": None,
        "rows": rows,
    }
    nodes = list(dict.fromkeys(n for r in rows if r["_run"] for n in r["covered_by"]))
    outcomes: dict[str, str] = {}
    if nodes:
        # pytest's own output goes to stderr, so that stdout stays clean for --json.
        pytest_run = run_pytest(root, nodes, output="stderr")
        outcomes = pytest_run.outcomes()
        report["pytest"] = {"command": pytest_run.command, "exit_code": pytest_run.exit_code}
    for row in rows:
        run_it, why = row.pop("_run"), row.pop("_why")
        if not run:
            continue
        if not row["covered_by"]:
            row["result"] = "no tests"
        elif not run_it:
            row["result"] = why + (f"; last: {row['last_result']}" if row["last_result"] else "")
        else:
            for node in row["covered_by"]:
                found = _node_outcomes(node, outcomes)
                # Worst outcome wins: one skipped parameter makes the node "skipped".
                row["results"][node] = max(found, key=_RANK.__getitem__) if found else "not collected"
            row["result"] = max(row["results"].values(), key=_RANK.__getitem__)
    return report


def card_status(root: str | Path, feature: str | None = None, run: bool = False) -> list[dict]:
    """Rows of status_report(): one dict per follow-up (feature, id, status, needs, covered_by,
    result, results per node, ...)."""
    return status_report(root, feature, run)["rows"]


def format_status_table(rows: list[dict], width: int = WIDTH) -> str:
    """Human-readable status within `width` columns: per card a heading, per follow-up one line
    (id, status, needs, and the result when it fits), a long result on its own indented lines,
    then the covering node ids, grouped by file."""
    lines: list[str] = []
    by_card: dict[str, list[dict]] = {}
    for row in rows:
        by_card.setdefault(row["feature"], []).append(row)
    for feature, card_rows in by_card.items():
        if lines:
            lines.append("")
        lines.append(f"{feature}  [{card_rows[0]['validation_status']}]")
        widths = [max(len(str(r[k])) for r in card_rows) for k in ("id", "status", "needs")]
        for row in card_rows:
            head = "  " + "  ".join(str(row[k]).ljust(w) for k, w in zip(("id", "status", "needs"), widths))
            result = row["result"] or (f"last: {row['last_result']}" if row["last_result"] else "-")
            if len(head) + 2 + len(result) <= width:
                lines.append(f"{head}  {result}".rstrip())
            else:
                lines.append(head.rstrip())
                lines += textwrap.wrap(result, width, initial_indent=" " * 6, subsequent_indent=" " * 8,
                                       break_on_hyphens=False)
            lines += _node_lines(row, width)
    return "\n".join(lines) if lines else "no cards"


def _node_lines(row: dict, width: int) -> list[str]:
    """Covering node ids at indent 6 (with their own result when several ran); where a line would
    pass `width`, the file stands alone and its `::test` parts follow at indent 8."""
    out: list[str] = []
    by_file: dict[str, list[str]] = {}
    for node in row["covered_by"]:
        by_file.setdefault(node.split("::")[0], []).append(node)
    for file, nodes in by_file.items():
        labels = [_with_result(n, row) for n in nodes]
        if all(6 + len(label) <= width for label in labels):
            out += [" " * 6 + label for label in labels]
        else:
            out.append(" " * 6 + file)
            out += [" " * 8 + label[len(file):] for label in labels]
    return out


def _with_result(node: str, row: dict) -> str:
    result = row["results"].get(node)
    return f"{node} ({result})" if result and len(row["results"]) > 1 else node


def write_report(report: dict, path: str | Path) -> Path:
    """Write a status report as JSON (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path

