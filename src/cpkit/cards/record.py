"""`cpkit cards record --junit PATH --machine M [--commit SHA]`: write the outcomes of a pytest
junit file (`pytest --junitxml PATH`, e.g. a GPU run) into the `last_result` of every card
follow-up whose covering tests it ran, with the machine, the commit and the date of the run.
`cpkit cards record --evidence evidence/<date>-<machine>-<commit>` does the same for a committed
evidence folder (its junit files and cluster log, src/cpkit/cards/evidence.py), taking date,
machine and commit from the folder's name and never replacing a newer result.

Only the `last_result` block of each such follow-up is rewritten; the rest of the card's text
(comments, order, quoting) stays as it was. Each recorded commit gets its content snapshot
(src/cpkit/cards/snapshot.py), so that freshness needs no git history later; snapshots no card
names any more are deleted."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from cpkit.cards.evidence import read_evidence
from cpkit.cards.freshness import head_commit
from cpkit.cards.nodes import node_matches
from cpkit.cards.schema import GPUS_NEEDED, CardError, LastResult, load_card, load_cards
from cpkit.cards.snapshot import find_snapshot, prune_snapshots, write_snapshot
from cpkit.validation.junit import read_junit, worst

__all__ = ["Recorded", "last_result_from_outcomes", "write_last_result", "record_junit", "record_evidence",
           "keep_snapshots"]

# A junit outcome as a covering test's recorded outcome (schema.TEST_OUTCOMES).
_AS_TEST = {"passed": "passed", "xfailed": "passed", "skipped": "skipped", "failed": "failed", "error": "failed"}


@dataclass(frozen=True)
class Recorded:
    """One follow-up whose last_result a junit file replaced."""

    card: str
    id: str
    result: LastResult


def last_result_from_outcomes(covered_by: tuple[str, ...], outcomes: dict[str, str], *, machine: str, commit: str,
                              date: _dt.date, source: str, evidence: str | None = None) -> LastResult | None:
    """The last_result that junit `outcomes` (node id -> outcome) give a follow-up covered by
    `covered_by`, or None when none of its covering tests ran (all absent or skipped: a GPU test
    skipped on a CPU machine leaves the GPU result alone). Each entry's outcome is the worst of
    its cases ("not run" when it had none); the follow-up failed when one failed, passed when
    every entry that ran passed (strict xfails count), else it is partial (some skipped)."""
    tests: dict[str, str] = {}
    counts: dict[str, int] = {}
    for entry in covered_by:
        found = [o for node, o in outcomes.items() if node_matches(entry, node)]
        tests[entry] = _AS_TEST[worst(found)] if found else "not run"
        for o in found:
            counts[o] = counts.get(o, 0) + 1
    ran = [t for t in tests.values() if t != "not run"]
    if set(ran) <= {"skipped"}:
        return None  # nothing ran here (e.g. a GPU test skipped on a CPU machine): keep the last result
    outcome = "failed" if "failed" in ran else "passed" if set(ran) == {"passed"} else "partial"
    cases = ", ".join(f"{n} {o}" for o, n in counts.items())
    not_run = len(tests) - len(ran)
    detail = f"{cases} in {source}" + (f"; {not_run} of {len(tests)} covering entries not in it" if not_run else "")
    return LastResult(outcome, date, machine, commit, detail, tuple(tests.items()), evidence)


def _block(result: LastResult, indent: str) -> list[str]:
    text = yaml.safe_dump({"last_result": result.to_dict()}, sort_keys=False, width=10_000, allow_unicode=True)
    return [indent + line for line in text.splitlines()]


def write_last_result(card_path: str | Path, follow_up_id: str, result: LastResult) -> None:
    """Replace (or add) the last_result of follow-up `follow_up_id` in the card file, leaving every
    other line as it was; the card is re-read to check the edit. Raises CardError when the
    follow-up is not found or the edited card does not load."""
    path = Path(card_path)
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next((i for i, ln in enumerate(lines)
                  if re.match(rf"^(\s*)- id: ['\"]?{re.escape(follow_up_id)}['\"]?\s*$", ln)), None)
    if start is None:
        raise CardError([f"{path}: no follow-up with id {follow_up_id!r}"])
    dash = len(lines[start]) - len(lines[start].lstrip())
    indent = " " * (dash + 2)
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > dash):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1  # trailing blank lines belong to what follows
    item = lines[start:end]
    old = next((i for i, ln in enumerate(item) if ln.startswith(indent + "last_result:")), None)
    if old is not None:
        stop = old + 1
        while stop < len(item) and (not item[stop].strip() or len(item[stop]) - len(item[stop].lstrip()) > len(indent)):
            stop += 1
        del item[old:stop]
    item += _block(result, indent)
    text = "\n".join(lines[:start] + item + lines[end:]) + "\n"
    previous = path.read_text(encoding="utf-8")
    path.write_text(text, encoding="utf-8")
    try:
        card = load_card(path, path.parent.parent.parent)
        written = next(f.last_result for f in card.follow_up_validation if f.id == follow_up_id)
        if written != result:
            raise CardError([f"{path}: {follow_up_id}: the written last_result reads back as {written}"])
    except CardError:
        path.write_text(previous, encoding="utf-8")
        raise


def record_junit(root: str | Path, junit: list[str | Path], machine: str, commit: str | None = None,
                 date: _dt.date | None = None, feature: str | None = None) -> list[Recorded]:
    """Write the outcomes of the junit files into the last_result of every follow-up (of every
    card, or of `feature`) whose covering tests they ran; returns what was written. `commit`
    defaults to the checkout's HEAD, `date` to the run's timestamp (else today).
    Raises ValueError for an unreadable junit file or no commit, CardError for cards that do
    not load."""
    root = Path(root).resolve()
    outcomes: dict[str, str] = {}
    stamps = []
    for file in junit:
        found, stamp = read_junit(file, root)
        for node, outcome in found.items():
            outcomes[node] = worst([outcomes[node], outcome]) if node in outcomes else outcome
        stamps.append(stamp)
    commit = commit or head_commit(root)
    if not commit:
        raise ValueError(f"{root} is not a git checkout: pass --commit SHA, the commit the tests ran at")
    if date is None:
        known = sorted(s[:10] for s in stamps if s)
        date = _dt.date.fromisoformat(known[-1]) if known else _dt.date.today()
    source = ", ".join(Path(f).name for f in junit)
    return _record(root, outcomes, feature, dict(machine=machine, commit=commit, date=date, source=source))


def record_evidence(root: str | Path, folder: str | Path, machine: str | None = None,
                    feature: str | None = None) -> list[Recorded]:
    """Record an evidence folder (src/cpkit/cards/evidence.py::read_evidence) into every
    follow-up its junit files or cluster log cover, with the folder's date, commit and machine
    (`machine` replaces the folder's short form). A follow-up whose result is newer than the
    folder keeps it. Raises ValueError for a folder that is no run."""
    root = Path(root).resolve()
    run = read_evidence(folder, root)
    fields = dict(machine=machine or run.machine, commit=run.commit, date=run.date,
                  source=f"{run.folder} ({', '.join(run.files)})", evidence=run.folder)
    return _record(root, run.outcomes, feature, fields, keep_newer=True, fits=run.fits)


def _record(root: Path, outcomes: dict[str, str], feature: str | None, fields: dict,
            keep_newer: bool = False, fits=lambda gpus: True) -> list[Recorded]:
    cards, problems = load_cards(root, feature)
    if problems:
        raise CardError(problems)
    recorded = []
    for card in cards:
        for item in card.follow_up_validation:
            last = item.last_result
            if (keep_newer and last is not None and last.date > fields["date"]) or not fits(
                    GPUS_NEEDED.get(item.needs, 0)):
                continue
            result = last_result_from_outcomes(item.covered_by, outcomes, **fields)
            if (keep_newer and result is not None and last is not None
                    and not _ran(last, item.covered_by) <= _ran(result, item.covered_by)):
                continue  # an evidence folder that ran fewer of its entries would narrow the result
            if result is not None:
                write_last_result(root / card.path, item.id, result)
                recorded.append(Recorded(card.path, item.id, result))
    if recorded:
        keep_snapshots(root)
    return recorded


def _ran(result: LastResult, covered_by: tuple[str, ...]) -> set[str]:
    return {e for e, o in result.tests if o != "not run"} if result.tests else set(covered_by)


def keep_snapshots(root: Path) -> list[str]:
    """Give every commit a card's result or measured claim names a content snapshot (where git
    still has the commit) and delete the snapshots none names; returns the commits left without one."""
    cards, _ = load_cards(root)
    commits = {i.last_result.commit for c in cards for i in c.follow_up_validation if i.last_result}
    commits |= {claim.commit for c in cards for claim in c.claims}
    missing = []
    for commit in sorted(commits):
        if find_snapshot(root, commit) is None:
            try:
                write_snapshot(root, commit)
            except ValueError:
                missing.append(commit)
    prune_snapshots(root, commits)
    return missing
