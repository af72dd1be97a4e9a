"""The GPU proof's report (scripts/gpu-proof.sh): counts per tier from the junit files (the gpu1
tier's junit-gpu1.xml, the multi-GPU tier's junit.xml and junit-launch.xml) and combined, the
wall of each stage (each tier's pytest, and from the timing lines of cpkit.harness.launch_times
the multi-GPU grids), how busy the GPUs were, and each budget with its verdict; written as the evidence folder's README.md
and printed.

    python -m cpkit.validation.proof_report EVIDENCE_DIR --gpus 4 --setup-s 41 --pytest-s 250 --total-s 300 \
        --gpu1-s 120 --multi-gpu-s 245 --marker "gpu2 or gpu4"

The tiers run side by side, in three pytest processes: gpu1 on two xdist workers per GPU, and
the multi-GPU tier (`--marker`: gpu2 on 2-3 GPUs, gpu2 or gpu4 on 4 or more; empty on a 1-GPU
host, which runs gpu1 alone) in two: its rank pools' tests (junit.xml) and the tests that start
their own ranks (LAUNCHES, junit-launch.xml). A stage's wall is the span from its first grid's first case to its
last grid's end (stages run side by side, so the walls overlap and do not add up): 2-GPU, 3-GPU
and 4-GPU are the rank-pool grids of that world size without Transformer Engine; TE is every grid
of functional/test_te_backend.py; examples are the torchrun runs of functional/test_examples.py.

It exits 0 only when every tier is green, every tier's pytest ended by itself (`--gpu1-exit`,
`--pools-exit`, `--launches-exit`: a tier cut by the deadline writes a junit of what ran before
the cut), and every required part ran (`verdict`, through
cpkit.validation.required_parts; `--optional te,upstream` names parts that may be missing,
`--absent PART=WHY` a part the set-up lacks); a budget overrun is reported and fails the exit
only with `--fail-over-budget`.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from pathlib import Path

__all__ = ["BUDGETS", "GPU1", "GPU1_JUNIT", "LAUNCH_JUNIT", "LAUNCHES", "MULTI_GPU_JUNIT", "budgets_for", "overruns", "counts", "tier_junits",
           "tier_counts", "gpu_busy", "stage_walls", "verdict", "main"]

BUDGETS = {
    4: {"pytest": 300.0, "total": 420.0},
    2: {"pytest": 240.0, "total": 330.0},
}
"""Seconds, by host size (`budgets_for`): `pytest` is the wall of both tiers side by side, from
their start until the later one ended (4 or more GPUs: gpu1 beside gpu2 + gpu4; 2-3 GPUs: gpu1
beside gpu2; TE and the examples included); `total` is the proof command end to end, set-up
included. A 1-GPU host (gpu1 alone) has no stated budget: its walls are reported."""

GPU1 = "gpu1"
GPU1_JUNIT = "junit-gpu1.xml"
MULTI_GPU_JUNIT = "junit.xml"  # the name evidence folders and `cpkit cards record --evidence` have always read
LAUNCH_JUNIT = "junit-launch.xml"
LAUNCHES = "own launches"
"""The multi-GPU tests that start their own ranks (no rank pool: neither a grid nor an example
started beside the pools) run in a pytest of their own, its workers side by side (scripts/gpu-proof.sh):
one after another they held the tier's wall (about 200 s of 289 at ee2c2f5 on 2x H200). On 2-3
GPUs each 2-rank launch claims the whole host, so there they share the GPUs (CPKIT_GPU_SLOTS 3:
at c0b3916 on 2x H200 their claims waited 320 s in all)."""
TE_GRID = "functional.test_te_backend."


def budgets_for(gpus: int) -> dict[str, float]:
    """The budgets of a host with `gpus` GPUs: 4 or more take BUDGETS[4], 2-3 BUDGETS[2], 1 none ({})."""
    return BUDGETS[4] if gpus >= 4 else BUDGETS[2] if gpus >= 2 else {}


def overruns(gpus: int, pytest_s: float, total_s: float) -> list[str]:
    """The budgets of `budgets_for(gpus)` that the run overran, as "pytest 181 s > 180 s"."""
    spent = {"pytest": pytest_s, "total": total_s}
    return [f"{name} {spent[name]:.0f} s > {limit:.0f} s" for name, limit in budgets_for(gpus).items()
            if spent[name] > limit]


def counts(junit: Path) -> Counter:
    """passed / failed / error / skipped / xfailed / xpassed of a pytest junit file."""
    from cpkit.validation.junit import read_junit

    outcomes, _ = read_junit(junit)
    return Counter(outcomes.values())


def tier_junits(folder: Path, marker: str) -> dict[str, Path]:
    """Tier -> its junit file in `folder`: gpu1 always; the multi-GPU tier, named by its pytest
    marker ("gpu2", "gpu2 or gpu4"), and its tests that start their own ranks (LAUNCHES), unless
    `marker` is empty (a 1-GPU host runs gpu1 alone)."""
    multi = {marker: folder / MULTI_GPU_JUNIT, f"{marker}: {LAUNCHES}": folder / LAUNCH_JUNIT} if marker else {}
    return {GPU1: folder / GPU1_JUNIT, **multi}


def tier_counts(folder: Path, marker: str) -> dict[str, Counter | None]:
    """Tier -> counts of its junit file, None where the tier wrote none (it never started, or was
    killed after the deadline's grace)."""
    return {tier: counts(path) if path.exists() else None for tier, path in tier_junits(folder, marker).items()}


def stage_of(row: dict) -> str | None:
    if "example" in row:
        return "examples"
    if "wall_s" not in row or "t0" not in row:
        return None
    if row["grid"].startswith(TE_GRID):
        return "TE"
    return f"{row['world_size']}-GPU" if row.get("backend") == "nccl" else None


def stage_walls(rows: list[dict]) -> dict[str, float]:
    """Stage -> wall seconds (first start to last end) from the timing lines."""
    spans: dict[str, list[float]] = {}
    for row in rows:
        stage = stage_of(row)
        if stage is None:
            continue
        lo, hi = spans.setdefault(stage, [row["t0"], row["t1"]])
        spans[stage] = [min(lo, row["t0"]), max(hi, row["t1"])]
    order = ["2-GPU", "3-GPU", "4-GPU", "TE", "examples"]
    return {s: round(spans[s][1] - spans[s][0], 1) for s in sorted(spans, key=lambda s: (s not in order, order.index(s) if s in order else s))}


def gpu_busy(path: Path) -> dict[str, float]:
    """GPU index -> mean utilization (%) over the samples of `nvidia-smi --query-gpu=index,
    utilization.gpu --format=csv,noheader,nounits -l 1`."""
    samples: dict[str, list[float]] = {}
    try:
        with open(path) as fh:
            for row in csv.reader(fh):
                if len(row) >= 2 and row[1].strip().replace(".", "").isdigit():
                    samples.setdefault(row[0].strip(), []).append(float(row[1]))
    except OSError:
        return {}
    return {gpu: round(sum(v) / len(v), 1) for gpu, v in sorted(samples.items()) if v}


def _verdict(value: float, limit: float) -> str:
    return f"{value:.0f} s of {limit:.0f} s: {'within' if value <= limit else 'OVER'}"


def report(folder: Path, *, gpus: int, setup_s: float, pytest_s: float, total_s: float, marker: str,
           command: str, machine: str, commit: str, fingerprint: str, gpu1_s: float = 0.0,
           multi_gpu_s: float = 0.0, gpu1_workers: int = 0,
           exits: dict[str, int] | None = None) -> tuple[str, bool]:
    """(README text, every tier green and every budget met); `gpu1_workers`: the gpu1 tier's xdist
    workers (0: one per GPU); `exits`: tier -> its pytest's exit status. `marker` is the multi-GPU tier's
    ("" on a 1-GPU host); `gpu1_s` and `multi_gpu_s` are the walls of the two pytest processes,
    `pytest_s` the span of both."""
    tiers = tier_counts(folder, marker)
    rows = []
    times = folder / "case-times.jsonl"
    if times.exists():
        rows = [json.loads(line) for line in times.read_text().splitlines() if line.strip()]
    walls = stage_walls(rows)
    busy = gpu_busy(folder / "gpu-util.csv")
    pools = [r for r in rows if r.get("pool")]
    budgets = budgets_for(gpus)
    workers = gpu1_workers or gpus
    gpu1_run = (f"pytest `-m gpu1` over functional/ and tests/ ({workers} xdist worker{'s' if workers != 1 else ''} "
                f"on {gpus} GPU{'s' if gpus != 1 else ''}, each worker pinned to one)")
    runs = (f"{gpu1_run} beside pytest `-m \"{marker}\"` over functional/ (TE and examples included)" if marker
            else f"{gpu1_run}; no multi-GPU tier on 1 GPU")
    lines = [f"# GPU proof: {machine}, commit {commit}", "",
             f"Command: `{command}`: {runs}.",
             f"Tree fingerprint: `{fingerprint}` (`python -m cpkit.validation.proof_report --fingerprint` of the "
             "checkout).", ""]
    lines += _outcome_table(tiers)
    lines += ["", "| stage | wall s |", "|---|---|", f"| set-up | {setup_s:.0f} |", f"| gpu1 tier (its pytest) | {gpu1_s:.0f} |"]
    if marker:
        lines.append(f"| {marker} tier (its pytests: the pools' and the {LAUNCHES}, side by side) | {multi_gpu_s:.0f} |")
    lines += [f"| {stage} | {wall} |" for stage, wall in walls.items()]
    lines += [f"| pytest ({'both tiers, side by side' if marker else 'the gpu1 tier'}) | {pytest_s:.0f} |",
              f"| proof command end to end | {total_s:.0f} |", ""]
    verdicts = []
    tiers_run = f"gpu1 beside {marker}" if marker else "gpu1"
    if "pytest" in budgets:
        verdicts.append((f"pytest wall ({tiers_run})", _verdict(pytest_s, budgets["pytest"]), pytest_s <= budgets["pytest"]))
    if "total" in budgets:
        verdicts.append(("proof command end to end", _verdict(total_s, budgets["total"]), total_s <= budgets["total"]))
    lines += ["Budgets:", ""] + ([f"- {name}: {text}" for name, text, _ in verdicts]
                                 or [f"- none stated for a {gpus}-GPU host; the walls above are reported"])
    problems = _tier_problems(tiers, tier_junits(folder, marker), exits)
    lines += ["", f"Result: {'green' if not problems else 'NOT green'} ({'; '.join(problems) or _summary(_combined(tiers))})."]
    if busy:
        lines += ["", "GPU utilization during the run (mean of 1 s samples, %): "
                  + ", ".join(f"GPU {g}: {u}" for g, u in busy.items())]
    if pools:
        lines += ["", "Rank pools (backend+ranks, GPUs, index): starts, cases, start-up s, why retired:"]
        lines += [f"- {p['backend']}{p['world_size']} {p.get('gpus') or '-'} #{p.get('index', 0)}: {p['starts']}, "
                  f"{p['cases']}, {p['start_s']}"
                  + (", " + ", ".join(f"{why} x{n}" for why, n in p['retired'].items()) if p.get('retired') else "")
                  for p in pools]
    cases = sorted((r for r in rows if "case" in r), key=lambda r: -r["seconds"])[:15]
    if cases:
        lines += ["", "Slowest cases (s):"] + [f"- {r['seconds']:.1f} {r['backend']}{r['world_size']} "
                                               f"{r['grid'].rsplit('.', 1)[0]} {r['case']}"
                                               + (f" ({_compiles(r)})" if r.get("compiled") else "")
                                               for r in cases]
    compiling = [r for r in rows if r.get("compiled")]
    if compiling:
        lines += ["", f"Cases that compiled (torch.compile graphs): {len(compiling)}, "
                      f"{sum(r['compiled'] for r in compiling)} graphs ({sum(r.get('cached', 0) for r in compiling)} "
                      f"with their kernels from the machine's inductor cache), "
                      f"{sum(r['seconds'] for r in compiling):.1f} s of case time"]
    met = not problems and all(ok for _, _, ok in verdicts)
    return "\n".join(lines) + "\n", met


OUTCOMES = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")


def _compiles(row: dict) -> str:
    cached = row.get("cached", 0)
    return f"{row['compiled']} graphs compiled" + (f", {cached} from the machine's cache" if cached else "")


def _outcome_table(tiers: dict[str, Counter | None]) -> list[str]:
    """Outcomes per tier and for all tiers ("-" for a tier without a junit file)."""
    lines = ["| outcome | " + " | ".join(tiers) + " | all |", "|---|" + "---|" * (len(tiers) + 1)]
    total = _combined(tiers)
    for key in OUTCOMES:
        cells = ["-" if tally is None else str(tally[key]) for tally in tiers.values()]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {total[key]} |")
    return lines


def _combined(tiers: dict[str, Counter | None]) -> Counter:
    return sum((tally for tally in tiers.values() if tally is not None), Counter())


def _summary(tally: Counter) -> str:
    return f"{tally['failed']} failed, {tally['error']} errors, {tally['xpassed']} xpassed, {tally['passed']} passed"


def _tier_problems(tiers: dict[str, Counter | None], files: dict[str, Path],
                   exits: dict[str, int] | None = None) -> list[str]:
    """Why the tiers are not green, one line per tier: no junit file, not green, or a pytest that
    did not end by itself (`exits`: tier -> its pytest's exit status, where known). pytest writes
    its junit when interrupted too, so a tier cut by the deadline has counts that look green."""
    out = []
    for tier, tally in tiers.items():
        status = (exits or {}).get(tier)
        if tally is None:
            name = files[tier].name
            out.append(f"{tier}: no {name} (the tier did not finish; its pytest log says why)")
        elif status in DEADLINE_EXITS:
            out.append(f"{tier}: cut by the proof's deadline (CPKIT_PROOF_TIMEOUT_S; exit {status}) after "
                       f"{_summary(tally)}: the tests after the cut did not run")
        elif not _green(tally):
            out.append(f"{tier}: {_summary(tally)}")
        elif status not in (None, 0):
            out.append(f"{tier}: pytest exit {status} ({PYTEST_EXITS.get(status, 'not pytest')}) though its junit "
                       f"has {_summary(tally)}")
    return out


DEADLINE_EXITS = (124, 137)
"""`timeout`'s exit when it sent the deadline's signal (124), or its kill after the grace (137)."""
PYTEST_EXITS = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error", 5: "no tests collected"}


def verdict(folder: Path, *, gpus: int, pytest_s: float, total_s: float, optional=(), absent=None,
            fail_over_budget: bool = False, marker: str = "gpu2 or gpu4",
            exits: dict[str, int] | None = None) -> tuple[str, bool]:
    """(text, passed) of the proof's exit: it passes when every tier (gpu1, and the multi-GPU tier
    of `marker` unless it is empty) wrote its junit file, is green and ended by itself (`exits`:
    tier -> its pytest's exit status), and every required part ran in each
    (cpkit.validation.required_parts); an overrun fails it only with `fail_over_budget`."""
    from cpkit.validation.required_parts import violations

    files = tier_junits(folder, marker)
    tiers = tier_counts(folder, marker)
    problems = [f"not green: {p}" for p in _tier_problems(tiers, files, exits)]
    over = overruns(gpus, pytest_s, total_s)
    junits = [path for tier, path in files.items() if tiers[tier] is not None]
    problems += violations(junits, optional, absent=absent, over_budget=over, fail_over_budget=fail_over_budget)
    lines = ["", f"Exit verdict (tiers: {', '.join(tiers)}; required parts: TE, Megatron-LM, Megatron-Bridge, MCore, "
             f"cuDNN frontend; optional: {', '.join(sorted(optional)) or 'none'}):", ""]
    lines += [f"- FAIL: {p}" for p in problems] or ["- pass"]
    if over and not fail_over_budget:
        lines.append(f"- budget overrun reported, not failed (--fail-over-budget fails it): {'; '.join(over)}")
    return "\n".join(lines) + "\n", not problems


def _green(tally: Counter) -> bool:
    return tally["failed"] == 0 and tally["error"] == 0 and tally["xpassed"] == 0 and tally["passed"] > 0


def fingerprint(root: Path) -> str:
    """sha256 (16 hex) over the paths and bytes of the files that decide what the proof runs:
    src/, functional/, tests/, examples/, scripts/, pyproject.toml; no git needed, so a copy
    without .git names the same tree as its commit."""
    import hashlib

    digest = hashlib.sha256()
    files = [root / "pyproject.toml"] + [p for top in ("src", "functional", "tests", "examples", "scripts")
                                         for p in (root / top).rglob("*")
                                         if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)]
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpkit.validation.proof_report",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("folder", type=Path, nargs="?",
                        help="the evidence folder (junit-gpu1.xml, junit.xml, case-times.jsonl, gpu-util.csv)")
    parser.add_argument("--fingerprint", type=Path, metavar="ROOT", help="print the tree fingerprint of ROOT and exit")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--gpu1-workers", type=int, default=0, help="the gpu1 tier's xdist workers (0: one per GPU)")
    parser.add_argument("--setup-s", type=float, default=0.0)
    parser.add_argument("--pytest-s", type=float, default=0.0, help="the wall of both tiers, side by side")
    parser.add_argument("--gpu1-s", type=float, default=0.0, help="the wall of the gpu1 tier's pytest")
    parser.add_argument("--multi-gpu-s", type=float, default=0.0, help="the wall of the multi-GPU tier's pytest")
    parser.add_argument("--total-s", type=float, default=0.0)
    parser.add_argument("--marker", default="gpu2 or gpu4",
                        help="the multi-GPU tier's pytest marker; empty on a 1-GPU host (the gpu1 tier alone)")
    parser.add_argument("--command", default="bash scripts/gpu-proof.sh")
    parser.add_argument("--machine", default="unknown")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--optional", default="", metavar="PARTS",
                        help="parts that may be missing, comma-separated (te, mlm, bridge, upstream, mcore, kernels, other, all)")
    parser.add_argument("--absent", action="append", default=[], metavar="PART=WHY",
                        help="a part the set-up lacks, and why (repeatable)")
    parser.add_argument("--fail-over-budget", action="store_true", help="an overrun fails the exit (default: reported only)")
    for tier in ("gpu1", "pools", "launches"):
        parser.add_argument(f"--{tier}-exit", type=int, default=None, metavar="STATUS",
                            help=f"the exit status of the {tier} pytest (124: cut by the deadline)")
    args = parser.parse_args(argv)
    if args.fingerprint:
        print(fingerprint(args.fingerprint))
        return 0
    if args.folder is None:
        parser.error("the evidence folder is needed (or --fingerprint ROOT)")
    from cpkit.validation.required_parts import RequiredPartsError, parse_optional

    try:
        optional = parse_optional(args.optional, field="--optional")
        absent = dict(_part_why(item) for item in args.absent)
    except RequiredPartsError as exc:
        parser.error(str(exc))
    names = dict(zip((GPU1, args.marker, f"{args.marker}: {LAUNCHES}"), (args.gpu1_exit, args.pools_exit, args.launches_exit)))
    exits = {tier: status for tier, status in names.items() if status is not None}
    text, _ = report(args.folder, gpus=args.gpus, setup_s=args.setup_s, pytest_s=args.pytest_s,
                     total_s=args.total_s, marker=args.marker, command=args.command, machine=args.machine,
                     commit=args.commit, fingerprint=fingerprint(Path.cwd()), gpu1_s=args.gpu1_s,
                     multi_gpu_s=args.multi_gpu_s, gpu1_workers=args.gpu1_workers, exits=exits)
    gate, passed = verdict(args.folder, gpus=args.gpus, pytest_s=args.pytest_s, total_s=args.total_s,
                           optional=optional, absent=absent, fail_over_budget=args.fail_over_budget,
                           marker=args.marker, exits=exits)
    (args.folder / "README.md").write_text(text + gate)
    print(text + gate)
    return 0 if passed else 1


def _part_why(item: str) -> tuple[str, str]:
    from cpkit.validation.required_parts import PARTS, RequiredPartsError

    part, sep, why = item.partition("=")
    if not sep or part not in PARTS:
        raise RequiredPartsError(f"--absent {item}: must be PART=WHY with PART one of {', '.join(PARTS)}; "
                                 "fix: e.g. --absent te='no .te/te-bundle.tar.xz'")
    return part, why


if __name__ == "__main__":
    sys.exit(main())
