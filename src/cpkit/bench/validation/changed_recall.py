"""`python -m cpkit.bench changed_recall`: does `cpkit validate --changed` catch every fault the
full validation catches? Measured over seeded mutants of src/cpkit (src/cpkit/validation/mutants.py).

For each mutant (a minimal text edit, `mutation.mutant_source`) in a scratch worktree of HEAD:
1. `cpkit validate --changed HEAD --pytest-args=-x` with the mutant as the only change: its
   verdict and time. pytest stops at the first failure, so a caught mutant's time is the time to
   its verdict (a mutant that hangs a ring costs one case's deadline, not every selected case's)
   and a survivor's time is its whole selection's, as a correct change would cost.
2. The full validation's verdict, computed soundly but cheaper than one full run per mutant:
   - --changed caught it: the full run, a superset of the same tests and checks, does too;
   - otherwise a test outside the --changed run can only catch it by executing the mutated
     code. One full pytest run with a probe at every surviving mutant's site (the site's
     expression or statement wrapped in a call that records the running test, in the pytest
     process and in every rank it spawns, behaviour unchanged) finds the tests (node ids) that
     reach each site. This is measured afresh, by another mechanism than the coverage map under test.
   - a survivor whose site some test outside its selection reaches (a file --changed did not
     run, or a node id of a file it ran only some tests of) is then run, mutated, on those tests
     (`pytest -x`): a failure there is a miss of --changed.
Recall = caught by --changed / caught by the full validation. Precision: the share of the
suite's collected tests each selection ran (`selected_share`: the tests of the whole files it
ran plus the node ids it ran singly, those the suite still has), with its median and worst case
over the mutants. Time ratio = a mutant's --changed
time / the probe run's time (the whole suite in one process, as `cpkit validate` runs it; its
cards and skills checks are left out, so the ratio is slightly high).

The log (one JSON line per mutant and stage) makes the bench resumable: run it again with the
same --log to go on where it stopped (--budget-s caps one sitting). Writes the table and a JSON
report (sample, seed, per-mutant outcomes, machine, commit).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpkit.validation.coverage_map import TEST_FOLDERS
from cpkit.validation.mutants import Mutant, find_mutants, mutant_source

__all__ = ["FOCUS", "sample_mutants", "probe_source", "selected_share", "main"]

#: Code reached mostly through scenarios and ranks: half the sample comes from here.
FOCUS = ("src/cpkit/eval_cp/rebind.py", "src/cpkit/eval_cp/loop.py", "src/cpkit/eval_cp/context.py", "src/cpkit/dynamic/runtime.py",
         "src/cpkit/loss.py", "src/cpkit/harness/launch.py", "src/cpkit/attention/p2p.py", "src/cpkit/attention/a2a.py",
         "src/cpkit/attention/all_gather.py", "src/cpkit/attention/hierarchical.py", "src/cpkit/parallel/groups.py")
_PROBE_ENV = "CPKIT_RECALL_PROBE"
#: Prints the --changed selection of the tree in the current directory against HEAD (as JSON).
_SELECTION = """
import json
from pathlib import Path
from cpkit.commands.validate import changed_lines, changed_paths
from cpkit.validation.changed_selection import select_changed
root = Path.cwd()
base, changed = changed_paths(root, "HEAD")
lines = {p: changed_lines(root, base, p) for p in changed if p.startswith("src/cpkit/") and p.endswith(".py")}
print(json.dumps(select_changed(root, base, changed, lines).to_dict()))
"""
_PROBE_MODULE = "cpkit_recall_probe"
_OUTER_ENV = "CPKIT_RECALL_OUTER"
_PROBE_SOURCE = f'''"""Records which test reaches a probed mutation site (cpkit.bench.validation.changed_recall).
Also the probe run's pytest plugin: a pytest run that a suite test starts (in a scratch folder)
names its own tests, so what it reaches is credited to the suite test that started it."""
import os

_seen = set()


def pytest_runtest_setup(item):
    os.environ["{_OUTER_ENV}"] = item.nodeid  # inherited by the pytest runs this test starts


def hit(site):
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    if not test.startswith(("tests/", "functional/")):  # a nested run's test, or none
        test = os.environ.get("{_OUTER_ENV}", test)
    if (site, test) not in _seen:
        _seen.add((site, test))
        with open(os.environ["{_PROBE_ENV}"], "a") as fh:
            fh.write(f"{{site}}\\t{{test}}\\n")
    return None
'''


def _free_site(root: Path, path: str, sources: dict, taken: dict) -> bool:
    """Whether `path` has a mutant site that overlaps no site taken so far."""
    source = sources.setdefault(path, (root / path).read_text())
    spans = taken.get(path, [])
    return any(not any(a < end and start < b for a, b in spans)
               for start, end, _ in (_segment(source, m) for m in find_mutants(source)))


def _segment(source: str, mutant: Mutant) -> tuple[int, int, bool]:
    """(start, end) byte offsets of the mutated node, and whether it is an expression."""
    from cpkit.validation.mutants import _Sites  # the walk that numbers sites

    sites = _Sites(target=mutant.index)
    sites.visit(ast.parse(source))
    node = sites.hit
    starts = [0]
    for line in source.encode().splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return (starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset,
            isinstance(node, ast.expr))


def probe_source(source: str, probes: list[tuple[int, Mutant]]) -> str | None:
    """`source` with a behaviour-preserving probe at each (site id, mutant): an expression
    becomes `(hit(id) or (expr))`, a statement `hit(id); statement`. None when it does not parse."""
    data = source.encode()
    edits = sorted(((*_segment(source, m), sid) for sid, m in probes), reverse=True)
    for start, end, is_expr, sid in edits:
        call = f"__import__('{_PROBE_MODULE}').hit({sid})".encode()
        piece = data[start:end]
        data = data[:start] + (b"(" + call + b" or (" + piece + b"))" if is_expr else call + b"; " + piece) + data[end:]
    text = data.decode()
    try:
        ast.parse(text)
    except SyntaxError:
        return None
    return text


def sample_mutants(root: Path, count: int, seed: int) -> list[dict]:
    """`count` mutants, half from FOCUS modules in turn and half from all of src/cpkit (a module
    at random), a site at random in each; each faithful as a minimal edit, no two overlapping."""
    rng = random.Random(seed)
    every = sorted(p.relative_to(root).as_posix() for p in (root / "src/cpkit").rglob("*.py")
                   if "__pycache__" not in p.parts)
    focus = [p for p in FOCUS if p in every]
    sources: dict[str, str] = {}
    taken: dict[str, list[tuple[int, int]]] = {}  # path -> byte spans of sampled sites
    out: list[dict] = []
    tries = 0
    while len(out) < count and tries < 50 * count:
        tries += 1
        # Focus modules in turn (each gets its share), the rest at random across src/cpkit. A
        # focus module whose every site is taken drops out (it stalled the sample before).
        open_focus = [p for p in focus if _free_site(root, p, sources, taken)]
        path = (open_focus[(len(out) // 2) % len(open_focus)] if len(out) % 2 == 0 and open_focus
                else rng.choice(every))
        source = sources.setdefault(path, (root / path).read_text())
        mutants = find_mutants(source)
        if not mutants:
            continue
        mutant = rng.choice(mutants)
        start, end, _ = _segment(source, mutant)
        spans = taken.setdefault(path, [])
        # Non-overlapping sites, so that one probe run can probe every survivor at once.
        if any(start < b and a < end for a, b in spans) or mutant_source(source, mutant) is None:
            continue
        spans.append((start, end))
        out.append({"path": path, "mutant": mutant, "id": f"{path}:{mutant.key}",
                    "focus": path in focus})
    return out


def _sh(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _probe_dir(scratch: Path) -> Path:
    return scratch.parent / "probe"  # outside the tree: an untracked file would be a change


def _env(scratch: Path, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(scratch / "src"), str(_probe_dir(scratch))]))
    env.update(extra)
    return env


def _reset(scratch: Path) -> None:
    _sh(["git", "checkout", "-q", "--", "src"], scratch)


def _changed_stage(scratch: Path, item: dict, timeout: float) -> dict:
    _reset(scratch)
    target = scratch / item["path"]
    target.write_text(mutant_source(target.read_text(), item["mutant"]))
    report = _probe_dir(scratch) / "report.json"
    start = time.perf_counter()
    selection = _sh([sys.executable, "-c", _SELECTION], scratch, _env(scratch))
    if selection.returncode == 0 and json.loads(selection.stdout.splitlines()[-1])["everything"]:
        # --changed runs the full validation itself: the same verdict by construction. Not
        # run here (a full suite per mutant); counted at the full run's time (ratio 1).
        _reset(scratch)
        return {"stage": "changed", "id": item["id"], "caught": None, "everything": True, "exit": None,
                "seconds": None, "run": ["tests", "functional"],
                "reasons": json.loads(selection.stdout.splitlines()[-1])["reasons"]}
    try:
        proc = _sh([sys.executable, "-m", "cpkit.cli", "validate", "--changed", "HEAD", "--root", str(scratch),
                    "--json", str(report), "--pytest-args=-x"], scratch, _env(scratch), timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    seconds = time.perf_counter() - start
    data = json.loads(report.read_text()) if report.exists() else {}
    report.unlink(missing_ok=True)
    changed = data.get("changed") or {}
    _reset(scratch)
    return {"stage": "changed", "id": item["id"], "caught": code != 0, "exit": code, "seconds": round(seconds, 1),
            "run": changed.get("run", []), "node_ids": changed.get("run_node_ids", []),
            "missing_node_ids": changed.get("missing_node_ids", []), "everything": changed.get("everything"),
            "coverage_map": changed.get("coverage_map"),
            "failures": [f for r in data.get("rows", []) for f in r.get("failures", [])][:5]}


def _suite_stage(scratch: Path, timeout: float) -> dict:
    """Tests per test file of the unmutated tree (`pytest --collect-only`): what a selection of
    files amounts to as a share of the suite's tests."""
    proc = _sh([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests",
                "functional"], scratch, _env(scratch), timeout)
    per_file: dict[str, int] = {}
    nodeids = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        per_file[path] = per_file.get(path, 0) + 1
    return {"stage": "suite", "tests_per_file": per_file, "tests": sum(per_file.values()), "nodeids": nodeids}


