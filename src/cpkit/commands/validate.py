"""`cpkit validate [--changed [BASE] [--wide]] [--record-map]`: run what fits this machine and print one table per feature.

Without --changed: the unit tests, the `dist` tests (gloo) and the gpu1/gpu2/gpu4 tests where
enough CUDA devices are present, in one pytest process. With --changed: only the tests that
cover the paths changed since BASE (default: the merge base with main; on main itself, or
without main, HEAD when there are uncommitted changes, else HEAD~1; uncommitted and untracked
files included), chosen by src/cpkit/validation/changed_selection.py::select_changed: a change inside
the bodies of functions the measured coverage map covers runs exactly the tests (node ids) that
ran them, rank processes included; any other change of a module (module or class level, a
signature, a new, deleted or unmeasured function) adds src/cpkit/validation/change_map.py::CHANGE_MAP's
rows and the tests that use a changed function or class through its own package (with --wide:
every test that imports the module). What changed since
the map was measured (from the hashes it stores) widens the selection, so an older map selects
more; only a missing or unreadable map runs everything. Where git's history cannot give the
base (no .git, a shallow clone without the map's commit or a parent), --changed with no BASE
takes the change since the map from its per-function hashes (src/cpkit/validation/change_base.py);
the report names the base it used. The report names the map's commit and its drift, the
`dist` (gloo) tests run and the GPU tests the change makes stale. --record-map measures the
full run itself (one pytest process, ranks included) and writes the coverage map from it: the
table and a fresh map from one run. Then
`cpkit cards check`, `cpkit skills check` and each card's follow-up status. Prints feature,
check, result, time, the GPU tests still owed; exits 1 on any failure.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import sys
import time
from pathlib import Path

from cpkit.commands import repo_root
from cpkit.validation.change_base import change_base, changed_lines, changed_paths  # noqa: F401 - re-exported
from cpkit.validation.changed_selection import select_changed
from cpkit.validation.coverage_record import map_recording
from cpkit.validation.pytest_runner import run_pytest

__all__ = ["add_parser", "run", "FEATURE_TESTS", "feature_of", "changed_paths", "changed_lines", "gpu_owed"]

# Test file -> feature slug (the first matching pattern wins).
FEATURE_TESTS: list[tuple[str, str]] = [
    ("tests/test_attention*", "context-parallel-attention"),
    ("tests/test_sharding*", "context-parallel-attention"),
    ("functional/test_attention*", "context-parallel-attention"),
    ("functional/test_gpt*", "context-parallel-attention"),
    ("functional/test_loss_matrix_dynamic*", "dynamic-context-parallel"),
    ("functional/test_loss_matrix*", "context-parallel-attention"),
    ("functional/test_te_backend*", "te-backend"),
    ("*mcore_hybrid_cp*", "dynamic-context-parallel"),  # MCore's "hybrid CP" is its dynamic CP
    ("*hybrid*", "hybrid-context-parallel"),
    ("*gdn*", "hybrid-context-parallel"),
    ("*hierarchical*", "hierarchical-context-parallel"),
    ("*eval_cp*", "eval-context-parallel"),
    ("*eval_plan*", "eval-context-parallel"),
    ("*dynamic*", "dynamic-context-parallel"),
    ("*schedule*", "dynamic-context-parallel"),
    ("*cards*", "cards-and-skills"),
    ("*skills*", "cards-and-skills"),
]
LEVEL_ORDER = {"unit": 0, "dist": 1, "gpu1": 2, "gpu2": 3, "gpu4": 4}
GPU_LEVELS = ("gpu1", "gpu2", "gpu4")


def feature_of(nodeid: str) -> str:
    """The feature a test belongs to, by its file (FEATURE_TESTS); "foundation" otherwise."""
    path = nodeid.split("::", 1)[0]
    for pattern, feature in FEATURE_TESTS:
        if fnmatch.fnmatch(path, pattern):
            return feature
    return "foundation"


def _summarise(records: list[dict], levels: dict) -> list[dict]:
    rows: dict[tuple[str, str], dict] = {}
    for rec in records:
        level = levels.get(rec["nodeid"], "unit")
        key = (feature_of(rec["nodeid"]), level)
        row = rows.setdefault(key, {"feature": key[0], "check": f"{level} tests", "passed": 0,
                                    "failed": 0, "skipped": 0, "xfailed": 0, "xpassed": 0, "seconds": 0.0,
                                    "reasons": set(), "failures": []})
        row[rec["outcome"]] += 1
        row["seconds"] += rec["seconds"]
        if rec["outcome"] == "skipped" and rec["reason"]:
            row["reasons"].add(rec["reason"])
        if rec["outcome"] == "failed":
            row["failures"].append(rec["nodeid"] + (f" ({rec['reason']})" if rec.get("unfinished") else ""))
    out = []
    for (feature, level), row in sorted(rows.items(), key=lambda kv: (kv[0][0], LEVEL_ORDER[kv[0][1]])):
        if row["failed"]:
            result = f"fail ({row['failed']} failed, {row['passed']} passed)"
        elif row["passed"] or row["xfailed"] or row["xpassed"]:
            counts = [f"{row[k]} {k}" for k in ("passed", "xfailed", "xpassed", "skipped") if row[k]]
            result = f"pass ({', '.join(counts)})"
        else:
            # The first clause of each reason keeps the table readable; --json has the rest.
            reasons = sorted({r.split(" (")[0].split(";")[0] for r in row["reasons"]}) or ["no test ran"]
            result = "skipped: " + "; ".join(reasons)
        out.append({"feature": feature, "check": row["check"], "result": result,
                    "ok": not row["failed"], "seconds": round(row["seconds"], 1),
                    "failures": row["failures"], "skip_reasons": sorted(row["reasons"])})
    return out


def gpu_owed(records: list[dict], levels: dict) -> dict[str, dict[str, int]]:
    """GPU level -> test file -> how many of its tests at that level did not run here (skipped)."""
    owed: dict[str, dict[str, int]] = {}
    for rec in records:
        level = levels.get(rec["nodeid"], "unit")
        if level in GPU_LEVELS and rec["outcome"] == "skipped":
            files = owed.setdefault(level, {})
            file = rec["nodeid"].split("::")[0]
            files[file] = files.get(file, 0) + 1
    return {level: owed[level] for level in GPU_LEVELS if level in owed}


def _check_rows(root: Path, parser, collect_node_ids: bool = True) -> list[dict]:
    from cpkit.cards import check_cards
    from cpkit.cards.check import collect_node_ids as collector
    from cpkit.skills import check_skills

    def cards(r: Path) -> list[str]:
        return check_cards(r, collect=collector if collect_node_ids else None)

    rows = []
    for name, check in (("cards check", cards), ("skills check", lambda r: check_skills(r, parser))):
        start = time.perf_counter()
        try:
            problems = check(root)
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
        row = rows.setdefault(feature, {"covered": 0, "open": 0, "stale": [], "unknown": [], "failed": []})
        row["covered" if item.get("status") == "covered" else "open"] += 1
        last, fresh = item.get("last_result"), item.get("freshness") or {}
        if last and last["outcome"] != "passed":
            row["failed"].append(item["id"])
        if last and fresh.get("state") in ("stale", "unknown"):
            changed = fresh.get("changed") or []
            named = ": " + ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            row[fresh["state"]].append(f"{item['id']} ({fresh['why']}{named if changed else ''})")
    out = []
    for f, r in sorted(rows.items()):
        # The claim (covered/open) apart from what the last recorded results say now.
        measured = ", ".join(f"{len(r[k])} {k}" for k in ("stale", "unknown", "failed") if r[k])
        out.append({"feature": f, "check": "card follow-ups", "ok": True, "seconds": 0.0, "failures": [],
                    "result": f"claims {r['covered']} covered, {r['open']} open"
                              + (f"; last results: {measured}" if measured else ""),
                    "notes": [f"last result stale: {s}" for s in r["stale"]]
                             + [f"last result staleness unknown: {s}" for s in r["unknown"]]
                             + [f"last result not passed: {s}" for s in r["failed"]]})
    return out


def _print_table(rows: list[dict], out) -> None:
    headers = ("feature", "check", "result", "time")
    table = [(r["feature"], r["check"], r["result"], f"{r['seconds']:.1f}s") for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)] if table else []
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line, file=out)
    print("-" * len(line), file=out)
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip(), file=out)
    for r in rows:
        for f in r["failures"][:20]:
            print(f"FAILED [{r['feature']} / {r['check']}] {f}", file=out)
    for r in rows:
        for note in r.get("notes", ())[:20]:
            print(f"[{r['feature']}] {note}", file=out)


def _print_tiers(changed: dict, dist_run: list[str], out) -> None:
    """The multi-rank part of a --changed run: the dist cases it ran, the GPU tests it made stale."""
    files = sorted({n.split("::")[0] for n in dist_run})
    if dist_run:
        print(f"dist (gloo) tests run: {len(dist_run)} in {', '.join(files)}", file=out)
    stale = changed.get("gpu_stale") or {}
    for level, tests in stale.items():
        print(f"stale on GPUs ({level}), run them on a GPU machine: {', '.join(tests)}", file=out)
    if stale:
        every = sorted({t for tests in stale.values() for t in tests})
        print(f"  python -m pytest -m \"{' or '.join(stale)}\" {' '.join(every)}", file=out)


def run(args) -> int:
    """Run the checks; print the table (or JSON with `--json -`); 0 when all hold, else 1."""
    root = repo_root(getattr(args, "root", None))
    to_stdout = args.json == "-"
    out = sys.stderr if to_stdout else sys.stdout
    record = getattr(args, "record_map", False)
    if record and (args.changed is not None or args.markers or args.pytest_args):
        print("cpkit validate: --record-map measures the whole suite, so it takes no --changed, -m or "
              "--pytest-args; run `cpkit validate --record-map` alone", file=sys.stderr)
        return 2
    with map_recording(root) if record else contextlib.nullcontext() as recording:
        return _run(args, root, out, to_stdout, recording)


def _run(args, root: Path, out, to_stdout: bool, recording) -> int:
    """`run` with its arguments checked; `recording`: a MapRecording (--record-map) or None."""
    extra = ["-m", args.markers] if args.markers else []
    if args.pytest_args:
        extra += args.pytest_args.split()
    start = time.perf_counter()
    report: dict = {"changed": None}
    paths = ["tests", "functional"]
    node_ids: list[str] = []
    if args.changed is not None:
        try:
            found = change_base(root, args.changed or None)
        except ValueError as exc:
            print(f"cpkit validate: {exc}", file=sys.stderr)
            return 2
        base, changed, lines = found.base, found.paths, found.lines
        modules = list(lines)
        selection = select_changed(root, base, changed, lines, wide=args.wide)
        report["changed"] = {"base": base, "base_source": found.source, "base_why": found.why, "paths": changed,
                             **selection.to_dict()}
        paths = [p for p in selection.files if (root / p).exists()]
        node_ids = selection.node_ids
        report["changed"]["run"] = paths
        report["changed"]["run_node_ids"] = node_ids
        if modules:
            print(f"cpkit validate --changed: coverage map {selection.map_state}"
                  + (": running everything" if selection.everything else ""), file=out)
        files_of_nodes = sorted({n.split("::", 1)[0] for n in node_ids})
        running = ", ".join(paths) + ("; " if paths and node_ids else "") + (
            f"{len(node_ids)} tests of {', '.join(files_of_nodes)}" if node_ids else "")
        print(f"changed since {base[:12]} (base: {found.describe()}): {len(changed)} paths; running "
              f"{running or 'no tests'}", file=out)
    rows: list[dict] = []
    owed: dict = {}
    dist_run: list[str] = []
    if paths or node_ids:
        # "-v" cancels BASE_FLAGS' "-q": pytest's default verbosity names each test file as it runs.
        measured = recording.pytest_args if recording else []
        run_ = run_pytest(root, ["-v", *measured, *paths, *extra], output="stderr" if to_stdout else "inherit",
                          node_ids=node_ids, env=recording.env if recording else None)
        if recording:
            recording.write(run_, time.perf_counter() - start, paths, out)
        if run_.missing:
            print(f"left out {len(run_.missing)} selected tests the suite no longer has (renamed or removed since "
                  f"the coverage map): {', '.join(run_.missing[:5])}" + (" ..." if len(run_.missing) > 5 else ""),
                  file=out)
            report["changed"]["missing_node_ids"] = run_.missing
        rows = _summarise(run_.records, run_.levels)
        owed = gpu_owed(run_.records, run_.levels)
        dist_run = [r["nodeid"] for r in run_.records if run_.levels.get(r["nodeid"]) == "dist"
                    and r["outcome"] != "skipped"]
        rc = run_.exit_code
        if rc not in (0, 1, 5) or (rc == 1 and all(r["ok"] for r in rows)):
            rows.append({"feature": "foundation", "check": "pytest run", "ok": False, "seconds": 0.0,
                         "result": f"fail (pytest exit code {rc})", "failures": []})
    # Covering node ids can only go stale when a test file or a card changed: otherwise the
    # cards check skips its pytest collection (about half a minute of imports on 2 cores).
    collect = args.changed is None or any(p.startswith(("tests/", "functional/", "cards/", "pyproject"))
                                          for p in report["changed"]["paths"])
    rows += _check_rows(root, args.cli_parser, collect) + _card_rows(root)
    ok = all(r["ok"] for r in rows)
    seconds = time.perf_counter() - start
    report.update({"ok": ok, "seconds": round(seconds, 1), "rows": rows, "gpu_owed": owed, "dist_run": dist_run})
    print(file=out)
    _print_table(rows, out)
    for level, files in owed.items():
        listed = ", ".join(f"{file} ({n})" for file, n in files.items())
        print(f"needs {level}: {listed}", file=out)
    if args.changed is not None:
        _print_tiers(report["changed"], dist_run, out)
    print(f"\ncpkit validate: {'PASS' if ok else 'FAIL'} in {seconds:.0f}s"
          + (" (GPU tests owed above)" if owed else ""), file=out)
    if to_stdout:
        print(json.dumps(report, indent=2))
    elif args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"report written to {args.json}", file=out)
    return 0 if ok else 1


def add_parser(sub):
    """Register `cpkit validate`."""
    p = sub.add_parser("validate", allow_abbrev=False, help="run the tests and checks that fit this machine (or cover a change)",
                       description=__doc__)
    p.add_argument("--changed", nargs="?", const="", default=None, metavar="BASE",
                   help="only the tests that cover paths changed since BASE (default: merge base with main; on "
                        "main, HEAD with uncommitted changes, else HEAD~1), uncommitted changes included")
    p.add_argument("--wide", action="store_true",
                   help="with --changed: every test that imports a changed module, directly or through "
                        "other cpkit modules (default: the tests that use a changed function or class "
                        "through its own package)")
    p.add_argument("--record-map", action="store_true",
                   help="measure the full run: which tests run which function (rank processes included), "
                        "written to evidence/coverage-map.json, which --changed selects by (one pytest "
                        "process, no xdist)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH, or to stdout when PATH is left out")
    p.add_argument("-m", "--markers", default="",
                   help='pytest marker expression, e.g. "not dist" (default: everything; GPU tests '
                        "skip where GPUs are missing)")
    p.add_argument("--pytest-args", default="", help="extra arguments passed to pytest (quoted)")
    p.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    p.set_defaults(func=run)
