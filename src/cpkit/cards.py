"""Feature cards (`cards/<feature>/card.yaml`): schema, strict loading, checks and status.

A card says what a CP feature means, how to use it, what is known to hold, and which follow-up
validations are covered by which pytest node ids. Everything a card claims is checked:
`check_cards` verifies the schema, that every evidence anchor resolves and that every covering
node id is collected by pytest; `card_status` shows (and with `run=True` runs) the covering tests.
The schema is documented in cards/README.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, SequenceNode

from cpkit.anchors import resolve_anchor

__all__ = [
    "VALIDATION_STATUSES",
    "FOLLOW_UP_STATUSES",
    "NEEDS",
    "CARD_KEYS",
    "FOLLOW_UP_KEYS",
    "StrictYAMLError",
    "load_strict_yaml",
    "FollowUp",
    "Card",
    "CardError",
    "load_card",
    "card_dirs",
    "check_cards",
    "Collected",
    "collect_node_ids",
    "ast_collect_node_ids",
    "node_matches",
    "card_status",
    "status_report",
    "format_status_table",
    "write_report",
    "keypath",
    "FAILING_RESULTS",
]

#: The closed vocabulary of a card's `validation_status`, strongest first.
VALIDATION_STATUSES = {
    "verified_gpu": "unit + dist + gpu2/gpu4 tests passed on real GPUs",
    "verified_cpu": "unit + dist tests pass; GPU tests not yet run",
    "partial": "some follow-up validations are still open",
    "unverified": "no test evidence yet",
}
FOLLOW_UP_STATUSES = ("open", "covered")
#: Where a covering test runs: CPU process (unit), gloo ranks (dist), NCCL on 2 or 4 GPUs.
NEEDS = ("unit", "dist", "gpu2", "gpu4")
_GPUS_NEEDED = {"gpu2": 2, "gpu4": 4}

#: Top-level card keys and the (human-readable) type each must have.
CARD_KEYS = {
    "title": "str",
    "validated_on": "date",
    "summary": "str",
    "validation_status": "status",
    "feature_meaning": "text",
    "recommended_path": "text",
    "known_constraints": "list[str]",
    "known_limitations": "list[str]",
    "evidence": "list[str]",
    "follow_up_validation": "list[follow_up]",
}
FOLLOW_UP_KEYS = {"id": "str", "text": "str", "status": "str", "covered_by": "list[str]", "needs": "str",
                  "last_result": "str"}
# An open item may have no coverage yet. `last_result` records the last run where this machine
# cannot repeat it (a GPU run seen from a CPU machine): "<outcome> <YYYY-MM-DD> on <machine>: <detail>".
_FOLLOW_UP_OPTIONAL = {"covered_by", "last_result"}
_LAST_RESULT = re.compile(r"^(passed|failed|partial) \d{4}-\d{2}-\d{2} on \S.*$")

_SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_PARAMS = re.compile(r"\[.*\]$")


# ----------------------------------------------------------------------------- strict YAML


class StrictYAMLError(ValueError):
    """A YAML document broke a strict-loading rule; `.path` is the key path to the offender."""

    def __init__(self, path: list, message: str, line: int | None = None):
        self.path = list(path)
        self.message = message
        self.line = line
        where = keypath(self.path) or "top level"
        at = f" (line {line})" if line else ""
        super().__init__(f"{where}: {message}{at}")


def keypath(path: Iterable) -> str:
    """`["a", 2, "b"]` -> `a[2].b`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects anchors, aliases and duplicate keys, and keeps dates as strings."""

    def __init__(self, stream):
        super().__init__(stream)
        self._path: list = []

    def compose_node(self, parent, index):
        event = self.peek_event()
        pushed = isinstance(parent, SequenceNode) or (isinstance(parent, MappingNode) and index is not None)
        if pushed:
            self._path.append(index if isinstance(parent, SequenceNode) else getattr(index, "value", index))
        line = event.start_mark.line + 1
        if isinstance(event, AliasEvent):
            raise StrictYAMLError(self._path, f"YAML alias *{event.anchor} is not allowed; write the value out", line)
        if getattr(event, "anchor", None) is not None:
            raise StrictYAMLError(self._path, f"YAML anchor &{event.anchor} is not allowed", line)
        node = super().compose_node(parent, index)
        if pushed:
            self._path.pop()
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: set = set()
        for key, _ in node.value:
            if key.value in seen:
                raise StrictYAMLError([*self._path, key.value], "duplicate key", key.start_mark.line + 1)
            seen.add(key.value)
        return node


# Dates stay strings so that a bad date is a schema error with a key path, not a crash.
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)


def load_strict_yaml(text: str) -> Any:
    """Parse one YAML document strictly: no anchors/aliases, no duplicate keys, dates as strings.

    Raises StrictYAMLError (a ValueError) naming the key path, or yaml.YAMLError on bad syntax.
    """
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# ----------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class FollowUp:
    """One follow-up validation of a card and the pytest node ids that cover it."""

    id: str
    text: str
    status: str
    needs: str
    covered_by: tuple[str, ...] = ()
    last_result: str | None = None


@dataclass(frozen=True)
class Card:
    """A loaded, schema-valid card. `feature` is its folder name, `path` its repo-relative path."""

    feature: str
    path: str
    title: str
    validated_on: _dt.date
    summary: str
    validation_status: str
    feature_meaning: Any
    recommended_path: Any
    known_constraints: tuple[str, ...]
    known_limitations: tuple[str, ...]
    evidence: tuple[str, ...]
    follow_up_validation: tuple[FollowUp, ...]


class CardError(ValueError):
    """A card (or several) failed to load; `.problems` lists every problem, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _type_problem(value: Any, kind: str) -> str | None:
    """None when `value` has the schema type `kind`, else what is wrong."""
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            return f"expected a non-empty string, got {value!r}"
    elif kind == "list[str]":
        if not isinstance(value, list):
            return f"expected a list of strings, got {type(value).__name__}"
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item.strip():
                return f"[{i}] expected a non-empty string, got {item!r}"
    elif kind == "text":
        # A string, a list of strings, or a mapping from a name to a string.
        if isinstance(value, str):
            return None if value.strip() else "expected non-empty text"
        if isinstance(value, list):
            return _type_problem(value, "list[str]")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str) or not isinstance(item, str) or not item.strip():
                    return f"mapping entries must be name: text, got {key!r}: {item!r}"
            return None if value else "expected non-empty text"
        return f"expected a string, a list of strings or a mapping, got {type(value).__name__}"
    return None


