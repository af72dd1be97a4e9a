"""Evidence folders (`evidence/<date>-<machine>-<commit>/`) as runs a card can record: the junit
files in a folder (`*junit*.xml`, `*.xml.gz`) and its `cpkit.cluster` log (`cluster.log`), read
into covering-entry outcomes, and the folders newer than a follow-up's recorded result that
cover it (`cpkit cards status` lists them as "evidence not recorded").

A follow-up covers a cluster check with the entry `cluster:<check>` (a name in
src/cpkit/cluster/checks.py::CHECKS); its outcome is the check's `pass`/`FAIL` line."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field
from pathlib import Path

from cpkit.cards.nodes import CLUSTER_PREFIX, node_matches
from cpkit.validation.junit import read_junit, worst

__all__ = ["EvidenceRun", "parse_folder_name", "read_cluster_log", "read_evidence", "evidence_runs",
           "unrecorded_evidence"]

_FOLDER = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)-([0-9a-f]{7,40})$")
_CLUSTER_LINE = re.compile(r"^([a-z][a-z0-9-]*): (pass|FAIL) \(")


@dataclass(frozen=True)
class EvidenceRun:
    """One evidence folder: where (`folder`, repository-relative), when, on what, at which
    commit, and the outcomes (node id or cluster entry -> junit outcome) its files hold."""

    folder: str
    date: _dt.date
    machine: str
    commit: str
    outcomes: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    #: The latest junit timestamp in the folder (ISO), which orders runs of one day; or None.
    stamp: str | None = None

    @property
    def gpus(self) -> int | None:
        """GPUs of the machine as the folder names it (`4xH100` -> 4, `cpu` -> 0), or None."""
        if self.machine.lower() == "cpu":
            return 0
        match = re.match(r"(\d+)x", self.machine)
        return int(match[1]) if match else None

    def fits(self, gpus_needed: int) -> bool:
        """True unless the folder's machine had fewer GPUs than a follow-up needs."""
        return self.gpus is None or self.gpus >= gpus_needed

    def ran(self, entries: tuple[str, ...] | list[str]) -> set[str]:
        """The covered_by `entries` this run ran (skipped is not ran: a 2-GPU test on a 1-GPU
        machine says nothing about it)."""
        return {e for e in entries for n, o in self.outcomes.items() if o != "skipped" and node_matches(e, n)}


def parse_folder_name(name: str) -> tuple[_dt.date, str, str]:
    """(date, machine, commit) of an evidence folder name such as `2026-11-26-4xH100-a107ba0`.
    Raises ValueError naming the expected form."""
    match = _FOLDER.match(name)
    if not match:
        raise ValueError(f"evidence folder {name!r} is not named <YYYY-MM-DD>-<machine>-<commit>, "
                         "e.g. 2026-11-26-4xH100-a107ba0")
    return _dt.date.fromisoformat(match[1]), match[2], match[3]


def read_cluster_log(path: str | Path) -> dict[str, str]:
    """`cluster:<check>` -> passed/failed from a `python -m cpkit.cluster` log (its per-check
    `<check>: pass (S s)` / `<check>: FAIL (S s)` lines; a check listed twice keeps its worst)."""
    out: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        match = _CLUSTER_LINE.match(line)
        if match:
            node, outcome = CLUSTER_PREFIX + match[1], "passed" if match[2] == "pass" else "failed"
            out[node] = worst([out[node], outcome]) if node in out else outcome
    return out


_HEX = re.compile(r"(?<![0-9a-z])[0-9a-f]{7,40}(?![0-9a-z])")


def _junit_files(folder: Path, commit: str) -> list[Path]:
    """The folder's junit files, less those whose name names another commit (a run kept for
    comparison, e.g. `junit-cf8feac-timing-path.xml.gz` beside a107ba0's own)."""
    return sorted(p for p in folder.iterdir() if p.is_file()
                  and (("junit" in p.name and p.name.endswith((".xml", ".xml.gz"))) or p.name.endswith(".xml.gz"))
                  and all(commit.startswith(h) or h.startswith(commit) for h in _HEX.findall(p.name)))


def read_evidence(folder: str | Path, root: str | Path) -> EvidenceRun:
    """The run an evidence folder holds. Raises ValueError for a folder that is missing, badly
    named, or holds neither a junit file nor a cluster log."""
    root = Path(root).resolve()
    folder = Path(folder)
    path = folder if folder.is_absolute() else (root / folder)
    if not path.is_dir():
        raise ValueError(f"{folder}: no such evidence folder")
    date, machine, commit = parse_folder_name(path.name)
    outcomes: dict[str, str] = {}
    files, stamps = [], []
    for file in _junit_files(path, commit):
        found, stamp = read_junit(file, root)
        for node, outcome in found.items():
            outcomes[node] = worst([outcomes[node], outcome]) if node in outcomes else outcome
        files.append(file.name)
        stamps += [stamp] if stamp else []
    for log in sorted(path.glob("cluster*.log")):
        outcomes.update(read_cluster_log(log))
        files.append(log.name)
    if not files:
        raise ValueError(f"{folder}: holds no junit file (*junit*.xml, *.xml.gz) and no cluster.log")
    try:
        rel = path.resolve().relative_to(root).as_posix()
    except ValueError:
        rel = str(path)
    return EvidenceRun(rel, date, machine, commit, outcomes, tuple(files), max(stamps, default=None))


def evidence_runs(root: str | Path) -> list[EvidenceRun]:
    """Every readable run under `root/evidence`, oldest first (folders that are not runs are
    left out: an index, a differently named folder)."""
    root = Path(root).resolve()
    runs = []
    for folder in sorted((root / "evidence").iterdir()) if (root / "evidence").is_dir() else []:
        try:
            runs.append(read_evidence(folder, root))
        except ValueError:
            continue
    return sorted(runs, key=lambda r: (r.date, r.folder))


def unrecorded_evidence(covered_by: tuple[str, ...], last, runs: list[EvidenceRun], gpus_needed: int = 0) -> list[str]:
    """Folders among `runs` that cover a follow-up (its `covered_by`) and are newer than its
    recorded result `last` (a LastResult or None): a later date, or, on the result's own date,
    a later junit timestamp than the folder the result was recorded from, and running every
    covering entry the result ran (a 1-GPU run of a 4-GPU follow-up's unit entries would
    narrow it), on a machine with the `gpus_needed`. The recorded folder itself and older runs
    are not listed; a same-day run is not listed when the result names no
    folder (which of the day's runs it came from is unknown)."""
    stamps = {run.folder: run.stamp for run in runs}
    had = set(covered_by) if last is None or not last.tests else {e for e, o in last.tests if o != "not run"}
    out = []
    for run in runs:
        ran = run.ran(covered_by) if run.fits(gpus_needed) else set()
        if not ran or (last is not None and (run.folder == last.evidence or not had <= ran)):
            continue
        if last is None or run.date > last.date:
            out.append(run.folder)
        elif run.date == last.date and last.evidence and run.stamp and (stamps.get(last.evidence) or "") < run.stamp:
            out.append(run.folder)
    return out