def _in_files(test: str, run: list[str]) -> bool:
    """Whether test (a node id or a file) is in one of the files or folders `run` names."""
    path = test.split("::", 1)[0]
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in run)


def selected_share(run: list[str], tests_per_file: dict[str, int], node_ids: list[str] = (),
                   suite: list[str] | None = None) -> float | None:
    """The share of the suite's tests a selection ran: those of the files (or folders) `run`
    names, plus the `node_ids` it ran singly (of other files; only those in `suite`, the
    collected node ids, where given). None without counts."""
    total = sum(tests_per_file.values())
    if not total:
        return None
    picked = sum(n for f, n in tests_per_file.items() if _in_files(f, run))
    known = None if suite is None else set(suite)
    picked += len({n for n in node_ids if not _in_files(n, run) and (known is None or n in known)})
    return round(picked / total, 4)


def _outside(reaching: list[str], changed: dict) -> list[str]:
    """The suite's tests (node ids, or files in logs before node ids) of `reaching` that the
    --changed run did not run: not in a file it ran whole, nor among its single node ids."""
    singles = set(changed.get("node_ids") or ())
    suite = tuple(f"{folder}/" for folder in TEST_FOLDERS)
    return [t for t in reaching if t.startswith(suite) and not _in_files(t, changed["run"]) and t not in singles]


