"""Rank 0's side of `python -m cpkit.bench dynamic_step`: the plans of every family and their
predicted step, from the step model (cpkit.dynamic.step_model.StepModel) calibrated by
micro-benchmarks (cpkit.bench.dynamic.dynamic_step_calibrate); optionally also the replay's
(`--replay`: cpkit.bench.dynamic.replay.replay_plan, rank 0's kernels timed per shape: slow).

cpkit's plan is cpkit.dynamic.schedule with the step model and MCore's and Megatron-LM's plans
of the same batch as references (cpkit.dynamic.candidates.choose_plan: the modeled fastest, of
plans tied within TIE_BAND the most robust). Only plans the registry can run become references.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from cpkit.bench.dynamic.replay_plans import Batch
from cpkit.dynamic.plan import Plan

__all__ = ["Predictor", "plan_from_record", "plan_key", "plan_record", "start_mlm_worker"]


def start_mlm_worker() -> Optional[object]:
    """Start Megatron-LM's scheduler worker in a thread (it loads the checkout for seconds) so
    the first batch does not wait for it; None without CPKIT_MLM_SRC."""
    import threading

    from cpkit.dynamic.mlm import skip_reason

    if skip_reason() is not None:
        return None

    def warm():
        from cpkit.dynamic.mlm import mlm_schedule

        try:
            mlm_schedule([64, 64], 2, 64, timeout_s=60.0)
        except Exception:  # noqa: BLE001 - the batch's own call reports any failure
            pass

    thread = threading.Thread(target=warm, name="cpkit-mlm-warm", daemon=True)
    thread.start()
    return thread


def plan_key(plan: Plan) -> tuple:
    """What decides how the runtime runs `plan`: equal keys run the same step."""
    return (plan.packed, tuple(tuple((g.ranks, g.samples, g.cp_size) for g in mb.groups)
                               for mb in plan.microbatches))


def plan_record(plan: Plan) -> dict:
    """The full plan for the JSON: per micro-batch, per group its ranks, CP size, samples and
    their lengths; packed, candidate and token fill."""
    lens = plan.seq_lens
    return {"packed": plan.packed, "candidate": plan.candidate,
            "mean_token_fill": plan.stats.mean_token_fill,
            "microbatches": [[{"ranks": list(g.ranks), "cp": g.cp_size, "samples": list(g.samples),
                               "lengths": [lens[s] for s in g.samples]} for g in mb.groups]
                             for mb in plan.microbatches]}



def plan_from_record(record: dict, result: dict) -> Plan:
    """The Plan of `record` (plan_record's form) in batch `result` of the bench JSON (its
    seq_lens, dp_cp_size, max_seq_len_per_rank). Workloads are not recorded: zeros."""
    from cpkit.dynamic.plan import CPGroupAssignment, Microbatch
    from cpkit.dynamic.scheduler import cp_size_for

    lens, m = tuple(result["seq_lens"]), result["max_seq_len_per_rank"]
    mbs = tuple(Microbatch(tuple(CPGroupAssignment(tuple(g["ranks"]), tuple(g["samples"]), g["cp"])
                                 for g in mb)) for mb in record["microbatches"])
    return Plan(microbatches=mbs, seq_lens=lens, dp_cp_size=result["dp_cp_size"], max_seq_len_per_rank=m,
                workloads=(0.0,) * len(lens), needed_cp_sizes=tuple(cp_size_for(n, m) for n in lens),
                packed=record["packed"], candidate=record.get("candidate"))

class Predictor:
    """The step model and the plans (module docstring); `runnable(plan)` -> None or why not."""

    def __init__(self, spec, model, runnable: Callable[[Plan], Optional[str]], timer=None, link=None):
        from cpkit.dynamic.cost import CostModel

        self.spec, self.model, self.runnable = spec, model, runnable
        self.timer, self.link = timer, link
        self.kernels = CostModel(model.dims, model.calibration, model.comm_type)  # for comparison

    def plans(self, batch: Batch) -> dict[str, object]:
        """{family: Plan or an error string} in spec.families' order."""
        from cpkit.bench.dynamic.replay_plans import plans
        from cpkit.dynamic import schedule
        from cpkit.dynamic.mlm import skip_reason

        made = plans(batch, self.model, "free", 1, with_cpkit=False)
        refs = {k: made[k] for k in ("mcore", "mlm")
                if isinstance(made.get(k), Plan) and self.runnable(made[k]) is None}
        made["cpkit"] = schedule(list(batch.seq_lens), dp_cp_size=batch.dp_cp_size,
                                 max_seq_len_per_rank=batch.max_seq_len_per_rank,
                                 cost_model=self.model, reference_plans=refs)
        out = {}
        for fam in self.spec.families:
            plan = made.get(fam)
            if plan is None:  # only mlm is ever absent: no checkout
                plan = f"skipped: {skip_reason() or 'cpkit.dynamic.mlm is unavailable'}"
            out[fam] = plan
        return out

    def predict(self, plan: Plan) -> dict:
        """The step model's prediction (per rank and per micro-batch the runtime runs too), and
        the replay's with --replay."""
        p = self.model.predict(plan)
        out = {"predicted_step_s": p["step_s"], "predicted_fwd_bwd_s": p["fwd_bwd_s"],
               "predicted_prep_s": p["prep_s"], "predicted_reduce_opt_s": p["reduce_opt_s"],
               "predicted_per_rank_fwd_bwd_s": p["per_rank_fwd_bwd_s"],
               "predicted_per_rank_microbatch_s": p["per_rank_microbatch_s"],
               "kernels_only_s": self.kernels.step_time(plan, "free", 1)}
        if self.timer is not None:
            from cpkit.bench.dynamic.replay import replay_plan

            t0 = time.perf_counter()
            r = replay_plan(plan, self.timer, self.link, self.spec.dims, "free", 1)
            out.update(replayed_s=r["step_s"], replayed_comm_s=r["comm_s"],
                       replay_wall_s=time.perf_counter() - t0)
        return out

    def predict_at_pace(self, plan: Plan, pace: float) -> dict:
        """The step model's step and forward + backward of `plan` on a host `pace` times as slow
        as the calibration's (cpkit.dynamic.step_model.StepCosts.at_pace)."""
        from cpkit.dynamic.step_model import StepModel

        model = StepModel(self.model.dims, self.model.calibration, self.model.comm_type,
                          costs=self.model.costs.at_pace(pace))
        p = model.predict(plan)
        return {"predicted_step_at_pace_s": p["step_s"], "predicted_fwd_bwd_at_pace_s": p["fwd_bwd_s"]}
