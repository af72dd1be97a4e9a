"""Upstream cards answered by cpkit's tests: `cards/<feature>/upstream.yaml` ties each
`follow_up_validation` item of an upstream project's card (Megatron-Bridge's format: a list of
sentences) to the cpkit follow-ups that answer it; `cpkit cards status --upstream PATH` reads the
upstream card from PATH and shows, per item, the covering cpkit tests and their result.

upstream.yaml (strict YAML, all keys required):

    project: Megatron-Bridge
    card: skills/<skill>/card.yaml        # the upstream card, relative to its checkout root
    src_env: CPKIT_BRIDGE_SRC             # set to <checkout>/src for the covering tests (optional key)
    follow_ups:
      - text: <the upstream item, word for word>
        answered_by: [<cpkit follow-up id>, ...]
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Optional

import yaml

from cpkit.cards.freshness import FRESH, STALE, UNKNOWN, ChangeIndex, head_commit
from cpkit.cards.schema import CardError, card_dirs, load_cards
from cpkit.cards.status import node_result, status_report, verdict
from cpkit.validation.strict_yaml import StrictYAMLError, load_strict_yaml

__all__ = [
    "UPSTREAM_FILE",
    "UpstreamItem",
    "UpstreamMap",
    "check_upstream_maps",
    "format_upstream_table",
    "load_upstream_maps",
    "read_upstream_items",
    "upstream_status",
]

UPSTREAM_FILE = "upstream.yaml"
_KEYS = {"project": str, "card": str, "src_env": str, "follow_ups": list}
_OPTIONAL = {"src_env"}
_ITEM_KEYS = {"text": str, "answered_by": list}


@dataclass(frozen=True)
class UpstreamItem:
    """One upstream follow-up and the cpkit follow-up ids that answer it."""

    text: str
    answered_by: tuple[str, ...]


@dataclass(frozen=True)
class UpstreamMap:
    """A cpkit card's upstream.yaml."""

    feature: str
    path: str
    """Repository-relative path of the upstream.yaml."""
    project: str
    card: str
    """The upstream card, relative to the upstream checkout root."""
    src_env: Optional[str]
    items: tuple[UpstreamItem, ...]


def _norm(text: str) -> str:
    return " ".join(str(text).split())


def _parse(data: Any, rel: str) -> tuple[Optional[dict], list[str]]:
    if not isinstance(data, dict):
        return None, [f"{rel}: expected a mapping with keys {', '.join(_KEYS)}"]
    problems = [f"{rel}: {k}: unknown key (allowed: {', '.join(_KEYS)})" for k in data if k not in _KEYS]
    for key, kind in _KEYS.items():
        if key not in data:
            if key not in _OPTIONAL:
                problems.append(f"{rel}: {key}: missing required key")
        elif not isinstance(data[key], kind):
            problems.append(f"{rel}: {key}: expected {kind.__name__}, got {type(data[key]).__name__}")
    for i, item in enumerate(data.get("follow_ups") or []):
        where = f"{rel}: follow_ups[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: expected a mapping with keys text, answered_by")
            continue
        problems += [f"{where}.{k}: unknown key (allowed: text, answered_by)" for k in item if k not in _ITEM_KEYS]
        for key, kind in _ITEM_KEYS.items():
            if not isinstance(item.get(key), kind) or not item.get(key):
                problems.append(f"{where}.{key}: expected a non-empty {kind.__name__}")
    return (None if problems else data), problems


def load_upstream_maps(root: str | Path) -> tuple[list[UpstreamMap], list[str]]:
    """Every cards/<feature>/upstream.yaml under `root`: (maps, problems)."""
    root = Path(root).resolve()
    maps, problems = [], []
    for folder in card_dirs(root):
        path = folder / UPSTREAM_FILE
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        try:
            data = load_strict_yaml(path.read_text(encoding="utf-8"))
        except (StrictYAMLError, yaml.YAMLError) as exc:
            problems.append(f"{rel}: {exc}")
            continue
        data, found = _parse(data, rel)
        problems += found
        if data is None:
            continue
        items = tuple(UpstreamItem(_norm(i["text"]), tuple(i["answered_by"])) for i in data["follow_ups"])
        maps.append(UpstreamMap(folder.name, rel, data["project"], data["card"], data.get("src_env"), items))
    return maps, problems