def _date_problem(value: Any, today: _dt.date) -> str | None:
    if not isinstance(value, str) or not _DATE.match(value):
        return f"{value!r} is not a date in YYYY-MM-DD form"
    try:
        date = _dt.date.fromisoformat(value)
    except ValueError as exc:
        return f"{value!r} is not a valid date ({exc})"
    if date > today + _dt.timedelta(days=1):  # one day of slack for time zones
        return f"{value!r} is in the future"
    return None


def _check_follow_up(item: Any, where: str) -> list[str]:
    if not isinstance(item, dict):
        return [f"{where}: expected a mapping with keys {', '.join(FOLLOW_UP_KEYS)}, got {type(item).__name__}"]
    problems = [f"{where}.{k}: unknown key (allowed: {', '.join(FOLLOW_UP_KEYS)})" for k in item if k not in FOLLOW_UP_KEYS]
    for key, kind in FOLLOW_UP_KEYS.items():
        if key not in item:
            if key not in _FOLLOW_UP_OPTIONAL:
                problems.append(f"{where}.{key}: missing required key")
            continue
        problem = _type_problem(item[key], kind)
        if problem:
            problems.append(f"{where}.{key}: {problem}")
    status, needs = item.get("status"), item.get("needs")
    if isinstance(status, str) and status not in FOLLOW_UP_STATUSES:
        problems.append(f"{where}.status: {status!r} is not one of {', '.join(FOLLOW_UP_STATUSES)}")
    if isinstance(needs, str) and needs not in NEEDS:
        problems.append(f"{where}.needs: {needs!r} is not one of {', '.join(NEEDS)}")
    if status == "covered" and not item.get("covered_by"):
        problems.append(f"{where}.covered_by: a covered item needs at least one pytest node id")
    last = item.get("last_result")
    if isinstance(last, str) and not _LAST_RESULT.match(last):
        problems.append(f"{where}.last_result: {last!r} must read '<passed|failed|partial> YYYY-MM-DD on <machine>: <detail>'")
    return problems