def _probe_stage(scratch: Path, survivors: list[dict], timeout: float) -> dict:
    """One full pytest run with every survivor's site probed: site id -> tests (node ids) reaching it."""
    _reset(scratch)
    by_path: dict[str, list[tuple[int, Mutant]]] = {}
    for sid, item in enumerate(survivors):
        by_path.setdefault(item["path"], []).append((sid, item["mutant"]))
    unprobed = []
    for path, probes in by_path.items():
        text = probe_source((scratch / path).read_text(), probes)
        if text is None:
            unprobed += [survivors[sid]["id"] for sid, _ in probes]
            continue
        (scratch / path).write_text(text)
    hits = _probe_dir(scratch) / "hits.tsv"
    hits.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = _sh([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
                "-p", _PROBE_MODULE, "tests", "functional"], scratch, _env(scratch, **{_PROBE_ENV: str(hits)}), timeout)
    seconds = time.perf_counter() - start
    _reset(scratch)
    reach: dict[str, set[str]] = {}
    if hits.exists():
        for line in hits.read_text().splitlines():
            sid, _, test = line.partition("\t")
            reach.setdefault(survivors[int(sid)]["id"], set()).add(test or "(outside a test)")
    return {"stage": "probe", "seconds": round(seconds, 1), "exit": proc.returncode,
            "summary": proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else [],
            "reach": {k: sorted(v) for k, v in reach.items()}, "unprobed": unprobed,
            "ids": [s["id"] for s in survivors]}