def check_upstream_maps(root: str | Path) -> list[str]:
    """Problems of the upstream.yaml files: schema, duplicate texts, and answered_by ids that
    are not follow-ups of the same card (what `cpkit cards check` reports)."""
    maps, problems = load_upstream_maps(root)
    cards = {c.feature: c for c in load_cards(root)[0]}
    for m in maps:
        card = cards.get(m.feature)
        ids = {i.id for i in card.follow_up_validation} if card else set()
        texts = [i.text for i in m.items]
        for text in sorted({t for t in texts if texts.count(t) > 1}):
            problems.append(f"{m.path}: follow_ups: {text!r} is listed twice")
        for i, item in enumerate(m.items):
            for ref in item.answered_by:
                if ref not in ids:
                    problems.append(f"{m.path}: follow_ups[{i}].answered_by: {ref!r} is not a follow-up id of "
                                    f"cards/{m.feature}/card.yaml")
    return problems


def read_upstream_items(card_path: str | Path) -> list[str]:
    """The follow_up_validation items of an upstream card: sentences (Bridge's format) or
    mappings with a `text`. Raises CardError when the file does not read as such a card."""
    path = Path(card_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise CardError([f"{path}: cannot read an upstream card: {exc}"]) from None
    items = data.get("follow_up_validation") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise CardError([f"{path}: no follow_up_validation list"])
    return [_norm(i["text"] if isinstance(i, dict) else i) for i in items]


def _checkout_root(upstream: Path) -> Path:
    """The checkout root holding the file `upstream`: the nearest folder with .git or pyproject.toml."""
    for folder in upstream.parents:
        if (folder / ".git").exists() or (folder / "pyproject.toml").is_file():
            return folder
    return upstream.parent


def _applies(m: UpstreamMap, upstream: Path) -> Optional[tuple[Path, Path]]:
    """(upstream card, checkout root) when the map's card is at `upstream`, else None.
    `upstream` is a checkout root, or a card file: one whose path ends with the map's `card`
    (the checkout is what comes before it, marked or not), or, copied elsewhere, one that
    lists an item of the map word for word (the checkout then is the nearest marked folder)."""
    if upstream.is_dir():
        card = upstream / m.card
        return (card, upstream) if card.is_file() else None
    tail = PurePosixPath(m.card).parts
    if upstream.parts[-len(tail):] == tail:
        return upstream, Path(*upstream.parts[:-len(tail)])
    try:
        items = read_upstream_items(upstream)
    except CardError:
        return None
    if {i.text for i in m.items} & set(items):
        return upstream, _checkout_root(upstream)
    return None


@contextlib.contextmanager
def _src_env(m: UpstreamMap, checkout: Path) -> Iterator[None]:
    """CPKIT_BRIDGE_SRC (the map's src_env) = <checkout>/src for the covering tests, unless set."""
    name, src = m.src_env, checkout / "src"
    if not name or os.environ.get(name) or not src.is_dir():
        yield
        return
    os.environ[name] = str(src)
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _last_results(path: Optional[Path]) -> tuple[dict[tuple[str, str], str], Optional[str]]:
    """(feature, follow-up id) -> "<result> at <time>" from an earlier --run's report file, and
    the commit that run was at (None when it did not record one)."""
    if path is None or not path.is_file():
        return {}, None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        return ({(card["feature"], f["id"]): f"{f['result']} at {report['generated_at']}"
                 for card in report["cards"] for item in card["items"] for f in item["follow_ups"] if f["result"]},
                report.get("commit"))
    except (ValueError, KeyError, TypeError):
        return {}, None


def _with_last_run(row: dict, last_run: Optional[str], commit: Optional[str], changes: ChangeIndex) -> dict:
    """The row with `last_run` (an earlier --run here); where the row has no result of its own,
    its verdict becomes that run's, marked stale or staleness unknown as its commit says."""
    row = dict(row, last_run=last_run)
    if last_run and row["verdict"].startswith("not run"):
        fresh = changes.freshness(commit, row["covered_by"]) if commit else None
        state = fresh.state if fresh else UNKNOWN
        row["last_run"] = last_run + (f" (commit {commit})" if commit else "")
        row["verdict"] = f"{last_run.split(' at ')[0]} (last run here)" + (
            {FRESH: "", STALE: ", stale"}.get(state, ", staleness unknown"))
    return row


def upstream_status(root: str | Path, upstream: str | Path, run: bool = False, *,
                    last_report: Optional[Path] = None) -> dict:
    """Per item of each upstream card found at `upstream` (a checkout root or a card file, see
    _applies): the cpkit follow-ups answering it (status_report's rows: the claim apart from the
    last measured result and its staleness), their covering tests and, with `run=True`, their results
    (the tests run as `cpkit cards status --run` runs them, with the map's src_env pointing at
    the checkout's src/). An item with no answer has answered_by [] and result "not mapped".
    Without `run`, each follow-up's `last_run` comes from `last_report` (the file an earlier
    run wrote), where it has one.
    Raises CardError when no upstream.yaml applies to `upstream` or a card does not load."""
    root = Path(root).resolve()
    upstream = Path(upstream).expanduser().resolve()
    maps, problems = load_upstream_maps(root)
    if problems:
        raise CardError(problems)
    last, last_commit = ({}, None) if run else _last_results(last_report)
    changes = ChangeIndex(root)
    cards = []
    for m in maps:
        found = _applies(m, upstream)
        if found is None:
            continue
        card_path, checkout = found
        with _src_env(m, checkout):
            answering = sorted({i for item in m.items for i in item.answered_by})
            rows = {r["id"]: r for r in status_report(root, m.feature, run, ids=answering)["rows"]}
        by_text = {i.text: i for i in m.items}
        items = []
        for text in read_upstream_items(card_path):
            answer = by_text.get(text)
            answered = [rows[i] for i in (answer.answered_by if answer else ()) if i in rows]
            items.append(dict(text=text, answered_by=[r["id"] for r in answered],
                              follow_ups=[_with_last_run(r, last.get((m.feature, r["id"])), last_commit, changes)
                                          for r in answered],
                              result=_item_result(answered) if answered else "not mapped"))
        cards.append(dict(project=m.project, card=m.card, checkout=str(checkout), feature=m.feature, items=items))
    if not cards:
        wanted = ", ".join(f"{m.card} ({m.project}, cards/{m.feature})" for m in maps) or "none"
        raise CardError([f"{upstream}: no upstream card of cpkit's upstream.yaml files found there; they name {wanted}"])
    generated = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return dict(generated_at=generated, upstream=str(upstream), run=run, commit=head_commit(root), cards=cards)


def _item_result(rows: list[dict]) -> str:
    """What the answering follow-ups' tests showed (this run's results, else their last recorded
    results with their staleness, else "not run"), then the card's claim apart: never a claim
    in place of a result."""
    shown = ", ".join(dict.fromkeys(verdict(r) for r in rows))
    return f"{shown} (claim: {', '.join(dict.fromkeys(r['status'] for r in rows))})"


def format_upstream_table(report: dict) -> str:
    """Per upstream card: each item, numbered as in the card, then the answering cpkit follow-ups
    (id, status, needs, result) and their covering tests."""
    lines: list[str] = []
    for card in report["cards"]:
        if lines:
            lines.append("")
        lines.append(f"{card['project']} {card['card']}  ->  cpkit cards/{card['feature']}/card.yaml")
        for n, item in enumerate(card["items"], 1):
            lines.append(f"  {n}. {item['text']}")
            lines.append(f"     result: {item['result']}")
            for f in item["follow_ups"]:
                lines.append(f"     {f['id']} (claim: {f['status']}, needs {f['needs']}): {f['verdict']}")
                last = f["last_result"]
                if last:
                    lines.append(f"       last result: {last['outcome']} on {last['machine']} at {last['commit']}, "
                                 f"{last['date']}")
                    fresh = f["freshness"] or {}
                    if fresh.get("state") != "fresh":
                        lines.append(f"       {fresh.get('state', 'unknown')}: {fresh.get('why', '')}")
                if f.get("last_run"):
                    lines.append(f"       last run here: {f['last_run']}")
                lines += [f"       {node}  ({node_result(node, f)})" if (f["results"] or last) else f"       {node}"
                          for node in f["covered_by"]]
    return "\n".join(lines)