def _schema_problems(data: Any, today: _dt.date) -> list[str]:
    """Every schema problem of a parsed card, each as `key.path: message`."""
    if not isinstance(data, dict):
        return [f"top level: expected a mapping of card keys, got {type(data).__name__}"]
    problems = [f"{k}: unknown key (allowed: {', '.join(CARD_KEYS)})" for k in data if k not in CARD_KEYS]
    problems += [f"{k}: missing required key" for k in CARD_KEYS if k not in data]
    for key, kind in CARD_KEYS.items():
        if key not in data:
            continue
        value = data[key]
        if kind == "date":
            problem = _date_problem(value, today)
        elif kind == "status":
            ok = isinstance(value, str) and value in VALIDATION_STATUSES
            problem = None if ok else f"{value!r} is not one of {', '.join(VALIDATION_STATUSES)}"
        elif kind == "list[follow_up]":
            if not isinstance(value, list):
                problem = f"expected a list of follow-up items, got {type(value).__name__}"
            else:
                for i, item in enumerate(value):
                    problems += _check_follow_up(item, f"{key}[{i}]")
                ids = [item.get("id") for item in value if isinstance(item, dict)]
                dupes = sorted({i for i in ids if isinstance(i, str) and ids.count(i) > 1})
                problem = f"duplicate follow-up ids: {', '.join(dupes)}" if dupes else None
        else:
            problem = _type_problem(value, kind)
        if problem:
            problems.append(f"{key}{'' if problem.startswith('[') else ': '}{problem}")
    status = data.get("validation_status")
    items = data.get("follow_up_validation")
    if status in ("verified_gpu", "verified_cpu") and isinstance(items, list):
        open_ids = [str(i.get("id")) for i in items if isinstance(i, dict) and i.get("status") == "open"]
        if open_ids:
            problems.append(
                f"validation_status: {status!r} claims verification but follow-ups are open "
                f"({', '.join(open_ids)}); use 'partial' or cover them"
            )
    return problems


