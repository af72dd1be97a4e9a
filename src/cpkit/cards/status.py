"""`cpkit cards status`: per card, the follow-ups and the tests that cover them; with `run=True`
the covering tests that fit this machine run in one pytest subprocess (cpkit.validation.pytest_runner)."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import textwrap
from pathlib import Path

from cpkit.cards.evidence import evidence_runs, unrecorded_evidence
from cpkit.cards.freshness import FRESH, STALE, UNKNOWN, ChangeIndex, Freshness, head_commit
from cpkit.cards.nodes import CLUSTER_PREFIX, node_matches
from cpkit.cards.schema import GPUS_NEEDED, CardError, FollowUp, card_dirs, load_cards
from cpkit.devices import cuda_device_count
from cpkit.validation.pytest_runner import run_pytest

__all__ = ["FAILING_RESULTS", "verdict", "node_result", "claim_rows", "status_report", "card_status",
           "format_status_table", "write_report"]

#: Display width of `cpkit cards status`.
WIDTH = 100
_RANK = {"passed": 0, "skipped": 1, "not collected": 2, "failed": 3, "error": 4}
#: Results that make `cpkit cards status --run` exit non-zero.
FAILING_RESULTS = ("failed", "error", "not collected")


def _node_outcomes(node: str, outcomes: dict[str, str]) -> list[str]:
    return [o for n, o in outcomes.items() if node_matches(node, n)]


def _measured(item: FollowUp, changes: ChangeIndex | None) -> tuple[dict, dict | None]:
    """Per covering entry, its last measured result (result, machine, date, commit, staleness),
    and the follow-up's own staleness (over all its tests that have a result)."""
    last = item.last_result
    measured: dict[str, dict] = {}
    for node in item.covered_by:
        result = last.test_outcome(node) if last else "not run"
        entry = {"result": result, "machine": None, "date": None, "commit": None, "freshness": None}
        if last and result != "not run":
            entry.update(machine=last.machine, date=last.date.isoformat(), commit=last.commit)
            if changes is not None:
                entry["freshness"] = changes.freshness(last.commit, [node]).to_dict()
        measured[node] = entry
    if last is None or changes is None:
        return measured, None
    if not item.covered_by:
        return measured, Freshness(UNKNOWN, "no covering tests tie this result to code").to_dict()
    ran = [n for n, m in measured.items() if m["result"] != "not run"] or list(item.covered_by)
    return measured, changes.freshness(last.commit, ran).to_dict()


def verdict(row: dict) -> str:
    """What a row's tests last showed, never the card's claim: this run's result, else the last
    recorded outcome with ", stale" or ", staleness unknown" where it applies, else "not run"."""
    if row.get("result") and not str(row["result"]).startswith("needs "):
        return row["result"]
    last, fresh = row.get("last_result"), row.get("freshness")
    if not last:
        return f"not run ({row['result']})" if row.get("result") else "not run"
    state = (fresh or {}).get("state", UNKNOWN)
    return last["outcome"] + {FRESH: "", STALE: ", stale"}.get(state, ", staleness unknown")


