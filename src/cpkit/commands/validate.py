"""`cpkit validate`: run what fits this machine and print one table per feature.

Runs the unit tests, the `dist` tests (gloo), and the gpu2/gpu4 tests when enough CUDA devices
are present, in one pytest process; then `cpkit cards check`, `cpkit skills check` and each
card's follow-up status. Prints feature, check, result, time; exits 1 on any failure.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["add_parser", "FEATURE_TESTS", "feature_of"]

# Test file -> feature slug (the first matching pattern wins).
FEATURE_TESTS: list[tuple[str, str]] = [
    ("tests/test_attention*", "context-parallel-attention"),
    ("tests/test_sharding*", "context-parallel-attention"),
    ("functional/test_attention*", "context-parallel-attention"),
    ("functional/test_gpt*", "context-parallel-attention"),
    ("functional/test_te_backend*", "te-backend"),
    ("*hierarchical*", "hierarchical-context-parallel"),
    ("*eval_cp*", "eval-context-parallel"),
    ("*eval_plan*", "eval-context-parallel"),
    ("*dynamic*", "dynamic-context-parallel"),
    ("*schedule*", "dynamic-context-parallel"),
    ("*cards*", "cards-and-skills"),
    ("*skills*", "cards-and-skills"),
]
LEVEL_ORDER = {"unit": 0, "dist": 1, "gpu2": 2, "gpu4": 3}


def feature_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    for pattern, feature in FEATURE_TESTS:
        if fnmatch.fnmatch(path, pattern):
            return feature
    return "foundation"


def _repo_root() -> Path:
    here = Path.cwd()
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").exists() and (candidate / "src" / "cpkit").exists():
            return candidate
    return Path(__file__).resolve().parents[3]


def _run_pytest(root: Path, paths: list[str], extra: list[str]) -> tuple[int, list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        env = dict(os.environ, CPKIT_TEST_REPORT=report)
        cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "cpkit.testing.report_plugin",
               "-p", "no:cacheprovider", *extra]
        rc = subprocess.call(cmd, cwd=root, env=env)
        records = []
        if os.path.exists(report):
            with open(report) as fh:
                records = [json.loads(line) for line in fh if line.strip()]
        levels = {}
        if os.path.exists(report + ".levels"):
            with open(report + ".levels") as fh:
                levels = json.load(fh)
    return rc, records, levels


def _summarise(records: list[dict], levels: dict, rc: int = 0) -> list[dict]:
    rows: dict[tuple[str, str], dict] = {}
    finished = {rec["nodeid"] for rec in records if rec["outcome"] != "started"}
    unfinished = list(dict.fromkeys(rec["nodeid"] for rec in records
                                    if rec["outcome"] == "started" and rec["nodeid"] not in finished))
    # A test that started and never reported took the pytest process down (or was running
    # when it was killed): it failed, and it is the one to name.
    records = [rec for rec in records if rec["outcome"] != "started"] + [
        {"nodeid": n, "outcome": "failed", "seconds": 0.0,
         "reason": f"pytest stopped (exit code {rc}) while this test ran"} for n in unfinished]
    for rec in records:
        level = levels.get(rec["nodeid"], "unit")
        key = (feature_of(rec["nodeid"]), level)
        row = rows.setdefault(key, {"feature": key[0], "check": f"{level} tests", "passed": 0,
                                    "failed": 0, "skipped": 0, "seconds": 0.0, "reasons": set(),
                                    "failures": []})
        row[rec["outcome"]] += 1
        row["seconds"] += rec["seconds"]
        if rec["outcome"] == "skipped" and rec["reason"]:
            row["reasons"].add(rec["reason"])
        if rec["outcome"] == "failed":
            row["failures"].append(rec["nodeid"] + (f" ({rec['reason']})" if rec["nodeid"] in unfinished else ""))
    out = []
    for (feature, level), row in sorted(rows.items(), key=lambda kv: (kv[0][0], LEVEL_ORDER[kv[0][1]])):
        if row["failed"]:
            result = f"fail ({row['failed']} failed, {row['passed']} passed)"
        elif row["passed"]:
            result = f"pass ({row['passed']} passed" + (f", {row['skipped']} skipped)" if row["skipped"] else ")")
        else:
            # The first clause of each reason keeps the table readable; --json has the rest.
            reasons = sorted({r.split(" (")[0].split(";")[0] for r in row["reasons"]}) or ["no test ran"]
            result = "skipped: " + "; ".join(reasons)
        out.append({"feature": feature, "check": row["check"], "result": result,
                    "ok": not row["failed"], "seconds": round(row["seconds"], 1),
                    "failures": row["failures"], "skip_reasons": sorted(row["reasons"])})
    return out


def _check_rows(root: Path) -> list[dict]:
    rows = []
    for name, module, func in (("cards check", "cpkit.cards", "check_cards"),
                               ("skills check", "cpkit.skills", "check_skills")):
        start = time.perf_counter()
        try:
            mod = __import__(module, fromlist=[func])
            problems = getattr(mod, func)(root)
        except Exception as exc:  # noqa: BLE001 - a broken checker is a failed check
            problems = [f"{name} crashed: {exc!r}"]
        rows.append({"feature": "cards-and-skills", "check": f"cpkit {name}",
                     "result": "pass" if not problems else f"fail ({len(problems)} problems)",
                     "ok": not problems, "seconds": round(time.perf_counter() - start, 1),
                     "failures": problems})
    return rows


def _card_rows(root: Path) -> list[dict]:
    try:
        from cpkit.cards import card_status

        status = card_status(root)
    except Exception as exc:  # noqa: BLE001
        return [{"feature": "cards-and-skills", "check": "card status", "result": f"fail ({exc!r})",
                 "ok": False, "seconds": 0.0, "failures": [repr(exc)]}]
    rows = {}
    for item in status:
        feature = item.get("feature", "?")
        row = rows.setdefault(feature, {"covered": 0, "open": 0})
        row["covered" if item.get("status") == "covered" else "open"] += 1
    return [{"feature": f, "check": "card follow-ups", "ok": True, "seconds": 0.0, "failures": [],
             "result": f"{r['covered']} covered, {r['open']} open"} for f, r in sorted(rows.items())]


def _print_table(rows: list[dict]) -> None:
    headers = ("feature", "check", "result", "time")
    table = [(r["feature"], r["check"], r["result"], f"{r['seconds']:.1f}s") for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)] if table else []
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    for r in rows:
        for f in r["failures"][:20]:
            print(f"FAILED [{r['feature']} / {r['check']}] {f}")


def run(args) -> int:
    root = _repo_root()
    extra = ["-m", args.markers] if args.markers else []
    if args.pytest_args:
        extra += args.pytest_args.split()
    start = time.perf_counter()
    rc, records, levels = _run_pytest(root, ["tests", "functional"], extra)
    rows = _summarise(records, levels, rc)
    if rc not in (0, 1, 5) or (rc == 1 and not any(not r["ok"] for r in rows)):
        rows.append({"feature": "foundation", "check": "pytest run", "ok": False, "seconds": 0.0,
                     "result": f"fail (pytest exit code {rc})", "failures": []})
    rows += _check_rows(root) + _card_rows(root)
    print()
    _print_table(rows)
    ok = all(r["ok"] for r in rows)
    print(f"\ncpkit validate: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - start:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"ok": ok, "rows": rows}, indent=2))
        print(f"report written to {args.json}")
    return 0 if ok else 1


def add_parser(sub):
    p = sub.add_parser("validate", help="run every check that fits this machine; one table per feature",
                       description=__doc__)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("-m", "--markers", default="",
                   help='pytest marker expression, e.g. "not dist" (default: everything; GPU tests '
                        "skip where GPUs are missing)")
    p.add_argument("--pytest-args", default="", help="extra arguments passed to pytest (quoted)")
    p.set_defaults(func=run)
