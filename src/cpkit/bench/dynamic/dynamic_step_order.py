"""`python -m cpkit.bench.dynamic.dynamic_step_order RUN.json ...`: how well the step model orders the
plans of a batch, over recorded `python -m cpkit.bench dynamic_step` runs (JSON or .json.gz).

No GPU: it reads what the runs measured and modeled. For every batch and every pair of distinct
plans that ran there, the modeled and the real ratio of their steps. It prints
- of the pairs modeled within --band of each other and really more than --resolution apart: how
  many the model ordered right, and of those that differ in robustness
  (cpkit.dynamic.candidates.robustness), how many the more robust plan won;
- per batch: the real step of the plan cpkit chose and of the modeled fastest plan, each over
  the batch's best real step.
This is the evidence behind cpkit.dynamic.candidates.TIE_BAND: where the model orders close
plans better than robustness does, it should decide between them.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from pathlib import Path

from cpkit.bench.dynamic.dynamic_step_predict import plan_from_record

__all__ = ["main", "order_stats"]


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def _ran(result: dict) -> dict:
    """{family: info} of the plans that ran in this batch (a family reusing another's plan and
    times is that plan)."""
    return {f: i for f, i in result["impl"].items()
            if "step_median_s" in i and "predicted_step_s" in i and "same_plan_as" not in i}


def order_stats(runs: list[dict], band: float = 0.10, resolution: float = 0.01) -> dict:
    """{"pairs", "close", "model_right", "differ_in_robustness", "robust_won", "batches": [{run,
    batch, chosen, fastest_modeled}]} over `runs` (bench JSONs); module docstring."""
    from cpkit.dynamic.candidates import robustness

    out = {"pairs": 0, "close": 0, "model_right": 0, "differ_in_robustness": 0, "robust_won": 0,
           "batches": []}
    for n, run in enumerate(runs):
        for result in run["results"]:
            ran = _ran(result)
            for (_, a), (_, b) in itertools.combinations(ran.items(), 2):
                out["pairs"] += 1
                modeled = a["predicted_step_s"] / b["predicted_step_s"]
                real = a["step_median_s"] / b["step_median_s"]
                if abs(modeled - 1) >= band or abs(real - 1) <= resolution:
                    continue
                out["close"] += 1
                out["model_right"] += (modeled < 1) == (real < 1)
                ra, rb = (robustness(plan_from_record(i["plan"], result)) for i in (a, b))
                if ra != rb:
                    out["differ_in_robustness"] += 1
                    out["robust_won"] += (ra < rb) == (real < 1)
            every = {f: i for f, i in result["impl"].items() if "step_median_s" in i and "predicted_step_s" in i}
            if "cpkit" not in every:
                continue
            best = min(i["step_median_s"] for i in every.values())
            fastest = min(every, key=lambda f: every[f]["predicted_step_s"])
            out["batches"].append({"run": n, "batch": result["label"],
                                   "chosen": every["cpkit"]["step_median_s"] / best,
                                   "fastest_modeled": every[fastest]["step_median_s"] / best,
                                   "fastest_family": fastest})
    return out


def main(argv=None) -> int:
    """Print order_stats of the runs given (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m cpkit.bench.dynamic.dynamic_step_order", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="dynamic_step JSONs (.json or .json.gz)")
    p.add_argument("--band", type=float, default=0.10, help="pairs modeled within this fraction")
    p.add_argument("--resolution", type=float, default=0.01, help="real differences below this are ties")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not Path(r).is_file()]
    if missing:
        p.error(f"no such run file: {', '.join(missing)} (pass dynamic_step JSONs, e.g. "
                "bench-results/dynamic_step.json)")
    s = order_stats([_load(r) for r in args.runs], args.band, args.resolution)
    print(f"{len(args.runs)} runs, {len(s['batches'])} batches, {s['pairs']} plan pairs")
    print(f"pairs modeled within {args.band:.0%} and really more than {args.resolution:.0%} apart: "
          f"{s['close']}; the model ordered {s['model_right']} right; of {s['differ_in_robustness']} "
          f"differing in robustness, the more robust won {s['robust_won']}")
    for name in ("chosen", "fastest_modeled"):
        xs = [b[name] for b in s["batches"]]
        if xs:
            print(f"real step over the batch's best, {name.replace('_', ' ')} plan: mean "
                  f"{statistics.mean(xs):.4f}, worst {max(xs):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