def claim_rows(root: Path, cards, changes: ChangeIndex | None) -> list[dict]:
    """One row per measured claim of `cards`: the claim as written, whether its evidence folder
    exists, and its freshness (stale when the code its command ran, or its `about` entries, changed since its
    commit; see ChangeIndex.claim_freshness)."""
    rows = []
    for card in cards:
        for claim in card.claims:
            fresh = (changes.claim_freshness(claim.commit, claim.about, claim.command, claim.evidence).to_dict()
                     if changes is not None else None)
            rows.append({"feature": card.feature, **claim.to_dict(),
                         "evidence_exists": (Path(root) / claim.evidence).exists(), "freshness": fresh})
    return rows


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

    Each row keeps the card's claim (`status`: covered or open) apart from what was measured:
    `last_result` (the recorded run: outcome, date, machine, commit), `freshness` (stale when a
    file under its tests changed since that commit, see cpkit.cards.freshness; unknown without
    git or the commit), `measured` (per covering entry: its recorded result and staleness) and
    `verdict` (cpkit.cards.status.verdict) and `unrecorded_evidence` (evidence folders that cover
    it and are newer than its last_result: record them with `cpkit cards record --evidence`).
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
    changes = ChangeIndex(root)
    runs = evidence_runs(root)
    rows: list[dict] = []
    for card in cards:
        for item in card.follow_up_validation:
            if ids is not None and item.id not in ids:
                continue
            fits = gpu_count is not None and gpu_count >= GPUS_NEEDED.get(item.needs, 0)
            measured, freshness = _measured(item, changes)
            rows.append({
                "feature": card.feature,
                "validation_status": card.validation_status,
                "id": item.id,
                "status": item.status,
                "needs": item.needs,
                "text": item.text,
                "covered_by": list(item.covered_by),
                "result": None,
                "last_result": item.last_result.to_dict() if item.last_result else None,
                "freshness": freshness,
                "measured": measured,
                # Only results this machine cannot give itself come from evidence folders.
                "unrecorded_evidence": (unrecorded_evidence(item.covered_by, item.last_result, runs,
                                                            GPUS_NEEDED[item.needs])
                                        if item.needs in GPUS_NEEDED else []),
                "results": {},
                "_run": run and fits and bool(item.covered_by),
                "_why": None if fits else f"needs {item.needs}",
            })
    report: dict = {
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "feature": feature,
        "run": run,
        "commit": head_commit(root),
        "cuda_device_count": gpu_count,
        "python": platform.python_version(),
        "host": platform.node(),
        "pytest": None,
        "rows": rows,
        # Measured claims (value, command, evidence, commit, machine, date) and their staleness;
        # with `ids`, only follow-ups are asked for.
        "claims": claim_rows(root, cards, changes) if ids is None else [],
    }
    # A cluster check (cluster:<name>) runs under torchrun, not pytest: recorded from its log only.
    nodes = list(dict.fromkeys(n for r in rows if r["_run"] for n in r["covered_by"]
                               if not n.startswith(CLUSTER_PREFIX)))
    outcomes: dict[str, str] = {}
    if nodes:
        # pytest's own output goes to stderr, so that stdout stays clean for --json.
        pytest_run = run_pytest(root, nodes, output="stderr")
        outcomes = pytest_run.outcomes()
        report["pytest"] = {"command": pytest_run.command, "exit_code": pytest_run.exit_code}
    for row in rows:
        run_it, why = row.pop("_run"), row.pop("_why")
        if run:
            if not row["covered_by"]:
                row["result"] = "no tests"
            elif not run_it:
                row["result"] = why
            else:
                for node in row["covered_by"]:
                    if node.startswith(CLUSTER_PREFIX):
                        row["results"][node] = "skipped"  # torchrun -m cpkit.cluster, not pytest
                        continue
                    found = _node_outcomes(node, outcomes)
                    # Worst outcome wins: one skipped parameter makes the node "skipped".
                    row["results"][node] = max(found, key=_RANK.__getitem__) if found else "not collected"
                row["result"] = max(row["results"].values(), key=_RANK.__getitem__)
        row["verdict"] = verdict(row)
    return report


def card_status(root: str | Path, feature: str | None = None, run: bool = False) -> list[dict]:
    """Rows of status_report(): one dict per follow-up (feature, id, status, needs, covered_by,
    result, results per node, ...)."""
    return status_report(root, feature, run)["rows"]


def format_status_table(rows: list[dict], width: int = WIDTH, claims: list[dict] | None = None) -> str:
    """Human-readable status within `width` columns: per card a heading; per follow-up its id,
    the card's claim and needs, then what was measured (this run's result, or the last recorded
    one: outcome, machine, commit, date, and "STALE" naming the changed files under its tests,
    or why the staleness is unknown), then each covering test with its own result; then the
    card's measured claims (`claims`, status_report's), each fresh, STALE or of unknown staleness."""
    lines: list[str] = []
    by_card: dict[str, list[dict]] = {}
    for row in rows:
        by_card.setdefault(row["feature"], []).append(row)
    claims_by_card: dict[str, list[dict]] = {}
    for claim in claims or ():
        claims_by_card.setdefault(claim["feature"], []).append(claim)
        by_card.setdefault(claim["feature"], [])
    for feature, card_rows in by_card.items():
        if lines:
            lines.append("")
        status = f"  [{card_rows[0]['validation_status']}]" if card_rows else ""
        lines.append(f"{feature}{status}")
        for row in card_rows:
            lines.append(f"  {row['id']}  claim: {row['status']}, needs {row['needs']}")
            for text in _measured_lines(row):
                lines += _wrap(text, width, 6)
            lines += _node_lines(row, width)
        for claim in claims_by_card.get(feature, ()):
            lines += _claim_lines(claim, width)
    return "\n".join(lines) if lines else "no cards"


