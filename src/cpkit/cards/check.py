"""`check_cards`: every card loads, has its skill, its evidence anchors resolve, every
covering pytest node id is collected (one `pytest --collect-only` run through
cpkit.validation.pytest_runner), every measured claim's evidence folder and code exist, and no
measured number in a card, a skill or the README goes without a claim (cpkit.cards.claims)."""

from __future__ import annotations

import ast
import datetime as _dt
import re
from pathlib import Path
from typing import Callable, NamedTuple

from cpkit.cards.bench_pointers import pointer_problems
from cpkit.cards.claims import rendered_block_problems, unbacked_numbers
from cpkit.cards.nodes import CLUSTER_PREFIX, node_matches
from cpkit.cards.schema import card_dirs, load_cards
from cpkit.cards.upstream import check_upstream_maps
from cpkit.validation.anchors import resolve_anchor
from cpkit.validation.pytest_runner import run_pytest

__all__ = ["Collected", "Collector", "collect_node_ids", "ast_collect_node_ids", "claim_problems", "check_cards"]

_PARAMS = re.compile(r"\[.*\]$")


class Collected(NamedTuple):
    """What a collector found: node ids, the files read with ast instead of pytest (their
    parametrized ids are matched by base name), and a note saying why, or None."""

    ids: set[str]
    ast_files: set[str]
    note: str | None


#: A collector maps (root, repo-relative test files) to Collected.
Collector = Callable[[Path, list[str]], Collected]


def collect_node_ids(root: str | Path, files: list[str]) -> Collected:
    """Node ids pytest collects from `files` (repo-relative), in ONE `pytest --collect-only`
    subprocess run at `root`. Files pytest cannot collect are read with `ast` instead
    (see ast_collect_node_ids); the returned note then says so, else it is None."""
    root = Path(root).resolve()
    if not files:
        return Collected(set(), set(), None)
    run = run_pytest(root, ["--collect-only", *files], output="capture", timeout=600)
    wanted = set(files)
    ids = {node for node in run.levels if node.split("::")[0] in wanted}
    if run.exit_code in (0, 5):
        return Collected(ids, set(), None)
    missing = sorted(wanted - {i.split("::")[0] for i in ids})
    fallback = ast_collect_node_ids(root, missing)
    lines = run.output.splitlines() if isinstance(run.exit_code, int) else [run.exit_code]
    reason = next((ln[1:].strip() for ln in lines if ln.startswith("E ")), lines[-1] if lines else "")
    note = (
        f"pytest --collect-only exited {run.exit_code} ({reason}); checked {', '.join(missing) or 'no files'} "
        "with ast instead, matching parametrized ids by base name"
    )
    return Collected(ids | fallback.ids, set(missing), note)


def ast_collect_node_ids(root: str | Path, files: list[str]) -> Collected:
    """Approximate collection without running pytest: a node id for every `test*` function and
    `Test*` class (with its `test*` methods) defined at the top level of each file."""
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


def _cluster_entry_problems(where: str, entry: str) -> list[str]:
    from cpkit.cluster.checks import CHECKS

    name = entry[len(CLUSTER_PREFIX):]
    if name in CHECKS:
        return []
    return [f"{where}: {entry!r} names no check of python -m cpkit.cluster (src/cpkit/cluster/checks.py::CHECKS: "
            f"{', '.join(CHECKS)}); e.g. {CLUSTER_PREFIX}{CHECKS[0]}"]


def claim_problems(root: Path, cards) -> list[str]:
    """Measured claims and the numbers around them: each claim's evidence folder exists and its
    `about` entries resolve, ids are unique over all cards, every last_result's evidence folder
    exists, generated claim blocks match the cards, and no card, skill or README quotes a
    measured number that no claim backs (cpkit.cards.claims)."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for card in cards:
        for i, claim in enumerate(card.claims):
            where = f"{card.path}: claims[{i}] ({claim.id})"
            if claim.id in seen:
                problems.append(f"{where}: id {claim.id!r} is also a claim of {seen[claim.id]}; claim ids are unique "
                                "over all cards, as skills name them")
            seen.setdefault(claim.id, card.path)
            if not (root / claim.evidence).exists():
                problems.append(f"{where}.evidence: {claim.evidence!r} does not exist; a claim names the evidence "
                                "folder its raw output was committed to (evidence/<date>-<machine>-<commit>/, "
                                "indexed in evidence/README.md)")
            for j, entry in enumerate(claim.about):
                if entry.startswith(CLUSTER_PREFIX):
                    problems += _cluster_entry_problems(f"{where}.about[{j}]", entry)
                    continue
                reason = resolve_anchor(root, entry)
                if reason:
                    problems.append(f"{where}.about[{j}]: {entry!r} {reason}")
        for i, item in enumerate(card.follow_up_validation):
            last = item.last_result
            if last is not None and last.evidence and not (root / last.evidence).exists():
                problems.append(f"{card.path}: follow_up_validation[{i}].last_result.evidence: {last.evidence!r} "
                                "does not exist")
    markdown = [p.relative_to(root).as_posix() for p in sorted((root / "skills").rglob("*.md"))]
    markdown += ["README.md"] if (root / "README.md").is_file() else []
    problems += rendered_block_problems(root, cards, markdown)
    problems += pointer_problems(root, cards)
    problems += [u.problem() for u in unbacked_numbers(root, cards)]
    return problems


def check_cards(
    root: str | Path,
    *,
    collect: Collector | None = collect_node_ids,
    notes: list[str] | None = None,
    today: _dt.date | None = None,
) -> list[str]:
    """Check every card under `root/cards`; returns problems, one line each, empty when all hold.

    Checks the schema (see cards/README.md), that each card has a matching skill folder, that every
    `evidence` anchor resolves, the measured claims and the numbers around them (claim_problems),
    and that every `covered_by` node id is collected by pytest
    (one collection subprocess over the named files; `collect` replaces it, e.g. in tests, and
    None skips it when no test file or card changed since the ids were last collected).
    Informational notes (such as an ast fallback) are appended to `notes` when given.
    """
    root = Path(root).resolve()
    if not (root / "cards").is_dir():
        return [f"{root / 'cards'}: no cards folder"]
    cards, problems = load_cards(root, today=today)
    for folder in card_dirs(root):
        # The four parts of a feature live side by side: a card without a skill is half a feature.
        if (folder / "card.yaml").is_file() and not (root / "skills" / folder.name / "SKILL.md").is_file():
            problems.append(f"cards/{folder.name}/card.yaml: no matching skill skills/{folder.name}/SKILL.md")
    problems += check_upstream_maps(root)
    problems += claim_problems(root, cards)
    pending: list[tuple[str, str]] = []  # (where, node id) waiting for collection
    for card in cards:
        for i, anchor in enumerate(card.evidence):
            reason = resolve_anchor(root, anchor)
            if reason:
                problems.append(f"{card.path}: evidence[{i}]: {anchor!r} {reason}")
        for i, item in enumerate(card.follow_up_validation):
            for j, node in enumerate(item.covered_by):
                where = f"{card.path}: follow_up_validation[{i}].covered_by[{j}]"
                if node.startswith(CLUSTER_PREFIX):
                    problems += _cluster_entry_problems(where, node)
                    continue
                reason = resolve_anchor(root, node)
                if reason:
                    problems.append(f"{where}: {node!r} {reason}")
                else:
                    pending.append((where, node))
    if collect is None:
        return problems
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


