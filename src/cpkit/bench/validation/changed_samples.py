"""`python -m cpkit.bench changed_samples`: what `cpkit validate --changed` costs a change that breaks nothing.

For each named function (`--function src/cpkit/x.py::name`, default: five functions of different
features), in a scratch worktree of HEAD: a statement that changes nothing goes into the
function's body (`_sampled_change = None`), `cpkit validate --changed HEAD --json` runs, the
change is reverted. Reports per change the test files run whole, the node ids run singly, the
tests run (the unit and dist rows' counts), their share of the suite (the tests the coverage map's
recording ran) and the wall time, with the median and the worst. Writes the table and a JSON
report (machine, commit). The recall bench (`changed_recall`) asks the other question: does the
selection catch a change that does break something.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["DEFAULT_FUNCTIONS", "insert_noop", "main"]

DEFAULT_FUNCTIONS = ("src/cpkit/eval_cp/loop.py::reduce_eval_loss", "src/cpkit/sharding.py::thd_partition",
                     "src/cpkit/dynamic/candidates.py::robustness", "src/cpkit/hierarchical/layout_fixes.py::nearest_layouts",
                     "src/cpkit/loss.py::global_loss")
_NOOP = "_sampled_change = None  # a one-function change"


def insert_noop(source: str, name: str) -> str:
    """`source` with a no-op statement as the first statement (after the docstring) of function
    `name` (a dotted qualname: `Class.method`); ValueError naming the function if it is not there."""
    tree = ast.parse(source)
    scope: list[ast.AST] = [tree]
    for part in name.split("."):
        found = [n for s in scope for n in ast.iter_child_nodes(s)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part]
        if not found:
            raise ValueError(f"--function ...::{name}: no function {part!r} there; name a function the file defines")
        scope = found[:1]
    fn = scope[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError(f"--function ...::{name}: a class, not a function; name one of its methods (Class.method)")
    head = fn.body[0]
    has_doc = isinstance(head, ast.Expr) and isinstance(head.value, ast.Constant) and isinstance(head.value.value, str)
    lines = source.splitlines(keepends=True)
    lines.insert(head.end_lineno if has_doc else head.lineno - 1, " " * head.col_offset + _NOOP + "\n")
    return "".join(lines)


def _counts(report: dict) -> dict[str, int]:
    """Outcome counts of the report's unit and dist rows (the card rows count follow-ups, not tests)."""
    counts: dict[str, int] = {}
    for row in report.get("rows", []):
        if row.get("check") in ("unit tests", "dist tests"):
            for value, kind in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?)", row["result"]):
                counts[kind] = counts.get(kind, 0) + int(value)
    return counts


def _sample(scratch: Path, change: str, suite: int, timeout: float) -> dict:
    path, name = change.split("::", 1)
    target = scratch / path
    target.write_text(insert_noop(target.read_text(), name))
    report = scratch.parent / "report.json"
    env = {**__import__("os").environ, "PYTHONPATH": str(scratch / "src")}
    start = time.perf_counter()
    try:
        code = subprocess.run([sys.executable, "-m", "cpkit.cli", "validate", "--changed", "HEAD", "--root", str(scratch),
                               "--json", str(report)], cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    wall = time.perf_counter() - start
    subprocess.run(["git", "checkout", "-q", "--", path], cwd=scratch, check=True)
    data = json.loads(report.read_text()) if report.exists() else {}
    report.unlink(missing_ok=True)
    changed, counts = data.get("changed") or {}, _counts(data)
    return {"change": change, "exit": code, "wall_s": round(wall, 1), "files": changed.get("run", []),
            "node_ids": len(changed.get("run_node_ids") or []), "counts": counts,
            "share": round(sum(counts.values()) / suite, 4) if suite else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpkit.bench changed_samples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--function", action="append", dest="functions", metavar="PATH::NAME",
                        help=f"a function to change (repeatable; default: {', '.join(DEFAULT_FUNCTIONS)})")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one --changed run may take")
    parser.add_argument("--out", type=Path, default=Path("bench-results/changed_samples.json"))
    args = parser.parse_args(argv)
    root = Path.cwd().resolve()
    functions = args.functions or list(DEFAULT_FUNCTIONS)
    problems = []
    for change in functions:
        path, _, name = change.partition("::")
        if not name or not (root / path).is_file():
            problems.append(f"--function {change!r}: must be PATH::NAME with PATH a file under {root}, "
                            f"e.g. {DEFAULT_FUNCTIONS[0]}")
            continue
        try:
            insert_noop((root / path).read_text(), name)
        except ValueError as exc:
            problems.append(f"{path}: {exc}")
    if problems:
        parser.error("\n".join(problems))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    recorded = json.loads((root / "evidence" / "coverage-map.json").read_text()).get("recorded", {})
    suite = sum(recorded.get("outcomes", {}).values())
    scratch = Path(tempfile.mkdtemp(prefix="cpkit-samples-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(scratch), commit], cwd=root, check=True)
    rows = []
    try:
        for change in functions:
            rows.append(_sample(scratch, change, suite, args.timeout))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "files"}), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(scratch)], cwd=root)
        shutil.rmtree(scratch.parent, ignore_errors=True)
    from cpkit.bench.common import format_table, machine_info

    walls = [r["wall_s"] for r in rows]
    shares = [r["share"] for r in rows if r["share"] is not None]
    summary = {"changes": len(rows), "suite_tests": suite, "median_wall_s": statistics.median(walls),
               "worst_wall_s": max(walls), "median_share": statistics.median(shares) if shares else None,
               "worst_share": max(shares, default=None), "all_green": all(r["exit"] == 0 for r in rows)}
    columns = ["files whole", "single tests", "tests", "share", "wall s", "exit"]
    cells = {(r["change"], c): v for r in rows for c, v in zip(columns, [
        str(len(r["files"])), str(r["node_ids"]), str(sum(r["counts"].values())),
        "-" if r["share"] is None else f"{r['share']:.1%}", f"{r['wall_s']:.1f}", str(r["exit"])])}
    print(format_table([r["change"] for r in rows], columns, cells, corner="changed function"))
    print(json.dumps(summary))
    report = {"bench": "changed_samples", "commit": commit, "machine": machine_info(), "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"report written to {args.out}")
    return 0 if summary["all_green"] else 1


if __name__ == "__main__":
    sys.exit(main())
