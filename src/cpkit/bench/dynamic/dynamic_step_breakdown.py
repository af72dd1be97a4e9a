"""Which term of the step model misses, per plan family and batch of `python -m cpkit.bench
dynamic_step`: the marked step (cpkit.dynamic.microbatch_timeline, one extra step after the
timed ones) of the rank slowest in forward + backward, against the step model's figures for
that rank (StepModel.predict: per_rank_microbatch_s, per_rank_fwd_bwd_s).

Measured, that rank's step = prep + forward/backward + reduce_opt, and its forward/backward =
mb (the micro-batches: stream seconds between CUDA events, host seconds on CPU) + between (the
gaps between micro-batches and the wait after the last: lockstep syncs, late launches) + other
(what the stream timeline does not hold: the final synchronize). Predicted, the same terms: the
micro-batches' group times, what the rank waits for others (its forward/backward minus them),
prep and reduce_opt (other: 0). So predicted - measured step = the sum of the terms' misses.
"""

from __future__ import annotations

from typing import Optional

from cpkit.bench.common import format_table

__all__ = ["breakdown", "breakdown_table"]

TERMS = ("mb", "between", "other", "prep", "r+o")


def breakdown(info: dict) -> Optional[dict]:
    """The terms (module docstring) of one family's marked step, seconds; None where the family
    has no timeline. Keys: rank, microbatches, idle, clock ("gpu" or "host"), mb_s, host_mb_s,
    between_s, other_s, prep_s, reduce_opt_s, step_s; with the model's per-micro-batch figures
    also pred_mb_s, pred_between_s, pred_prep_s, pred_reduce_opt_s, pred_step_s and misses
    {term: predicted - measured}; "mismatch" where they count other micro-batches than ran."""
    ranks = (info.get("timeline") or {}).get("per_rank")
    if not ranks:
        return None
    r = max(range(len(ranks)), key=lambda i: ranks[i]["fwd_bwd_s"])
    mine, mbs = ranks[r], ranks[r]["microbatches"]
    on_gpu = bool(mbs) and all(m["gpu_s"] is not None for m in mbs)
    mb_s = sum(m["gpu_s"] if on_gpu else m["host_s"] for m in mbs)
    between = sum(m["gap_s"] or 0.0 for m in mbs) + (mine["tail_s"] or 0.0)
    out = {"rank": r, "microbatches": len(mbs), "idle": sum(m["cp"] is None for m in mbs),
           "clock": "gpu" if on_gpu else "host", "mb_s": mb_s, "host_mb_s": sum(m["host_s"] for m in mbs),
           "between_s": between, "other_s": mine["fwd_bwd_s"] - mb_s - between,
           "prep_s": mine["prep_s"], "reduce_opt_s": mine["reduce_opt_s"], "step_s": mine["step_s"]}
    per_mb = info.get("predicted_per_rank_microbatch_s")
    if per_mb is None or "predicted_per_rank_fwd_bwd_s" not in info:
        return out
    if len(per_mb[r]) != len(mbs):
        out["mismatch"] = f"the model counts {len(per_mb[r])} micro-batches on rank {r}, {len(mbs)} ran"
        return out
    pred_fb = info["predicted_per_rank_fwd_bwd_s"][r]
    out.update(pred_mb_s=sum(per_mb[r]), pred_between_s=pred_fb - sum(per_mb[r]),
               pred_prep_s=info["predicted_prep_s"], pred_reduce_opt_s=info["predicted_reduce_opt_s"])
    out["pred_step_s"] = out["pred_prep_s"] + pred_fb + out["pred_reduce_opt_s"]
    out["misses"] = {"mb": out["pred_mb_s"] - mb_s, "between": out["pred_between_s"] - between,
                     "other": -out["other_s"], "prep": out["pred_prep_s"] - out["prep_s"],
                     "r+o": out["pred_reduce_opt_s"] - out["reduce_opt_s"]}
    return out


HEADER = (
    "where the step's time goes (one extra step after the timed ones; the rank slowest in forward + "
    "backward; ms; pred: the step model for that rank):\n"
    "  mbs: micro-batches the runtime ran (idle ones); mb: their sum on the stream (CUDA events; host "
    "seconds on CPU); host mb: their launch time on the host;\n"
    "  between: the gaps between micro-batches and the wait after the last (lockstep); other: forward + "
    "backward off the stream timeline (its final sync);\n"
    "  largest miss: the term whose predicted - measured is furthest from 0 (the misses add up to "
    "pred step - step)")


def breakdown_table(results: list[dict]) -> str:
    """HEADER and one row per batch and family with a timeline (breakdown's terms in ms); ""
    when no family has one."""
    rows, cells, notes = [], {}, []
    cols = ["rank", "mbs", "pred mb", "mb", "host mb", "pred betw", "between", "other", "pred prep",
            "prep", "pred r+o", "r+o", "pred step", "step", "largest miss"]

    def ms(x):
        return f"{x * 1e3:.1f}"

    for res in results:
        for fam, info in res["impl"].items():
            b = info.get("timeline_breakdown") or breakdown(info)
            if b is None or "same_plan_as" in info:
                continue
            row = f"{res['label']} {fam}"
            rows.append(row)
            cells.update({(row, "rank"): str(b["rank"]),
                          (row, "mbs"): f"{b['microbatches']} ({b['idle']})",
                          (row, "mb"): ms(b["mb_s"]) + ("" if b["clock"] == "gpu" else " host"),
                          (row, "host mb"): ms(b["host_mb_s"]), (row, "between"): ms(b["between_s"]),
                          (row, "other"): ms(b["other_s"]), (row, "prep"): ms(b["prep_s"]),
                          (row, "r+o"): ms(b["reduce_opt_s"]), (row, "step"): ms(b["step_s"])})
            if "misses" in b:
                cells.update({(row, "pred mb"): ms(b["pred_mb_s"]), (row, "pred betw"): ms(b["pred_between_s"]),
                              (row, "pred prep"): ms(b["pred_prep_s"]),
                              (row, "pred r+o"): ms(b["pred_reduce_opt_s"]),
                              (row, "pred step"): ms(b["pred_step_s"])})
                term = max(TERMS, key=lambda t: abs(b["misses"][t]))
                cells[(row, "largest miss")] = f"{term} {b['misses'][term] * 1e3:+.1f}"
            if "mismatch" in b:
                notes.append(f"{row}: {b['mismatch']}")
    if not rows:
        return ""
    return "\n".join([HEADER, format_table(rows, cols, cells, corner="batch / plan")] + notes)
