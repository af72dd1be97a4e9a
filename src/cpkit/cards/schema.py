"""A feature card's schema and strict loading (`cards/<feature>/card.yaml`, documented in
cards/README.md): the closed vocabularies, the Card and FollowUp records, load_card, and the
discovery of card folders."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cpkit.validation.strict_yaml import StrictYAMLError, load_strict_yaml, yaml_error_text

__all__ = [
    "VALIDATION_STATUSES",
    "FOLLOW_UP_STATUSES",
    "NEEDS",
    "GPUS_NEEDED",
    "CARD_KEYS",
    "FOLLOW_UP_KEYS",
    "LAST_RESULT_KEYS",
    "CLAIM_KEYS",
    "OUTCOMES",
    "TEST_OUTCOMES",
    "LastResult",
    "Claim",
    "FollowUp",
    "Card",
    "CardError",
    "load_card",
    "card_dirs",
    "load_cards",
]

#: The closed vocabulary of a card's `validation_status`, strongest first.
VALIDATION_STATUSES = {
    "verified_gpu": "unit + dist + gpu2/gpu4 tests passed on real GPUs",
    "verified_cpu": "unit + dist tests pass; GPU tests not yet run",
    "partial": "some follow-up validations are still open",
    "unverified": "no test evidence yet",
}
FOLLOW_UP_STATUSES = ("open", "covered")
#: Where a covering test runs: CPU process (unit), gloo ranks (dist), one GPU, NCCL on 2 or 4 GPUs.
NEEDS = ("unit", "dist", "gpu1", "gpu2", "gpu4")
#: CUDA devices a `needs` level asks for.
GPUS_NEEDED = {"gpu1": 1, "gpu2": 2, "gpu4": 4}

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
    "claims": "list[claim]",
}
#: Top-level keys a card may leave out (a card that quotes no measurement has no claims).
_CARD_OPTIONAL = {"claims"}
FOLLOW_UP_KEYS = {"id": "str", "text": "str", "status": "str", "covered_by": "list[str]", "needs": "str",
                  "last_result": "last_result"}
# An open item may have no coverage yet. `last_result` records the last measured run of the
# covering tests (a GPU run seen from a CPU machine): what came out, where, when and at which commit.
_FOLLOW_UP_OPTIONAL = {"covered_by", "last_result"}
#: Keys of a follow-up's `last_result` mapping (`detail` and `tests` optional).
LAST_RESULT_KEYS = {"outcome": "str", "date": "date", "machine": "str", "commit": "str", "detail": "str",
                    "tests": "mapping", "evidence": "str"}
_LAST_RESULT_OPTIONAL = {"detail", "tests", "evidence"}
#: A last_result's outcome: every test that ran passed, one failed, or some were skipped or not run.
OUTCOMES = ("passed", "failed", "partial")
#: The outcome of one covering test (a covered_by entry) in `last_result.tests`.
TEST_OUTCOMES = ("passed", "failed", "skipped", "not run")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
#: Keys of one measured claim (all required): what was measured and how, where the raw output is,
#: at which commit, on what, when, and what it is about beyond the code its command ran (that is
#: derived: src/cpkit/cards/claim_scope.py), which `cpkit cards status` holds it to.
CLAIM_KEYS = {"id": "str", "value": "str", "command": "str", "evidence": "str", "commit": "str",
              "machine": "str", "date": "date", "about": "list[str]"}

_SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


# ----------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class LastResult:
    """The last measured run of a follow-up's covering tests: `outcome` (OUTCOMES) on `machine`
    at `commit` on `date`; `tests` gives each covered_by entry's own outcome (TEST_OUTCOMES)
    where the run recorded them, else the outcome stands for every covering test."""

    outcome: str
    date: _dt.date
    machine: str
    commit: str
    detail: str | None = None
    tests: tuple[tuple[str, str], ...] = ()
    #: The evidence folder the run was recorded from (`evidence/<date>-<machine>-<commit>`), if any.
    evidence: str | None = None

    def test_outcome(self, entry: str) -> str:
        """The recorded outcome of one covered_by entry ("not run" when the run left it out)."""
        return dict(self.tests).get(entry, "not run") if self.tests else self.outcome

    def to_dict(self) -> dict:
        """The mapping as written in card.yaml (JSON-able)."""
        out = {"outcome": self.outcome, "date": self.date.isoformat(), "machine": self.machine,
               "commit": self.commit}
        if self.detail:
            out["detail"] = self.detail
        if self.tests:
            out["tests"] = dict(self.tests)
        if self.evidence:
            out["evidence"] = self.evidence
        return out


@dataclass(frozen=True)
class Claim:
    """One measured statement as data: `value` (a number with its unit, or a short result) as
    `command` measured it on `machine` at `commit` on `date`, its raw output in the `evidence`
    folder, and `about`, the code it is about (test node ids or files, source paths, anchors)."""

    id: str
    value: str
    command: str
    evidence: str
    commit: str
    machine: str
    date: _dt.date
    about: tuple[str, ...]

    def to_dict(self) -> dict:
        """The mapping as written in card.yaml (JSON-able)."""
        return {"id": self.id, "value": self.value, "command": self.command, "evidence": self.evidence,
                "commit": self.commit, "machine": self.machine, "date": self.date.isoformat(),
                "about": list(self.about)}


@dataclass(frozen=True)
class FollowUp:
    """One follow-up validation of a card and the pytest node ids that cover it."""

    id: str
    text: str
    status: str
    needs: str
    covered_by: tuple[str, ...] = ()
    last_result: LastResult | None = None


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
    claims: tuple[Claim, ...] = ()


class CardError(ValueError):
    """A card (or several) failed to load; `.problems` lists every problem, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _type_problem(value: Any, kind: str) -> str | None:
    """None when `value` has the schema type `kind`, else what is wrong."""
    if kind == "str":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # e.g. a short commit of digits only: YAML reads 2729491 as a number
            return f"expected a non-empty string, got the number {value!r}: quote it ('{value}')"
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


