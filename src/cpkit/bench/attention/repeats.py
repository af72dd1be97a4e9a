"""`python -m cpkit.bench.attention.repeats RUN.json...`: the cpkit/TE ratio of each cell over
repeated runs of the attention benchmark in one call (measured): median, spread (max - min) and
the runs it saw, and the cells whose median is below 1.00 (behind TE).

One run's ratio moves by a few percent between runs on the same machine; a target stated per
cell ("cpkit at 1.00x TE or more") is judged on the median of three runs in one call, with the
spread shown beside it (`bash scripts/gpu-bench.sh attention` with ATTENTION_REPEATS=3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from cpkit.bench.attention.attention_table import seq_label, te_ratios
from cpkit.bench.common import format_table

__all__ = ["cell_ratios", "render", "main"]


def cell_ratios(runs: list[list[dict]]) -> dict[tuple[str, int], list[float]]:
    """(cpkit row label, seq) -> its cpkit/TE ratio in each run that measured both sides."""
    out: dict[tuple[str, int], list[float]] = {}
    for results in runs:
        for key, ratio in te_ratios(results).items():
            out.setdefault(key, []).append(ratio)
    return out


def render(ratios: dict[tuple[str, int], list[float]]) -> str:
    """The table of medians (spread, runs) and the verdict line."""
    labels = sorted({label for label, _ in ratios})
    seqs = sorted({seq for _, seq in ratios})
    cells = {(label, seq_label(seq)): f"{statistics.median(v):.3f} ({max(v) - min(v):.3f}, n={len(v)})"
             for (label, seq), v in ratios.items()}
    table = format_table(labels, [seq_label(s) for s in seqs], cells, corner="cpkit/TE median (spread, runs)")
    behind = sorted((statistics.median(v), label, seq) for (label, seq), v in ratios.items() if statistics.median(v) < 1.0)
    verdict = (f"behind TE (median < 1.00) in {len(behind)} of {len(ratios)} cells: "
               + ", ".join(f"{label} {seq_label(seq)} {m:.3f}" for m, label, seq in behind)) if behind else \
        f"cpkit at or ahead of TE (median >= 1.00) in all {len(ratios)} cells"
    return f"{table}\n{verdict}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpkit.bench.attention.repeats", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="attention benchmark JSON files, one per run")
    parser.add_argument("--out", default=None, help="write the medians as JSON here")
    args = parser.parse_args(argv)
    runs = [json.loads(Path(p).read_text())["results"] for p in args.runs]
    ratios = cell_ratios(runs)
    if not ratios:
        print("no cell has both a cpkit and a TE result", file=sys.stderr)
        return 1
    print(render(ratios))
    if args.out:
        Path(args.out).write_text(json.dumps(
            [{"row": label, "seq": seq, "ratios": v, "median": statistics.median(v), "spread": max(v) - min(v)}
             for (label, seq), v in sorted(ratios.items())], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
