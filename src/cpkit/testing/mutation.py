"""Mutation testing of one module: inject small faults and see whether its tests notice.

    python -m cpkit.testing.mutation src/cpkit/sharding.py tests/test_sharding.py --sample 40

Each mutant is one change to the module's syntax tree: a flipped comparison (`<` -> `>=`), an
integer constant off by one, `and` <-> `or`, a dropped `not`, `+` <-> `-`, `*` <-> `//`, a return
value replaced by None, or a statement (an assignment or a call) replaced by `pass`. The mutated
module is written into a copy of `src/` and the given tests run in a fresh `python -m pytest -x`
process (cpkit.validation.pytest_runner) with that copy first on PYTHONPATH; a mutant is killed
when the tests fail (or time out), and survives when they pass. A fresh process per mutant is slower than forking (mostly imports),
but forking workers with torch and gloo loaded hang.

Prints, per mutant, the outcome, line and change, and the score: killed / (mutants - equivalent).
`--equivalent FILE` names mutants known not to change behaviour (one `line:col: change` per line,
as printed), which are left out of the score. `--json PATH` writes the report. CPU time adds up fast
(5-10 s per mutant on 2 cores): sample with `--sample N` (a fixed `--seed` gives the same sample).
pytest options for the test run (`-k`, `-m`) go after `--`, with the tests:

    python -m cpkit.testing.mutation src/cpkit/attention/p2p.py --sample 40 -- \
        tests/test_attention_unit.py functional/test_attention.py -k "not nccl"
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from cpkit.validation.mutants import Mutant, _Sites, apply_mutant, find_mutants, mutant_source  # noqa: F401 - re-exported
from cpkit.validation.pytest_runner import run_pytest

__all__ = ["Mutant", "find_mutants", "apply_mutant", "mutant_source", "run", "main"]

def _pytest(src_copy: Path, root: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    start = time.perf_counter()
    result = run_pytest(root, ["-x", "-p", "no:randomly", *tests], output="capture", timeout=timeout,
                        pythonpath=src_copy)
    seconds = time.perf_counter() - start
    code = result.exit_code
    if code == 0:
        return "survived", seconds
    if isinstance(code, str):
        return f"killed ({code})", seconds
    return ("killed" if code in (1, 2, 3) else f"killed (exit {code})"), seconds


def run(module: str, tests: list[str], *, root: Path, sample: int | None = None, seed: int = 0,
        only: set[str] | None = None, equivalent: set[str] = frozenset(), out=sys.stdout) -> dict:
    """Mutate `module` (a path under root/src) and run `tests` against each mutant (all, a random
    `sample`, or `only` those with these keys); the report."""
    root = root.resolve()
    path = root / module
    relative = path.relative_to(root / "src")
    source = path.read_text(encoding="utf-8")
    mutants = find_mutants(source)
    if only is not None:
        mutants = [m for m in mutants if m.key in only]
    if sample is not None and sample < len(mutants):
        mutants = sorted(random.Random(seed).sample(mutants, sample), key=lambda m: m.index)
    with tempfile.TemporaryDirectory(prefix="cpkit-mutation-") as tmp:
        src_copy = Path(tmp) / "src"
        shutil.copytree(root / "src", src_copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        target = src_copy / relative
        # The unmutated module, written the same way, must pass: it sets the time limit too.
        target.write_text(ast.unparse(ast.parse(source)), encoding="utf-8")
        baseline, seconds = _pytest(src_copy, root, tests, timeout=1800)
        if baseline != "survived":
            raise RuntimeError(f"the tests fail on the unmutated {module}: fix them before mutating")
        timeout = 3 * seconds + 30
        print(f"{module}: {len(mutants)} mutants, tests {' '.join(tests)} ({seconds:.0f} s unmutated)", file=out)
        results = []
        for mutant in mutants:
            target.write_text(apply_mutant(source, mutant), encoding="utf-8")
            outcome, took = _pytest(src_copy, root, tests, timeout)
            if outcome == "survived" and mutant.key in equivalent:
                outcome = "equivalent"
            results.append({**asdict(mutant), "outcome": outcome, "seconds": round(took, 1),
                            "code": source.splitlines()[mutant.line - 1].strip() if mutant.line else ""})
            print(f"  {outcome:<18} {mutant.key:<34} {results[-1]['code'][:60]}", file=out, flush=True)
    killed = sum(r["outcome"].startswith("killed") for r in results)
    counted = sum(r["outcome"] != "equivalent" for r in results)
    report = {"module": module, "tests": tests, "sites": len(find_mutants(source)), "mutants": len(results),
              "killed": killed, "equivalent": len(results) - counted, "seed": seed,
              "score": round(killed / counted, 3) if counted else None, "results": results}
    print(f"{module}: {killed} of {counted} non-equivalent mutants killed"
          + (f" ({report['score']:.0%})" if counted else ""), file=out)
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line; 0 when every non-equivalent mutant was killed, else 1."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.testing.mutation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="the module to mutate, e.g. src/cpkit/sharding.py")
    parser.add_argument("tests", nargs="+", help="pytest paths or node ids that exercise it; after `--`, "
                        "pytest options too (-k EXPR, -m MARKERS)")
    parser.add_argument("--sample", type=int, default=None, help="mutate only N sites, chosen at random")
    parser.add_argument("--seed", type=int, default=0, help="the sample's random seed (default 0)")
    parser.add_argument("--only", action="append", metavar="KEY",
                        help="run only the mutant `line:col: change` (repeatable), e.g. to re-check survivors")
    parser.add_argument("--equivalent", type=Path, help="file of `line:col: change` mutants known to be equivalent")
    parser.add_argument("--json", type=Path, help="write the report as JSON to this path")
    parser.add_argument("--list", action="store_true", help="only list the mutation sites")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if not (root / args.module).is_file() or not args.module.startswith("src/"):
        parser.error(f"module {args.module!r}: give a path under src/ relative to the repository root")
    if args.list:
        for mutant in find_mutants((root / args.module).read_text(encoding="utf-8")):
            print(mutant.key)
        return 0
    equivalent = set()
    if args.equivalent:
        equivalent = {line.strip() for line in args.equivalent.read_text().splitlines()
                      if line.strip() and not line.startswith("#")}
    report = run(args.module, args.tests, root=root, sample=args.sample, seed=args.seed,
                 only=set(args.only) if args.only else None, equivalent=equivalent)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["killed"] == report["mutants"] - report["equivalent"] else 1


if __name__ == "__main__":
    sys.exit(main())