def _key_problems(mapping: dict, spec: dict, optional: set, where: str, check) -> list[str]:
    """Unknown keys, missing required keys and `check(value, kind)` problems of `mapping` against
    `spec` (key -> kind), each as `where.key: message`."""
    problems = [f"{where}.{k}: unknown key (allowed: {', '.join(spec)})" for k in mapping if k not in spec]
    for key, kind in spec.items():
        if key not in mapping:
            if key not in optional:
                problems.append(f"{where}.{key}: missing required key")
            continue
        problem = check(mapping[key], kind)
        if problem:
            problems.append(f"{where}.{key}: {problem}")
    return problems


def _check_follow_up(item: Any, where: str, today: _dt.date | None = None) -> list[str]:
    today = today or _dt.date.today()
    if not isinstance(item, dict):
        return [f"{where}: expected a mapping with keys {', '.join(FOLLOW_UP_KEYS)}, got {type(item).__name__}"]
    problems = _key_problems(item, FOLLOW_UP_KEYS, _FOLLOW_UP_OPTIONAL, where, _type_problem)
    status, needs = item.get("status"), item.get("needs")
    if isinstance(status, str) and status not in FOLLOW_UP_STATUSES:
        problems.append(f"{where}.status: {status!r} is not one of {', '.join(FOLLOW_UP_STATUSES)}")
    if isinstance(needs, str) and needs not in NEEDS:
        problems.append(f"{where}.needs: {needs!r} is not one of {', '.join(NEEDS)}")
    if status == "covered" and not item.get("covered_by"):
        problems.append(f"{where}.covered_by: a covered item needs at least one pytest node id")
    if "last_result" in item:
        problems += _last_result_problems(item["last_result"], item.get("covered_by"), f"{where}.last_result", today)
    return problems


