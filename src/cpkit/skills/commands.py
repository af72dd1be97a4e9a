"""Whether a command a skill names exists: `cpkit` subcommands and flags (against the CLI's
parser, which the caller passes in), pytest paths, node ids and markers, `python -m cpkit.bench`
benchmarks and `python -m cpkit.<module>` modules."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import importlib.util
import re
import tomllib
from pathlib import Path

from cpkit.skills.scan import program_of
from cpkit.validation.anchors import resolve_anchor

__all__ = ["check_command"]

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




def check_command(argv: list[str], root: str | Path, parser: argparse.ArgumentParser) -> list[str]:
    """Problems with one command line (argv as split by shlex); empty when it exists.

    `cpkit ...` (or `python -m cpkit.cli ...`): every subcommand level and every flag exists in
    `parser` (the CLI's, cpkit.cli.build_parser()). `pytest ...` (or `python -m pytest ...`): every path or node id
    exists (node ids checked with ast; `[params]` ignored) and every `-m` marker is registered.
    `python -m cpkit.bench <name>`: a known benchmark. `python -m cpkit.cluster ...` (or
    `torchrun [options] -m cpkit.cluster ...`): its arguments parse. `python -m cpkit.<mod>`: the
    module exists. `python examples/<name>.py` (or under torchrun): the example exists.
    """
    root = Path(root)
    example = next((a for a in argv[1:] if a.startswith("examples/") and a.endswith(".py")), None)
    if argv[0] in ("python", "python3", "torchrun") and example is not None and not (root / example).is_file():
        return [f"`{' '.join(argv)}`: no file {example}"]
    program = program_of(argv)
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


def _check_cpkit(args: list[str], parser: argparse.ArgumentParser) -> list[str]:
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
    if importlib.util.find_spec(BENCHMARKS[name]) is None:
        return [f"`python -m cpkit.bench {name}`: module {BENCHMARKS[name]} does not exist yet"]
    return []
