"""Skill guides (`skills/<name>/SKILL.md` + `evals.json`): loading and checks.

`check_skills` verifies, for every skill folder: the frontmatter; that every repository anchor the
body names resolves; that every command the body tells an agent to run exists (a `cpkit`
subcommand and its flags, a pytest path, node id or marker, a `python -m cpkit.bench` benchmark);
and the shape of evals.json. What counts as an anchor and as a command is defined in
skills/README.md and implemented by `body_anchors` and `body_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import importlib.util
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from cpkit.anchors import is_anchor_token, resolve_anchor
from cpkit.cards import StrictYAMLError, load_strict_yaml

__all__ = [
    "FRONTMATTER_KEYS",
    "MAX_DESCRIPTION_CHARS",
    "MAX_BODY_LINES",
    "SHELL_FENCES",
    "EVAL_KEYS",
    "Skill",
    "SkillError",
    "load_skill",
    "skill_dirs",
    "body_anchors",
    "body_commands",
    "check_command",
    "check_evals",
    "check_skills",
]

FRONTMATTER_KEYS = ("name", "description", "license", "when_to_use")
MAX_DESCRIPTION_CHARS = 1024
MAX_NAME_CHARS = 64
MAX_BODY_LINES = 500
#: Fenced blocks whose info string is one of these hold shell commands that are checked.
SHELL_FENCES = ("", "bash", "sh", "shell", "console", "zsh")
EVAL_KEYS = ("id", "question", "expected_skill", "ground_truth", "expected_behavior")

_KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_COMMAND_START = ("cpkit ", "pytest ", "python -m ", "python3 -m ")
_CHECKED_START = re.compile(r"^\s*([A-Za-z_]\w*=\S*\s+)*(uv run\s+)?(cpkit|pytest|python3? -m)\b")
# pytest options that take a separate value (so the value is not read as a test path).
_PYTEST_VALUE_OPTS = {
    "-m", "-k", "-p", "-n", "-c", "-o", "-W", "-r", "--maxfail", "--timeout", "--junitxml",
    "--junit-xml", "--junit-prefix", "--deselect", "--ignore", "--ignore-glob", "--durations",
    "--durations-min", "--rootdir", "--basetemp", "--log-level", "--log-cli-level", "--log-file",
    "--dist", "--numprocesses", "--maxprocesses", "--confcutdir", "--override-ini",
    "--import-mode", "--capture", "--tb", "--color", "--timeout-method", "--hypothesis-seed",
    "--hypothesis-profile", "--report-log", "--cov", "--cov-report", "--max-worker-restart",
}
_BUILTIN_MARKERS = {"skip", "skipif", "xfail", "parametrize", "usefixtures", "filterwarnings", "timeout"}


@dataclass(frozen=True)
class Skill:
    """A loaded skill: its frontmatter, body and where the body starts in SKILL.md."""

    name: str
    path: str  # repo-relative SKILL.md
    description: str
    license: str
    when_to_use: Any
    body: str
    body_start_line: int  # 1-based line of the body's first line in SKILL.md


class SkillError(ValueError):
    """A skill failed to load; `.problems` lists every problem, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def skill_dirs(root: str | Path) -> list[Path]:
    """Skill folders under `root/skills` (hidden folders and __pycache__ skipped), sorted."""
    skills = Path(root) / "skills"
    if not skills.is_dir():
        return []
    return sorted(d for d in skills.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _text_problem(value: Any, allow_list: bool = False) -> str | None:
    if isinstance(value, str) and value.strip():
        return None
    if allow_list and isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
        return None
    kind = "a non-empty string" + (" or list of strings" if allow_list else "")
    return f"expected {kind}, got {value!r}"


def load_skill(folder: str | Path, root: str | Path) -> Skill:
    """Load `folder/SKILL.md` and check its frontmatter and body length.

    Raises SkillError listing every problem (`skills/x/SKILL.md: name: ...`).
    """
    folder, root = Path(folder), Path(root)
    file = folder / "SKILL.md"
    rel = _rel(file, root)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SkillError([f"{rel}: cannot read: {exc.strerror}"]) from None
    if not lines or lines[0].strip() != "---":
        raise SkillError([f"{rel}: missing frontmatter: the file must start with a '---' line"])
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        raise SkillError([f"{rel}: frontmatter is not closed by a '---' line"])
    try:
        meta = load_strict_yaml("\n".join(lines[1:end]))
    except StrictYAMLError as exc:
        raise SkillError([f"{rel}: frontmatter: {exc}"]) from None
    except yaml.YAMLError as exc:
        raise SkillError([f"{rel}: frontmatter: invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    if not isinstance(meta, dict):
        raise SkillError([f"{rel}: frontmatter: expected a mapping, got {type(meta).__name__}"])
    problems = [f"{rel}: {k}: unknown frontmatter key (allowed: {', '.join(FRONTMATTER_KEYS)})"
                for k in meta if k not in FRONTMATTER_KEYS]
    problems += [f"{rel}: {k}: missing required frontmatter key" for k in FRONTMATTER_KEYS if k not in meta]
    for key in FRONTMATTER_KEYS:
        if key in meta:
            problem = _text_problem(meta[key], allow_list=key == "when_to_use")
            if problem:
                problems.append(f"{rel}: {key}: {problem}")
    name = meta.get("name")
    if isinstance(name, str) and name:
        if not _KEBAB.match(name) or len(name) > MAX_NAME_CHARS:
            problems.append(f"{rel}: name: {name!r} is not kebab-case of at most {MAX_NAME_CHARS} characters")
        if name != folder.name:
            problems.append(f"{rel}: name: {name!r} differs from its folder {folder.name!r}")
    description = meta.get("description")
    if isinstance(description, str) and len(description) > MAX_DESCRIPTION_CHARS:
        problems.append(f"{rel}: description: {len(description)} characters, at most {MAX_DESCRIPTION_CHARS}")
    body = lines[end + 1:]
    if len(body) > MAX_BODY_LINES:
        problems.append(f"{rel}: body: {len(body)} lines, at most {MAX_BODY_LINES}; move details to sibling files")
    if problems:
        raise SkillError(problems)
    return Skill(name=name, path=rel, description=description, license=meta["license"],
                 when_to_use=meta["when_to_use"], body="\n".join(body), body_start_line=end + 2)


# ----------------------------------------------------------------------------- body scanning


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
    cpkit.anchors.ANCHOR_PREFIXES or contain `::`; spans that are commands (see body_commands)
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
    return [(n, argv) for n, argv in out if argv and _program(argv)]


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


def _program(argv: list[str]) -> str | None:
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


# ----------------------------------------------------------------------------- command checks


def check_command(argv: list[str], root: str | Path, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Problems with one command line (argv as split by shlex); empty when it exists.

    `cpkit ...` (or `python -m cpkit.cli ...`): every subcommand level and every flag exists in
    cpkit.cli.build_parser(). `pytest ...` (or `python -m pytest ...`): every path or node id
    exists (node ids checked with ast; `[params]` ignored) and every `-m` marker is registered.
    `python -m cpkit.bench <name>`: a known benchmark. `python -m cpkit.cluster ...` (or
    `torchrun [options] -m cpkit.cluster ...`): its arguments parse. `python -m cpkit.<mod>`: the
    module exists.
    """
    root = Path(root)
    program = _program(argv)
    if program == "<unparsable>":
        return [f"cannot parse command: {argv[1]}"]
    if program is None:
        return []
    if argv[0] == "torchrun":
        args = argv[argv.index("-m") + 2:]
    else:
        args = argv[3:] if argv[0].startswith("python") else argv[1:]
    if program in ("cpkit", "cpkit.cli") and not (program == "cpkit" and argv[0].startswith("python")):
        return _check_cpkit(args, parser)
    if program in ("pytest", "py.test"):
        return _check_pytest(args, root)
    if program == "cpkit.bench":
        return _check_bench(args)
    if program == "cpkit.cluster":
        return _check_cluster(args)
    if program == "cpkit" or program.startswith("cpkit."):
        module = "cpkit.__main__" if program == "cpkit" else program
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        return [] if found else [f"`python -m {program}`: no module {module}"]
    return []


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _n_values(action: argparse.Action) -> int:
    """How many following tokens an option consumes (for skipping its values)."""
    nargs = action.nargs
    if nargs is None:
        return 0 if action.option_strings and isinstance(action, _NO_VALUE_ACTIONS) else 1
    if isinstance(nargs, int):
        return nargs
    return 1 if nargs in ("?", "*", "+") else 0


_NO_VALUE_ACTIONS = (
    argparse._StoreConstAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
    argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction, argparse._VersionAction,
)


def _check_cpkit(args: list[str], parser: argparse.ArgumentParser | None) -> list[str]:
    if parser is None:
        from cpkit.cli import build_parser  # late: cli imports the command modules, which import us

        parser = build_parser()
    chain = ["cpkit"]
    asked_help = False
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            break
        if tok.startswith("-") and not re.match(r"^-\d", tok):
            name = tok.split("=", 1)[0]
            action = parser._option_string_actions.get(name)
            if action is None:
                options = sorted(o for o in parser._option_string_actions if o.startswith("--"))
                return [f"`{' '.join(chain)}` has no option {name} (options: {', '.join(options)})"]
            asked_help |= isinstance(action, argparse._HelpAction)
            if "=" not in tok:
                i += _n_values(action)
            continue
        sub = _subparsers(parser)
        if sub is None:
            continue  # a positional value of the leaf command
        if tok not in sub.choices:
            return [f"`{' '.join(chain)}` has no subcommand {tok!r} (choices: {', '.join(sub.choices)})"]
        parser = sub.choices[tok]
        chain.append(tok)
    sub = _subparsers(parser)
    if sub is not None and sub.required and not asked_help:
        return [f"`{' '.join(chain)}` needs a subcommand ({', '.join(sub.choices)})"]
    return []


def _registered_markers(root: Path) -> set[str] | None:
    try:
        config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    lines = config.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("markers", [])
    return {line.split(":")[0].split("(")[0].strip() for line in lines} | _BUILTIN_MARKERS


def _marker_problems(expr: str, root: Path) -> list[str]:
    known = _registered_markers(root)
    if known is None:
        return []  # no pytest config to check against
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)
    unknown = [w for w in words if w not in ("and", "or", "not") and w not in known]
    return [f"`-m {expr}`: unknown marker {w!r} (registered: {', '.join(sorted(known))})" for w in unknown]


def _check_pytest(args: list[str], root: Path) -> list[str]:
    problems: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok.startswith("-"):
            name, eq, value = tok.partition("=")
            if name == "-m" or (tok.startswith("-m") and not tok.startswith("--") and len(tok) > 2):
                expr = value if eq else (tok[2:] if len(tok) > 2 else (args[i] if i < len(args) else ""))
                problems += _marker_problems(expr, root)
            if name in _PYTEST_VALUE_OPTS and not eq:
                i += 1
            continue
        reason = resolve_anchor(root, tok)
        if reason:
            problems.append(f"`pytest {tok}`: {reason}")
    return problems


def _check_cluster(args: list[str]) -> list[str]:
    from cpkit.cluster import build_parser

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser().parse_args(args)
    except SystemExit:
        last = errors.getvalue().strip().splitlines()
        return [f"`python -m cpkit.cluster {' '.join(args)}`: {last[-1] if last else 'does not parse'}"]
    return []


def _check_bench(args: list[str]) -> list[str]:
    from cpkit.bench.__main__ import BENCHMARKS

    name = args[0] if args else None
    if name not in BENCHMARKS:
        return [f"`python -m cpkit.bench {name or ''}`: unknown benchmark (known: {', '.join(BENCHMARKS)})"]
    if importlib.util.find_spec(f"cpkit.bench.{name}") is None:
        return [f"`python -m cpkit.bench {name}`: module cpkit.bench.{name} does not exist yet"]
    return []


# ----------------------------------------------------------------------------- evals


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"duplicate key {dupes[0]!r}")
    return dict(pairs)


def check_evals(file: str | Path, skill_name: str, root: str | Path) -> list[str]:
    """Problems with a skill's evals.json: a list of {id, question, expected_skill (the skill's
    name, or null for a negative case), ground_truth, expected_behavior: [str]} objects with unique
    ids, at least one positive and one negative case."""
    file, root = Path(file), Path(root)
    rel = _rel(file, root)
    try:
        data = json.loads(file.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
    except OSError as exc:
        return [f"{rel}: cannot read: {exc.strerror}"]
    except ValueError as exc:
        return [f"{rel}: invalid JSON: {exc}"]
    if not isinstance(data, list) or not data:
        return [f"{rel}: expected a non-empty list of eval cases, got {type(data).__name__}"]
    problems: list[str] = []
    ids: list[Any] = []
    for i, case in enumerate(data):
        where = f"{rel}: [{i}]"
        if not isinstance(case, dict):
            problems.append(f"{where}: expected an object with keys {', '.join(EVAL_KEYS)}")
            continue
        problems += [f"{where}.{k}: unknown key (allowed: {', '.join(EVAL_KEYS)})" for k in case if k not in EVAL_KEYS]
        problems += [f"{where}.{k}: missing required key" for k in EVAL_KEYS if k not in case]
        for key in ("question", "ground_truth"):
            if key in case and (problem := _text_problem(case[key])):
                problems.append(f"{where}.{key}: {problem}")
        if "id" in case:
            if not isinstance(case["id"], (str, int)) or isinstance(case["id"], bool) or case["id"] == "":
                problems.append(f"{where}.id: expected a non-empty string or integer, got {case['id']!r}")
            ids.append(case["id"])
        if "expected_skill" in case and case["expected_skill"] not in (skill_name, None):
            problems.append(f"{where}.expected_skill: {case['expected_skill']!r} must be {skill_name!r} or null")
        behavior = case.get("expected_behavior")
        if "expected_behavior" in case and (
            not isinstance(behavior, list) or not behavior
            or not all(isinstance(b, str) and b.strip() for b in behavior)
        ):
            problems.append(f"{where}.expected_behavior: expected a non-empty list of strings")
    dupes = sorted({str(x) for x in ids if ids.count(x) > 1})
    if dupes:
        problems.append(f"{rel}: duplicate ids: {', '.join(dupes)}")
    cases = [c for c in data if isinstance(c, dict) and "expected_skill" in c]
    if not any(c["expected_skill"] == skill_name for c in cases):
        problems.append(f"{rel}: no positive case (expected_skill: {skill_name!r})")
    if not any(c["expected_skill"] is None for c in cases):
        problems.append(f"{rel}: no negative case (expected_skill: null)")
    return problems


# ----------------------------------------------------------------------------- all checks


def check_skills(root: str | Path) -> list[str]:
    """Check every skill under `root/skills`; returns problems, one line each, empty when all hold.

    Per skill: frontmatter and body length (load_skill), anchors (body_anchors), commands
    (body_commands, check_command) and evals.json (check_evals). Problems in the body name
    `SKILL.md:<line>`.
    """
    root = Path(root)
    if not (root / "skills").is_dir():
        return [f"{root / 'skills'}: no skills folder"]
    from cpkit.cli import build_parser  # late: cli imports the command modules, which import us

    parser = build_parser()
    problems: list[str] = []
    for folder in skill_dirs(root):
        rel = _rel(folder, root)
        if not (folder / "SKILL.md").is_file():
            problems.append(f"{rel}: missing SKILL.md")
            continue
        try:
            skill = load_skill(folder, root)
        except SkillError as exc:
            problems += exc.problems
            continue
        at = lambda n: f"{skill.path}:{skill.body_start_line + n}"  # noqa: E731
        for n, anchor in body_anchors(skill.body):
            if anchor.startswith("link:"):
                target = anchor[5:]
                resolved = (folder / target).resolve()
                inside = resolved.is_relative_to(root.resolve())
                if not inside or not resolved.exists():
                    problems.append(f"{at(n)}: link target {target!r} does not exist")
                continue
            reason = resolve_anchor(root, anchor)
            if reason:
                problems.append(f"{at(n)}: `{anchor}` {reason}")
        for n, argv in body_commands(skill.body):
            problems += [f"{at(n)}: {p}" for p in check_command(argv, root, parser)]
        evals = folder / "evals.json"
        if evals.is_file():
            problems += check_evals(evals, skill.name, root)
        else:
            problems.append(f"{rel}: missing evals.json")
    return problems