def _last_result_problems(value: Any, covered_by: Any, where: str, today: _dt.date) -> list[str]:
    """Problems of a follow-up's last_result mapping (LAST_RESULT_KEYS)."""
    keys = ", ".join(LAST_RESULT_KEYS)
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping with keys {keys} (detail and tests optional), got "
                f"{type(value).__name__}; e.g. outcome: passed, date: 2026-11-22, machine: 4x H200, commit: 1ec52e4"]
    def value_problem(v, kind):
        if kind == "date":
            return _date_problem(v, today)
        if kind == "mapping":
            return None if isinstance(v, dict) and v else "expected a non-empty mapping"
        return _type_problem(v, kind)

    problems = _key_problems(value, LAST_RESULT_KEYS, _LAST_RESULT_OPTIONAL, where, value_problem)
    outcome, commit = value.get("outcome"), value.get("commit")
    if isinstance(outcome, str) and outcome not in OUTCOMES:
        problems.append(f"{where}.outcome: {outcome!r} is not one of {', '.join(OUTCOMES)}")
    if isinstance(commit, str) and not _COMMIT.match(commit):
        problems.append(f"{where}.commit: {commit!r} is not a git commit (7 to 40 hex digits)")
    tests = value.get("tests")
    if isinstance(tests, dict):
        entries = set(covered_by) if isinstance(covered_by, list) else set()
        for entry, result in tests.items():
            if entry not in entries:
                problems.append(f"{where}.tests: {entry!r} is not a covered_by entry of this follow-up")
            if result not in TEST_OUTCOMES:
                problems.append(f"{where}.tests[{entry!r}]: {result!r} is not one of {', '.join(TEST_OUTCOMES)}")
    return problems


def _claim_problems(value: Any, today: _dt.date) -> list[str]:
    """Problems of a card's `claims` list (CLAIM_KEYS per item, ids unique and kebab case)."""
    if not isinstance(value, list):
        return [f"claims: expected a list of claims (keys {', '.join(CLAIM_KEYS)}), got {type(value).__name__}"]
    problems = []
    for i, item in enumerate(value):
        where = f"claims[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: expected a mapping with keys {', '.join(CLAIM_KEYS)}, got {type(item).__name__}")
            continue

        def value_problem(v, kind):
            if kind == "date":
                return _date_problem(v, today)
            if kind == "list[str]" and isinstance(v, list) and not v:
                return "expected at least one test node id, test file or source path"
            return _type_problem(v, kind)

        problems += _key_problems(item, CLAIM_KEYS, set(), where, value_problem)
        cid, commit, evidence = item.get("id"), item.get("commit"), item.get("evidence")
        if isinstance(cid, str) and not _SLUG.match(cid):
            problems.append(f"{where}.id: {cid!r} is not a kebab-case id (e.g. attention-cp4-vs-te)")
        if isinstance(commit, str) and not _COMMIT.match(commit):
            problems.append(f"{where}.commit: {commit!r} is not a git commit (7 to 40 hex digits)")
        if isinstance(evidence, str) and not evidence.startswith("evidence/"):
            problems.append(f"{where}.evidence: {evidence!r} is not under evidence/ "
                            "(an evidence/<date>-<machine>-<commit> folder, or a file in one)")
    ids = [item.get("id") for item in value if isinstance(item, dict)]
    dupes = sorted({i for i in ids if isinstance(i, str) and ids.count(i) > 1})
    if dupes:
        problems.append(f"claims: duplicate claim ids: {', '.join(dupes)}")
    return problems