def _claim_lines(claim: dict, width: int) -> list[str]:
    """A measured claim: its id and freshness, its value, where and how it was measured."""
    fresh = claim.get("freshness") or {}
    state = fresh.get("state", UNKNOWN)
    mark = {FRESH: "fresh", STALE: "STALE"}.get(state, "staleness unknown")
    out = [f"  measured claim {claim['id']}: {mark}"]
    texts = [claim["value"],
             f"measured at {claim['commit']}, {claim['date']}, on {claim['machine']}; evidence: {claim['evidence']}"
             + ("" if claim.get("evidence_exists", True) else " (MISSING)"),
             f"command: {claim['command']}"]
    texts += _staleness_lines(fresh)
    for text in texts:
        out += _wrap(text, width, 6)
    return out


def _staleness_lines(fresh: dict) -> list[str]:
    """Why a result or claim is stale (the first changed files) or of unknown staleness; none
    when fresh."""
    state = fresh.get("state", UNKNOWN)
    if state == STALE:
        changed = fresh["changed"]
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        by = f" (by {fresh['basis']})" if fresh.get("basis") else ""  # a copy without history: the snapshot
        return [f"stale: {fresh['why']}{by}: {shown}"]
    if state != FRESH:
        return [f"staleness unknown: {fresh.get('why') or 'no staleness check'}"]
    return []


def _wrap(text: str, width: int, indent: int) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2),
                         break_on_hyphens=False, break_long_words=True)


def _measured_lines(row: dict) -> list[str]:
    """The row's measured result, apart from the claim: this run's, then the last recorded one."""
    out = []
    if row.get("result"):
        out.append(f"run here: {row['result']}")
    last, fresh = row.get("last_result"), row.get("freshness") or {}
    if not last:
        if not row.get("result"):
            out.append("last result: none recorded (--run runs its tests here)" if row["covered_by"]
                       else "last result: no tests")
        return out + _unrecorded_lines(row)
    state = fresh.get("state", UNKNOWN)
    mark = {FRESH: "", STALE: ": STALE"}.get(state, ": staleness unknown")
    out.append(f"last result: {last['outcome']} on {last['machine']} at {last['commit']}, {last['date']}{mark}")
    out += _staleness_lines(fresh)
    if last.get("detail"):
        out.append(f"detail: {last['detail']}")
    return out + _unrecorded_lines(row)


def _unrecorded_lines(row: dict) -> list[str]:
    return [f"evidence not recorded: {folder} (cpkit cards record --evidence {folder})"
            for folder in row.get("unrecorded_evidence") or ()]


def node_result(node: str, row: dict) -> str:
    """One covering entry's result: this run's, else its last recorded one with its commit."""
    if node in row["results"]:
        return f"{row['results'][node]} here"
    m = row.get("measured", {}).get(node) or {"result": "not run"}
    if m["result"] == "not run":
        return "not run"
    state = (m.get("freshness") or {}).get("state", UNKNOWN)
    return f"{m['result']} at {m['commit']}" + {FRESH: "", STALE: ", stale"}.get(state, ", staleness unknown")


def _node_lines(row: dict, width: int) -> list[str]:
    """Covering node ids at indent 6 with their own result; where a line would pass `width`,
    the file stands alone and its `::test` parts follow at indent 8 (wrapped if still too long)."""
    out: list[str] = []
    by_file: dict[str, list[str]] = {}
    for node in row["covered_by"]:
        by_file.setdefault(node.split("::")[0], []).append(node)
    for file, nodes in by_file.items():
        shown = row["results"] or row.get("last_result")
        labels = [f"{n}  ({node_result(n, row)})" if shown else n for n in nodes]
        if all(6 + len(label) <= width for label in labels):
            out += [" " * 6 + label for label in labels]
        else:
            out.append(" " * 6 + file)
            for label in labels:
                out += _wrap(label[len(file):], width, 8)
    return out


def write_report(report: dict, path: str | Path) -> Path:
    """Write a status report as JSON (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path

