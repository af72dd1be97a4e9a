"""When a training step of a plan ends, given how long each group of each micro-batch takes.

One function for the cost model (cpkit.dynamic.cost.CostModel.step_time) and the replay
(cpkit.bench.dynamic.replay), so the scheduler optimizes the rule the replay measures under. Rules:

- "free" (cpkit's runtime at PP = 1, cpkit.dynamic.runtime.dynamic_cp_step): a rank runs its
  micro-batches in order; a group starts when the last of its ranks is free (its ring waits for
  every member) and holds all its ranks until it ends; nothing else synchronizes the ranks.
  The step ends when the last rank does.
- "lockstep" (micro-batches end together: MCore's hybrid-CP schedule, which waits for the whole
  DPxCP group after every micro-batch, and the pipeline schedule at PP > 1, where every stage
  exchanges activations once per micro-batch): micro-batch m takes T_m, its slowest group.
  With `pp_size` = p stages each holding 1/p of the layers, 1F1B runs every micro-batch once
  per stage and fills and drains the pipeline once: (sum_m T_m + (p - 1) * max_m T_m) / p
  (p = 1: sum_m T_m).
"""

from __future__ import annotations

from typing import Sequence

from cpkit.errors import CPConfigError

__all__ = ["RULES", "step_end"]

RULES = ("free", "lockstep")

# per micro-batch, per group: (ranks of the group, seconds the group takes)
GroupTimes = Sequence[Sequence[tuple[Sequence[int], float]]]


def step_end(group_times: GroupTimes, dp_cp_size: int, rule: str = "free",
             pp_size: int = 1) -> float:
    """Seconds until the step of `group_times` ends under `rule` (module docstring)."""
    if rule not in RULES:
        raise CPConfigError.single("rule", rule, f"must be one of {RULES}",
                                   "pass 'free' (PP = 1) or 'lockstep' (micro-batches end together)")
    if not (isinstance(pp_size, int) and pp_size >= 1):
        raise CPConfigError.single("pp_size", pp_size, "must be an int >= 1", "pass e.g. 1 or 4")
    if rule == "lockstep" or pp_size > 1:
        per_mb = [max((t for _, t in mb), default=0.0) for mb in group_times]
        if not per_mb:
            return 0.0
        return (sum(per_mb) + (pp_size - 1) * max(per_mb)) / pp_size
    ready = [0.0] * dp_cp_size
    for mb in group_times:
        for ranks, t in mb:
            end = max(ready[r] for r in ranks) + t
            for r in ranks:
                ready[r] = end
    return max(ready, default=0.0)
