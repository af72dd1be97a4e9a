"""What a skill body names: repository anchors (inline code spans, relative links) and the
commands it tells an agent to run (shell fences and inline `cpkit ...` spans). The rules are in
skills/README.md."""

from __future__ import annotations

import re
import shlex
from typing import Iterator

from cpkit.validation.anchors import is_anchor_token

__all__ = ["SHELL_FENCES", "body_anchors", "body_commands", "program_of"]

#: Fenced blocks whose info string is one of these hold shell commands that are checked.
SHELL_FENCES = ("", "bash", "sh", "shell", "console", "zsh")

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_COMMAND_START = ("cpkit ", "pytest ", "python -m ", "python3 -m ")
_CHECKED_START = re.compile(r"^\s*([A-Za-z_]\w*=\S*\s+)*(uv run\s+)?(cpkit|pytest|python3? -m)\b")


def _scan(body: str) -> Iterator[tuple[int, str, str | None]]:
    """Yield (0-based line, text, fence info) for every body line; info is None outside fences."""
    fence: tuple[str, str] | None = None  # (marker, info)
    for n, line in enumerate(body.splitlines()):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = (match.group(1), match.group(2).lower())
            continue
        if fence is not None and line.strip().startswith(fence[0]) and not line.strip().strip(fence[0][0]):
            fence = None
            continue
        yield n, line, None if fence is None else fence[1]


def _strip_word(word: str) -> str:
    word = word.strip("'\"").rstrip(",;)")
    if word.endswith(".") and not word.endswith("/."):
        word = word[:-1]
    if word.endswith(":") and not word.endswith("::"):
        word = word[:-1]
    return word


def body_anchors(body: str) -> list[tuple[int, str]]:
    """(0-based line, anchor) for every anchor the body names.

    Anchors are words of inline code spans (outside fenced blocks) that start with one of
    cpkit.validation.anchors.ANCHOR_PREFIXES or contain `::`; spans that are commands (see body_commands)
    are checked as commands instead. Relative markdown link targets are returned as `link:<target>`.
    """
    found: list[tuple[int, str]] = []
    for n, line, info in _scan(body):
        if info is not None:
            continue
        for match in _CODE_SPAN.finditer(line):
            span = match.group(2).strip()
            if span.startswith(_COMMAND_START):
                continue
            found += [(n, w) for w in map(_strip_word, span.split()) if w and is_anchor_token(w)]
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            found.append((n, "link:" + target.split("#")[0]))
    return found


def body_commands(body: str) -> list[tuple[int, list[str]]]:
    """(0-based line, argv) for every command the body tells an agent to run.

    Commands are lines of fenced blocks whose info string is in SHELL_FENCES (in `console` blocks
    only `$ ` prompt lines), joined over trailing backslashes and split at `&&`, `||`, `;` and
    `|`, plus inline code spans that start with `cpkit `, `pytest ` or `python -m `. Leading
    `VAR=value`, `env` and `uv run` are dropped. Only commands starting with `cpkit`, `pytest`
    or `python -m` are returned; other programs are not checked.
    """
    out: list[tuple[int, list[str]]] = []
    pending, start = "", 0
    for n, line, info in _scan(body):
        if info is None:
            for match in _CODE_SPAN.finditer(line):
                span = match.group(2).strip()
                if span.startswith(_COMMAND_START):
                    out += [(n, argv) for argv in _split_commands(span)]
            continue
        if info not in SHELL_FENCES:
            continue
        text = line.strip()
        if info == "console":
            if not text.startswith("$ ") and not pending:
                continue
            text = text[2:] if text.startswith("$ ") else text
        if not pending:
            start = n
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out += [(start, argv) for argv in _split_commands(pending + text)]
        pending = ""
    return [(n, argv) for n, argv in out if argv and program_of(argv)]


def _split_commands(text: str) -> list[list[str]]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: an error only in a command we would check
        return [["<unparsable>", text]] if _CHECKED_START.match(text) else []
    commands, current = [], []
    for tok in tokens:
        if tok and set(tok) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(tok)
    commands.append(current)
    return [_drop_prefix(c) for c in commands if c]


def _drop_prefix(argv: list[str]) -> list[str]:
    while argv and (_ENV_ASSIGN.match(argv[0]) or argv[0] == "env"):
        argv = argv[1:]
    if argv[:2] == ["uv", "run"]:
        argv = argv[2:]
    return argv


def program_of(argv: list[str]) -> str | None:
    """'cpkit', 'pytest' or the module of `python -m <module>`; None for other programs."""
    if argv[0] == "<unparsable>":
        return "<unparsable>"
    if argv[0] in ("cpkit", "pytest", "py.test"):
        return argv[0]
    if argv[0] in ("python", "python3") and len(argv) > 2 and argv[1] == "-m":
        return argv[2]
    if argv[0] == "torchrun" and "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "cpkit.cluster":
        return "cpkit.cluster"
    return None