def _complement_stage(scratch: Path, item: dict, files: list[str], timeout: float) -> dict:
    """Run the mutant on `files`: test files, folders or node ids (run singly, through
    cpkit.validation.pytest_runner's filter: a node id the suite lacks is no error)."""
    from cpkit.validation.pytest_runner import NODE_IDS_ENV

    _reset(scratch)
    target = scratch / item["path"]
    target.write_text(mutant_source(target.read_text(), item["mutant"]))
    nodes = [f for f in files if "::" in f]
    paths = [f for f in files if "::" not in f] + list(dict.fromkeys(n.split("::", 1)[0] for n in nodes))
    extra: dict[str, str] = {}
    if nodes:
        extra[NODE_IDS_ENV] = str(_probe_dir(scratch) / "node_ids.json")
        Path(extra[NODE_IDS_ENV]).write_text(json.dumps(nodes))
        paths = ["-p", "cpkit.validation.pytest_runner", *paths]
    start = time.perf_counter()
    try:
        proc = _sh([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                    "-p", "no:randomly", *paths], scratch, _env(scratch, **extra), timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    _reset(scratch)
    # A failed test or a hang is a catch; pytest's usage and internal errors (2-4) decide nothing.
    return {"stage": "complement", "id": item["id"], "files": files, "exit": code,
            "caught": None if code in (2, 3, 4) else code not in (0, 5), "seconds": round(time.perf_counter() - start, 1)}


def _summarise(items: list[dict], log: dict, full_seconds: float | None) -> tuple[list[dict], dict]:
    probe = log.get(("probe", None))
    counts = (log.get(("suite", None)) or {}).get("tests_per_file", {})
    suite_nodes = (log.get(("suite", None)) or {}).get("nodeids")
    rows = []
    for item in items:
        ch = log.get(("changed", item["id"]))
        comp = log.get(("complement", item["id"]))
        full = None
        if ch is not None and ch.get("everything") and ch["caught"] is None:
            full = "same run"  # --changed selected everything: it is the full validation
        elif ch is not None and ch["caught"]:
            full = True
        elif ch is not None and probe is not None and item["id"] in probe.get("ids", []):
            outside = _outside(probe["reach"].get(item["id"], []), ch)
            if item["id"] in probe["unprobed"] or outside:
                full = None if comp is None else comp["caught"]
            else:
                full = False  # no test outside the --changed run executes the mutated code
        ratio = None
        if ch is not None and full_seconds:
            ratio = 1.0 if ch["seconds"] is None else round(ch["seconds"] / full_seconds, 3)
        rows.append({"id": item["id"], "focus": item["focus"], "changed": None if ch is None else ch["caught"],
                     "full": full, "changed_s": None if ch is None else ch["seconds"], "time_ratio": ratio,
                     "run_files": None if ch is None else len(ch["run"]),
                     "run_node_ids": None if ch is None else len(ch.get("node_ids") or ()),
                     "selected_share": None if ch is None else selected_share(ch["run"], counts, ch.get("node_ids") or (),
                                                                              suite_nodes),
                     "reaching_tests": None if probe is None else probe["reach"].get(item["id"])})
    decided = [r for r in rows if r["full"] in (True, False)]
    caught_full = [r for r in decided if r["full"]]
    caught_both = [r for r in caught_full if r["changed"]]
    ratios = [r["time_ratio"] for r in rows if r["time_ratio"] is not None]
    shares = [r for r in rows if r["selected_share"] is not None]
    worst = max(shares, key=lambda r: r["selected_share"], default=None)
    summary = {"mutants": len(items), "changed_run": sum(r["changed"] is not None for r in rows),
               "selected_everything": sum(r["full"] == "same run" for r in rows),
               "decided": len(decided), "undecided": [r["id"] for r in rows if r["full"] is None],
               "caught_by_full": len(caught_full), "caught_by_changed": len(caught_both),
               "recall": round(len(caught_both) / len(caught_full), 3) if caught_full else None,
               "misses": [r["id"] for r in caught_full if not r["changed"]],
               "full_s": full_seconds,
               "median_changed_s": statistics.median([r["changed_s"] for r in rows if r["changed_s"]] or [0]),
               # a survivor ran its whole selection: what --changed costs a change that breaks nothing
               "median_survivor_changed_s": statistics.median(
                   [r["changed_s"] for r in rows if r["changed_s"] and r["changed"] is False] or [0]),
               "median_time_ratio": statistics.median(ratios) if ratios else None,
               # precision: the share of the suite's tests each selection ran (1.0: everything)
               "median_selected_share": statistics.median([r["selected_share"] for r in shares]) if shares else None,
               "worst_selected_share": None if worst is None else worst["selected_share"],
               "worst_selected_mutant": None if worst is None else worst["id"],
               "worst_changed_s": max((r["changed_s"] for r in rows if r["changed_s"]), default=None),
               "median_time_ratio_excluding_everything": statistics.median(
                   [r["time_ratio"] for r in rows if r["time_ratio"] is not None and r["changed_s"] is not None] or [0])}
    return rows, summary


def _table(rows: list[dict]) -> str:
    head = ("mutant", "focus", "--changed", "full", "--changed s", "files run", "single tests", "share of tests")
    body = [(r["id"][-72:], "yes" if r["focus"] else "", _verdict(r["changed"]), _verdict(r["full"]),
             "-" if r["changed_s"] is None else f"{r['changed_s']:.0f}", str(r["run_files"] or "-"),
             str(r.get("run_node_ids") or "-"),
             "-" if r.get("selected_share") is None else f"{r['selected_share']:.1%}") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpkit.bench changed_recall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--sample", type=int, default=40)
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument("--log", type=Path, default=Path("bench-results/changed_recall.jsonl"),
                        help="one JSON line per mutant and stage; an existing log is resumed")
    parser.add_argument("--out", type=Path, default=Path("bench-results/changed_recall.json"))
    parser.add_argument("--budget-s", type=float, default=2400.0, help="stop starting new work after this long")
    parser.add_argument("--skip-probe", action="store_true", help="only the --changed stage (no full-suite run)")
    parser.add_argument("--only", action="append", metavar="ID", default=[],
                        help="run only these mutants of the sample (repeatable; an id as the table prints it), "
                             "e.g. to time the slowest again at a later commit")
    args = parser.parse_args(argv)
    root = Path.cwd().resolve()
    started = time.monotonic()
    commit = _sh(["git", "rev-parse", "HEAD"], root).stdout.strip()
    items = sample_mutants(root, args.sample, args.seed)
    if args.only:
        unknown = sorted(set(args.only) - {i["id"] for i in items})
        if unknown:
            parser.error(f"--only {unknown}: not in the sample of --sample {args.sample} --seed {args.seed} at this "
                         f"commit; pass ids as the table prints them, e.g. {items[0]['id']!r}")
        items = [i for i in items if i["id"] in args.only]
    log: dict = {}
    if args.log.exists():
        for line in args.log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("commit") == commit:
                log[(rec["stage"], rec.get("id"))] = rec
    args.log.parent.mkdir(parents=True, exist_ok=True)

    def keep(rec: dict) -> None:
        rec["commit"] = commit
        log[(rec["stage"], rec.get("id"))] = rec
        with args.log.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(json.dumps({k: rec[k] for k in rec if k not in ("reach", "run", "ids", "tests_per_file", "nodeids",
                                                              "node_ids")})[:300],
              flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    scratch = Path(tempfile.mkdtemp(prefix="cpkit-recall-")) / "tree"
    _sh(["git", "worktree", "add", "--detach", "-q", str(scratch), commit], root)
    try:
        _probe_dir(scratch).mkdir()
        (_probe_dir(scratch) / f"{_PROBE_MODULE}.py").write_text(_PROBE_SOURCE)
        if ("suite", None) not in log and left() > 0:
            keep(_suite_stage(scratch, timeout=max(60.0, left())))
        for item in items:
            if ("changed", item["id"]) not in log and left() > 0:
                keep(_changed_stage(scratch, item, timeout=max(60.0, left())))
        survivors = [i for i in items if ("changed", i["id"]) in log and log[("changed", i["id"])]["caught"] is False]
        probe = log.get(("probe", None))
        if not args.skip_probe and survivors and left() > 0 and (
                probe is None or set(probe["ids"]) != {s["id"] for s in survivors}):
            keep(_probe_stage(scratch, survivors, timeout=max(600.0, left())))
        probe = log.get(("probe", None))
        for item in survivors if probe else []:
            outside = _outside(probe["reach"].get(item["id"], []), log[("changed", item["id"])])
            if item["id"] in probe["unprobed"]:
                outside = ["tests", "functional"]
            if outside and ("complement", item["id"]) not in log and left() > 0:
                keep(_complement_stage(scratch, item, outside, timeout=max(60.0, left())))
    finally:
        _sh(["git", "worktree", "remove", "--force", str(scratch)], root)
        shutil.rmtree(scratch.parent, ignore_errors=True)
    probe = log.get(("probe", None))
    rows, summary = _summarise(items, log, probe["seconds"] if probe else None)
    from cpkit.bench.common import machine_info

    print(_table(rows))
    print(json.dumps(summary, indent=1))
    if summary["median_selected_share"] is not None:
        print(f"precision: --changed ran a median {summary['median_selected_share']:.1%} of the suite's tests, "
              f"worst {summary['worst_selected_share']:.1%} ({summary['worst_selected_mutant']})")
    report = {"bench": "changed_recall", "commit": commit, "seed": args.seed, "sample": [i["id"] for i in items],
              "machine": machine_info(), "summary": summary, "rows": rows,
              "full_reference": "probe run: pytest -n 0 tests functional with every survivor's site probed"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"report written to {args.out}")
    return 0 if not summary["misses"] else 1


def _verdict(value) -> str:
    if value is None or isinstance(value, str):
        return value or "-"
    return "caught" if value else "passed"


if __name__ == "__main__":
    sys.exit(main())
