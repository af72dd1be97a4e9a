"""The README's benchmark table: per question, the benchmark that answers it and its newest
measured claim, rendered from the cards (`python -m cpkit.cards.render` writes it; `cpkit cards
check` reports a table that differs).

A hand-written "recorded run" column sent every attention question to one cp-4 run on another
machine. Each row here names the newest claim whose command ran that benchmark with the row's
setting (cp 2 or cp 4, features or dense), or says that none is recorded; `cpkit cards status`
tells whether it still holds for the code as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cpkit.cards.claim_scope import entry_modules

__all__ = ["BEGIN", "END", "QUESTIONS", "render_pointers", "replace_pointers", "pointer_problems"]

BEGIN = "<!-- benchmark pointers: generated from the cards' claims by python -m cpkit.cards.render; do not edit -->"
END = "<!-- end of benchmark pointers -->"


@dataclass(frozen=True)
class Question:
    """One row: the command to run, what it answers, and which claims' commands answer it."""

    command: str
    answers: str
    bench: str
    matches: Callable[[str], bool] = lambda command: True


def _cp(n: int) -> Callable[[str], bool]:
    # gpu-bench.sh's attention preset runs at the host's GPU count (cp 4 on 4 GPUs and before it did)
    return lambda c: f"--cp {n}" in c or (n == 4 and "gpu-bench.sh attention" in c and "--cp" not in c)


def _against_te(command: str) -> bool:
    """The run had TE beside cpkit: no --backends (the bench's default includes TE) or a list naming it."""
    chosen = re.search(r"--backends[ =](\S+)", command)
    return chosen is None or "te" in chosen[1].split(",")


QUESTIONS = (
    Question("`python -m cpkit.bench attention --cp 2`", "dense, cp 2: vs TE, torch CP, SDPA",
             "attention", lambda c: _cp(2)(c) and "--features" not in c and _against_te(c)),
    Question("`python -m cpkit.bench attention --cp 2 --features ...`", "windows, sinks, MLA at cp 2; comm type",
             "attention", lambda c: _cp(2)(c) and "--features" in c),
    Question("`python -m cpkit.bench attention --cp 4`", "dense, cp 4",
             "attention", lambda c: _cp(4)(c) and "--features" not in c and "profile" not in c),
    Question("`python -m cpkit.bench attention --cp 4 --features ...`", "windows, sinks, MLA at cp 4",
             "attention", lambda c: _cp(4)(c) and "--features" in c),
    Question("`python -m cpkit.bench attention --profile FILE`", "where the time goes",
             "attention", lambda c: "profile" in c),
    Question("`python -m cpkit.bench eval_cp`", "eval at a higher CP", "eval_cp"),
    Question("`python -m cpkit.bench window`", "window compute per rank", "window"),
    Question("`python -m cpkit.bench scheduler`", "dynamic vs static CP (modeled)", "scheduler"),
    Question("`python -m cpkit.bench calibrate`", "the step model's speeds", "calibrate"),
    Question("`python -m cpkit.bench replay`", "plans replayed on one GPU", "replay"),
    Question("`python -m cpkit.bench dynamic_step`", "real steps vs the model", "dynamic_step"),
    Question("`python -m cpkit.bench link`", "the ring exchange vs bytes", "link"),
    Question("`python -m cpkit.bench hybrid`", "a GDN layer at cp 2 vs one GPU", "hybrid"),
    Question("`python -m cpkit.bench changed_recall`", "`--changed` recall", "changed_recall"),
    Question("`python -m cpkit.bench changed_samples`", "`--changed` cost",
             "changed_samples"),
)


def _runs(claim, bench: str, root: Path) -> bool:
    from cpkit.bench.__main__ import BENCHMARKS

    modules, _ = entry_modules(claim.command, root)
    return BENCHMARKS[bench] in modules


def newest_claim(question: Question, cards, root: Path):
    """The newest claim (by date; the later one in the cards on a tie) that answers `question`."""
    found = [(claim.date, i, claim) for i, claim in enumerate(c for card in cards for c in card.claims)
             if _runs(claim, question.bench, root) and question.matches(claim.command)]
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else None


def render_pointers(cards, root: str | Path) -> str:
    """The generated table, between BEGIN and END."""
    root = Path(root)
    lines = [BEGIN, "| command | answers | newest claim |", "|---|---|---|"]
    for q in QUESTIONS:
        claim = newest_claim(q, cards, root)
        where = f"`{claim.id}` ({claim.machine.split(' (')[0]}, {claim.commit})" if claim else "none recorded yet"
        lines.append(f"| {q.command} | {q.answers} | {where} |")
    lines.append(END)
    return "\n".join(lines)


_BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)


def replace_pointers(text: str, cards, root: str | Path) -> str:
    """`text` with its generated benchmark table rewritten (unchanged when it has none)."""
    return _BLOCK.sub(lambda _: render_pointers(cards, root), text)


def pointer_problems(root: str | Path, cards) -> list[str]:
    """The README's generated benchmark table, when it differs from the cards (one line)."""
    path = Path(root) / "README.md"
    if not path.is_file() or BEGIN not in (text := path.read_text(encoding="utf-8")):
        return []
    if replace_pointers(text, cards, root) != text:
        return ["README.md: the benchmark table differs from the cards' claims; fix: python -m cpkit.cards.render"]
    return []
