"""The code a measured claim ran, derived from its command instead of written by hand.

A claim's `about:` list was hand-written, and a claim read "fresh" after code on its measured path
changed (an a2a forward that the attention benchmark runs, while `about:` named two other
files). Its scope is now derived, for every claim, from the command that measured it:

- `python -m cpkit.bench NAME` is the benchmark's module (cpkit.bench.__main__.BENCHMARKS);
  `python -m cpkit.X` and `cpkit SUB` (cpkit.commands.SUB) are theirs; `bash scripts/X.sh` is the
  script and every `python -m cpkit...` it runs;
- each entry module brings every cpkit module it imports, directly or through others, lazy imports
  and modules named by string (`importlib.import_module("cpkit.attention.module")`) included
  (src/cpkit/validation/import_graph.py);
- repository paths named in the command (a mutated file, its tests) are in scope as they are;
  a Python script of the repository it runs (an evidence folder's A/B) brings the cpkit modules
  it imports as well;
- `cpkit validate` runs the whole suite: its scope is src/, tests/ and functional/.

A benchmark also records the cpkit modules its process loaded (its JSON's `code`:
src/cpkit/bench/common.py::loaded_code): the recorded list, where an evidence folder has one, joins the derived scope.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path

from cpkit.validation.import_graph import cpkit_imports, imports, package_modules, reach

__all__ = ["WHOLE_SUITE", "entry_modules", "claim_scope", "recorded_code"]

#: What `cpkit validate` runs: everything.
WHOLE_SUITE = ("src/", "tests/", "functional/")
_MODULE_RUN = re.compile(r"(?:python3?|\"\$PY\"|\$PY|\$\{?PYTHON\}?)\s+-m\s+(cpkit(?:\.\w+)*)(?:\s+([A-Za-z_]\w*))?")
_CPKIT_SUB = re.compile(r"(?:^|[\s;&|(])cpkit\s+([a-z][\w-]*)")
_SCRIPT = re.compile(r"\b(scripts/[\w.-]+\.sh)\b(?:\s+([\w-]+))?")
_PROFILED = re.compile(r"^\s*profiled\s+(\w+)", re.M)
_BRANCH = re.compile(r"^\s*([\w|-]+)\)(.*?)^\s*;;", re.M | re.S)


def _bench_module(name: str | None) -> str | None:
    from cpkit.bench.__main__ import BENCHMARKS

    return BENCHMARKS.get(name or "")


def entry_modules(command: str, root: Path) -> tuple[set[str], set[str]]:
    """(cpkit modules the command runs as entry points, repository paths it names), shell scripts
    read for the cpkit commands they run."""
    modules: set[str] = set()
    paths: set[str] = set()
    texts = [command]
    for script, preset in _SCRIPT.findall(command):
        paths.add(script)
        if (root / script).is_file():
            texts.append(_script_commands((root / script).read_text(), preset))
    for text in texts[1:]:  # the scripts a script sources or runs (gpu-env.sh, te-install.sh)
        paths.update(s for s, _ in _SCRIPT.findall(text) if (root / s).is_file())
    for text in texts:
        for name in _PROFILED.findall(text):  # gpu-bench.sh's `profiled NAME ARGS`: the bench NAME
            modules.add(_bench_module(name) or "cpkit.bench")
        for module, arg in _MODULE_RUN.findall(text):
            bench = _bench_module(arg) if module == "cpkit.bench" else None
            modules.add(bench or module)
        for sub in _CPKIT_SUB.findall(text):
            if (root / "src/cpkit/commands" / f"{sub.replace('-', '_')}.py").is_file():
                modules.add(f"cpkit.commands.{sub.replace('-', '_')}")
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for word in words:
        word = word.strip("(),")
        if word.startswith(("src/", "tests/", "functional/", "examples/")) and (root / word.split("::")[0]).exists():
            paths.add(word)
        elif word.endswith(".py") and (root / word).is_file():  # a script: it and what it imports
            paths.add(word)
            modules.update(cpkit_imports(imports(root / word, root), package_modules(root / "src")))
    return modules, paths


def _script_commands(text: str, preset: str | None) -> str:
    """A shell script's command lines (comments dropped); of a `case` over presets only the branch
    `preset` names (all branches when it names none)."""
    lines = "\n".join(line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    branches = list(_BRANCH.finditer(lines))
    chosen = [b for b in branches if preset and preset in b.group(1).split("|")]
    if not chosen:
        return lines
    outside = _BRANCH.sub("", lines)
    return outside + "\n" + "\n".join(b.group(2) for b in chosen)


@lru_cache(maxsize=4)
def _closures(src: Path) -> dict[str, frozenset[str]]:
    """module -> every cpkit module it reaches: imports (lazy ones included) and modules named by
    a string literal, transitively."""
    modules = package_modules(src)
    return reach({name: cpkit_imports(imports(path, src), modules) | {s for s in _strings(path) if s in modules}
                  for name, path in modules.items()})


def _strings(path: Path) -> set[str]:
    """String literals that name a cpkit module (`pkg.mod:attr` too) in a module that imports by
    name (importlib.import_module): the lazy exports and the rank workers' targets."""
    text = path.read_text()
    if "import_module" not in text:  # names only, never loaded (the import graph's own tables)
        return set()
    tree = ast.parse(text)
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # docstrings: prose
    return {node.value.split(":", 1)[0] for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and re.fullmatch(r"cpkit(?:\.\w+)+(?::\w+)?", node.value)}


def claim_scope(command: str, root: str | Path, recorded: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The repository paths (files, or folders ending in `/`) a claim measured by `command` ran,
    sorted: the derived entry modules' closures as source files, the paths and scripts the
    command names, and `recorded` (src paths a run wrote down)."""
    root = Path(root).resolve()
    if re.search(r"(?:^|\s)cpkit\s+validate\b", command):
        return WHOLE_SUITE
    src = root / "src"
    modules, paths = entry_modules(command, root)
    closures = _closures(src)
    files = package_modules(src)
    for module in modules:
        for reached in closures.get(module, ()):
            paths.add(files[reached].relative_to(root).as_posix())
    paths.update(recorded)
    return tuple(sorted(paths))


def recorded_code(root: str | Path, evidence: str) -> tuple[str, ...]:
    """The union of the `code` lists in the JSON files of an evidence folder (empty when none
    recorded one: runs before the recording existed)."""
    folder = Path(root) / evidence
    out: set[str] = set()
    if folder.is_dir():
        for path in folder.rglob("*.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and isinstance(data.get("code"), list):
                out.update(p for p in data["code"] if isinstance(p, str))
    return tuple(sorted(out))