def load_card(path: str | Path, root: str | Path | None = None, *, today: _dt.date | None = None) -> Card:
    """Load and schema-check one card.yaml; errors are prefixed by its path relative to `root`.

    Raises CardError listing every problem (`cards/x/card.yaml: key.path: message`).
    """
    path = Path(path)
    root = Path(root) if root is not None else path.parent.parent.parent
    rel = _rel(path, root)
    try:
        data = load_strict_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CardError([f"{rel}: cannot read: {exc.strerror}"]) from None
    except StrictYAMLError as exc:
        raise CardError([f"{rel}: {exc}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        raise CardError([f"{rel}: {line}invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    problems = _schema_problems(data, today or _dt.date.today())
    if problems:
        raise CardError([f"{rel}: {p}" for p in problems])
    follow_ups = tuple(
        FollowUp(
            id=i["id"], text=i["text"], status=i["status"], needs=i["needs"],
            covered_by=tuple(i.get("covered_by") or ()), last_result=i.get("last_result"),
        )
        for i in data["follow_up_validation"]
    )
    return Card(
        feature=path.parent.name,
        path=rel,
        title=data["title"],
        validated_on=_dt.date.fromisoformat(data["validated_on"]),
        summary=data["summary"],
        validation_status=data["validation_status"],
        feature_meaning=data["feature_meaning"],
        recommended_path=data["recommended_path"],
        known_constraints=tuple(data["known_constraints"]),
        known_limitations=tuple(data["known_limitations"]),
        evidence=tuple(data["evidence"]),
        follow_up_validation=follow_ups,
    )


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return path.as_posix()


# ----------------------------------------------------------------------------- discovery + checks


def card_dirs(root: str | Path) -> list[Path]:
    """Feature folders under `root/cards` (hidden folders and __pycache__ skipped), sorted."""
    cards = Path(root) / "cards"
    if not cards.is_dir():
        return []
    return sorted(d for d in cards.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def _load_all(
    root: Path, feature: str | None = None, today: _dt.date | None = None
) -> tuple[list[Card], list[str]]:
    cards: list[Card] = []
    problems: list[str] = []
    for folder in card_dirs(root):
        if feature is not None and folder.name != feature:
            continue
        rel = _rel(folder, root)
        if not _SLUG.match(folder.name):
            problems.append(f"{rel}: folder name {folder.name!r} is not a kebab-case feature slug")
        if not (folder / "card.yaml").is_file():
            problems.append(f"{rel}: missing card.yaml")
            continue
        try:
            cards.append(load_card(folder / "card.yaml", root, today=today))
        except CardError as exc:
            problems += exc.problems
    return cards, problems


class Collected(NamedTuple):
    """What a collector found: node ids, the files read with ast instead of pytest (their
    parametrized ids are matched by base name), and a note saying why, or None."""

    ids: set[str]
    ast_files: set[str]
    note: str | None


#: A collector maps (root, repo-relative test files) to Collected.
Collector = Callable[[Path, list[str]], Collected]


def node_matches(entry: str, node_id: str) -> bool:
    """True when the covered_by `entry` names `node_id`: the same id, or a file, class or
    parametrized base name that contains it."""
    return node_id == entry or node_id.startswith(entry + "::") or node_id.startswith(entry + "[")


def collect_node_ids(root: str | Path, files: list[str]) -> Collected:
    """Node ids pytest collects from `files` (repo-relative), in ONE `pytest --collect-only`
    subprocess run at `root`. Files pytest cannot collect are read with `ast` instead
    (see ast_collect_node_ids); the returned note then says so, else it is None."""
    root = Path(root).resolve()
    if not files:
        return Collected(set(), set(), None)
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "--rootdir", str(root), *files]
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
        output, rc = proc.stdout, proc.returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        output, rc = "", f"could not run ({exc})"
    wanted = set(files)
    ids = {line.strip() for line in output.splitlines() if line.strip().split("::")[0] in wanted and "::" in line}
    if rc in (0, 5):
        return Collected(ids, set(), None)
    missing = sorted(wanted - {i.split("::")[0] for i in ids})
    fallback = ast_collect_node_ids(root, missing)
    lines = (proc.stdout + proc.stderr).splitlines() if isinstance(rc, int) else [rc]
    reason = next((ln[1:].strip() for ln in lines if ln.startswith("E ")), lines[-1] if lines else "")
    note = (
        f"pytest --collect-only exited {rc} ({reason}); checked {', '.join(missing) or 'no files'} "
        "with ast instead, matching parametrized ids by base name"
    )
    return Collected(ids | fallback.ids, set(missing), note)


def ast_collect_node_ids(root: str | Path, files: list[str]) -> Collected:
    """Approximate collection without running pytest: a node id for every `test*` function and
    `Test*` class (with its `test*` methods) defined at the top level of each file."""
    import ast

    ids: set[str] = set()
    for file in files:
        try:
            tree = ast.parse((Path(root) / file).read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                ids.add(f"{file}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                        ids.add(f"{file}::{node.name}::{sub.name}")
    return Collected(ids, set(files), None)


def check_cards(
    root: str | Path,
    *,
    collect: Collector = collect_node_ids,
    notes: list[str] | None = None,
    today: _dt.date | None = None,
) -> list[str]:
    """Check every card under `root/cards`; returns problems, one line each, empty when all hold.

    Checks the schema (see cards/README.md), that each card has a matching skill folder, that every
    `evidence` anchor resolves, and that every `covered_by` node id is collected by pytest
    (one collection subprocess over the named files; `collect` replaces it, e.g. in tests).
    Informational notes (such as an ast fallback) are appended to `notes` when given.
    """
    root = Path(root).resolve()
    if not (root / "cards").is_dir():
        return [f"{root / 'cards'}: no cards folder"]
    cards, problems = _load_all(root, today=today)
    for folder in card_dirs(root):
        # The four parts of a feature live side by side: a card without a skill is half a feature.
        if (folder / "card.yaml").is_file() and not (root / "skills" / folder.name / "SKILL.md").is_file():
            problems.append(f"cards/{folder.name}/card.yaml: no matching skill skills/{folder.name}/SKILL.md")
    pending: list[tuple[str, str]] = []  # (where, node id) waiting for collection
    for card in cards:
        for i, anchor in enumerate(card.evidence):
            reason = resolve_anchor(root, anchor)
            if reason:
                problems.append(f"{card.path}: evidence[{i}]: {anchor!r} {reason}")
        for i, item in enumerate(card.follow_up_validation):
            for j, node in enumerate(item.covered_by):
                where = f"{card.path}: follow_up_validation[{i}].covered_by[{j}]"
                reason = resolve_anchor(root, node)
                if reason:
                    problems.append(f"{where}: {node!r} {reason}")
                else:
                    pending.append((where, node))
    files = sorted({node.split("::")[0] for _, node in pending})
    collected = collect(root, files)
    if collected.note and notes is not None:
        notes.append(collected.note)
    for where, node in pending:
        if node.split("::")[0] in collected.ast_files:
            node = _PARAMS.sub("", node)  # ast cannot see parameters
        if not any(node_matches(node, c) for c in collected.ids):
            problems.append(f"{where}: {node!r} is not collected by pytest")
    return problems


# ----------------------------------------------------------------------------- status


_RANK = {"passed": 0, "skipped": 1, "not collected": 2, "failed": 3, "error": 4}
#: Results that make `cpkit cards status --run` exit non-zero.
FAILING_RESULTS = ("failed", "error", "not collected")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


def _junit_address(node: str) -> str:
    """The `classname.name` that pytest's junitxml writes for node id (or prefix) `node`."""
    path, bracket, params = node.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    return ".".join(names) + bracket + params


def _run_pytest(root: Path, nodes: list[str]) -> tuple[dict[str, str], list[str], int]:
    """Run `nodes` in one pytest subprocess; (junit address -> outcome, command, exit code)."""
    with tempfile.TemporaryDirectory(prefix="cpkit-cards-") as tmp:
        xml = Path(tmp) / "junit.xml"
        flags = ["-q", "-p", "no:cacheprovider", "--rootdir", str(root)]
        cmd = [sys.executable, "-m", "pytest", *flags, f"--junitxml={xml}", *nodes]
        # pytest's own output goes to stderr, so that stdout stays clean for --json.
        try:
            proc = subprocess.run(cmd, cwd=root, text=True, stdout=sys.stderr.fileno())
        except (AttributeError, OSError, ValueError):  # stderr is not a real file (e.g. captured)
            proc = subprocess.run(cmd, cwd=root, text=True, capture_output=True)
            sys.stderr.write(proc.stdout + proc.stderr)
        outcomes: dict[str, str] = {}
        if xml.is_file():
            for case in ET.parse(xml).iter("testcase"):
                address = f"{case.get('classname')}.{case.get('name')}" if case.get("classname") else case.get("name")
                tags = {child.tag for child in case}
                outcome = ("error" if "error" in tags else "failed" if "failure" in tags
                           else "skipped" if "skipped" in tags else "passed")
                # A test can appear twice (call + teardown error); keep the worst outcome.
                previous = outcomes.get(address, outcome)
                outcomes[address] = max(previous, outcome, key=_RANK.__getitem__)
    return outcomes, ["python", "-m", "pytest", *flags, "--junitxml=<tmp>", *nodes], proc.returncode


def _node_outcomes(node: str, outcomes: dict[str, str]) -> list[str]:
    address = _junit_address(node)
    return [o for a, o in outcomes.items() if a == address or a.startswith(address + ".") or a.startswith(address + "[")]


def status_report(
    root: str | Path,
    feature: str | None = None,
    run: bool = False,
    *,
    gpu_count: int | None = None,
) -> dict:
    """Follow-up status of every card (or one `feature`), as a JSON-able report.

    With `run=True`, the covering tests that fit this machine (unit and dist always; gpu2/gpu4 when
    at least 2/4 CUDA devices are visible) run in ONE pytest subprocess with --junitxml; each row's
    `result` is then passed, failed, error, skipped, "not collected", "no tests" or "needs gpuN".
    Raises KeyError for an unknown feature and CardError when a card does not load.
    """
    root = Path(root).resolve()
    known = [d.name for d in card_dirs(root)]
    if feature is not None and feature not in known:
        raise KeyError(f"no card for feature {feature!r}; known: {', '.join(known) or 'none'}")
    cards, problems = _load_all(root, feature)
    if problems:
        raise CardError(problems)
    if run and gpu_count is None:
        needs_gpu = any(i.needs in _GPUS_NEEDED and i.covered_by for c in cards for i in c.follow_up_validation)
        gpu_count = _gpu_count() if needs_gpu else 0
    rows: list[dict] = []
    for card in cards:
        for item in card.follow_up_validation:
            fits = gpu_count is not None and gpu_count >= _GPUS_NEEDED.get(item.needs, 0)
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
        outcomes, cmd, rc = _run_pytest(root, nodes)
        report["pytest"] = {"command": cmd, "exit_code": rc}
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


def format_status_table(rows: list[dict]) -> str:
    """Human-readable status: per card, one line per follow-up and one per extra covering node."""
    lines: list[str] = []
    by_card: dict[str, list[dict]] = {}
    for row in rows:
        by_card.setdefault(row["feature"], []).append(row)
    for feature, card_rows in by_card.items():
        if lines:
            lines.append("")
        lines.append(f"{feature}  [{card_rows[0]['validation_status']}]")
        table = [("id", "status", "needs", "result", "covered_by")]
        for row in card_rows:
            nodes = row["covered_by"] or ["-"]
            result = row["result"] or (f"last: {row['last_result']}" if row["last_result"] else "-")
            table.append((row["id"], row["status"], row["needs"], result, _with_result(nodes[0], row)))
            table += [("", "", "", "", _with_result(n, row)) for n in nodes[1:]]
        widths = [max(len(r[c]) for r in table) for c in range(4)]
        for r in table:
            lines.append("  " + "  ".join(r[c].ljust(widths[c]) for c in range(4)) + "  " + r[4])
    return "\n".join(lines) if lines else "no cards"


def _with_result(node: str, row: dict) -> str:
    result = row["results"].get(node)
    return f"{node} ({result})" if result and len(row["results"]) > 1 else node


def write_report(report: dict, path: str | Path) -> Path:
    """Write a status report as JSON (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path