def _schema_problems(data: Any, today: _dt.date) -> list[str]:
    """Every schema problem of a parsed card, each as `key.path: message`."""
    if not isinstance(data, dict):
        return [f"top level: expected a mapping of card keys, got {type(data).__name__}"]
    problems = [f"{k}: unknown key (allowed: {', '.join(CARD_KEYS)})" for k in data if k not in CARD_KEYS]
    problems += [f"{k}: missing required key" for k in CARD_KEYS if k not in data and k not in _CARD_OPTIONAL]
    for key, kind in CARD_KEYS.items():
        if key not in data:
            continue
        value = data[key]
        if kind == "date":
            problem = _date_problem(value, today)
        elif kind == "status":
            ok = isinstance(value, str) and value in VALIDATION_STATUSES
            problem = None if ok else f"{value!r} is not one of {', '.join(VALIDATION_STATUSES)}"
        elif kind == "list[claim]":
            problems += _claim_problems(value, today)
            problem = None
        elif kind == "list[follow_up]":
            if not isinstance(value, list):
                problem = f"expected a list of follow-up items, got {type(value).__name__}"
            else:
                for i, item in enumerate(value):
                    problems += _check_follow_up(item, f"{key}[{i}]", today)
                ids = [item.get("id") for item in value if isinstance(item, dict)]
                dupes = sorted({i for i in ids if isinstance(i, str) and ids.count(i) > 1})
                problem = f"duplicate follow-up ids: {', '.join(dupes)}" if dupes else None
        else:
            problem = _type_problem(value, kind)
        if problem:
            problems.append(f"{key}{'' if problem.startswith('[') else ': '}{problem}")
    items = data.get("follow_up_validation")
    if isinstance(items, list):
        problems += _status_rule_problems(data.get("validation_status"), [i for i in items if isinstance(i, dict)])
    return problems


def _status_rule_problems(status: object, items: list[dict]) -> list[str]:
    """The validation_status rule: `partial` while any follow-up is open and only then;
    `verified_gpu` only when every GPU follow-up's last_result (or a run here) passed."""
    open_ids = [str(i.get("id")) for i in items if i.get("status") == "open"]
    if status in ("verified_gpu", "verified_cpu") and open_ids:
        return [f"validation_status: {status!r} claims verification but follow-ups are open "
                f"({', '.join(open_ids)}); use 'partial' or cover them"]
    if status == "partial" and not open_ids and items:
        return ["validation_status: 'partial' but no follow-up is open; use 'verified_gpu' when the "
                "GPU follow-ups' last_result passed, else 'verified_cpu'"]
    if status == "verified_gpu":
        unproven = [str(i.get("id")) for i in items if i.get("needs") in GPUS_NEEDED
                    and not _passed(i.get("last_result"))]
        if unproven:
            return [f"validation_status: 'verified_gpu' but GPU follow-ups have no passed last_result "
                    f"({', '.join(unproven)}); record the GPU run or use 'verified_cpu'"]
    return []


def _passed(last: Any) -> bool:
    return isinstance(last, dict) and last.get("outcome") == "passed"


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
        raise CardError([f"{rel}: {yaml_error_text(exc)}"]) from None
    problems = _schema_problems(data, today or _dt.date.today())
    if problems:
        raise CardError([f"{rel}: {p}" for p in problems])
    follow_ups = tuple(
        FollowUp(
            id=i["id"], text=i["text"], status=i["status"], needs=i["needs"],
            covered_by=tuple(i.get("covered_by") or ()), last_result=_last_result(i.get("last_result")),
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
        claims=tuple(
            Claim(id=c["id"], value=c["value"], command=c["command"], evidence=c["evidence"], commit=c["commit"],
                  machine=c["machine"], date=_dt.date.fromisoformat(c["date"]), about=tuple(c["about"]))
            for c in data.get("claims") or ()
        ),
    )


def _last_result(data: dict | None) -> LastResult | None:
    if data is None:
        return None
    return LastResult(outcome=data["outcome"], date=_dt.date.fromisoformat(data["date"]), machine=data["machine"],
                      commit=data["commit"], detail=data.get("detail"), tests=tuple((data.get("tests") or {}).items()),
                      evidence=data.get("evidence"))


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return path.as_posix()


# ----------------------------------------------------------------------------- discovery


def card_dirs(root: str | Path) -> list[Path]:
    """Feature folders under `root/cards` (hidden folders and __pycache__ skipped), sorted."""
    cards = Path(root) / "cards"
    if not cards.is_dir():
        return []
    return sorted(d for d in cards.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def load_cards(
    root: Path, feature: str | None = None, today: _dt.date | None = None
) -> tuple[list[Card], list[str]]:
    """Load every card under `root/cards` (or only `feature`): (cards that loaded, problems)."""
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


