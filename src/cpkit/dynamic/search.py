"""The earliest-finish search of the dynamic-CP scheduler (algorithm: cpkit.dynamic.scheduler's
module docstring): each sample's fastest CP size, the bounds on any plan's step time, and the
earliest-finish passes aimed at target makespans.

Pure Python (no torch).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

from cpkit.dynamic.cost import CostModel
from cpkit.dynamic.earliest_finish import earliest_finish_plan
from cpkit.dynamic.plan import Plan

__all__ = [
    "TARGET_FACTORS",
    "fastest_cp_size",
    "makespan_bound",
    "sample_figures",
    "step_time_floor",
    "target_plans",
]

# Makespan targets of the earliest-finish search, as multiples of makespan_bound: each finds
# plans the others miss (over random long-tailed batches each wins about a fifth of the time).
TARGET_FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0)
_WIDEN_SHARE = 0.25  # samples shorter than this share of the target stay on one rank (fast path)

# (figure at the need, fastest size, figure at the fastest size) of one sample
Figures = tuple[float, int, float]


def fastest_cp_size(model: CostModel, seq_len: int, need: int, largest: int) -> int:
    """The power of two in [need, largest] with the least modeled time per rank for `seq_len`
    alone (the smallest on ties): a wider group than this is slower, not just costlier."""
    best, best_time, k = need, model.estimate_sample_time(seq_len, need), need * 2
    while k <= largest and k <= seq_len:
        t = model.estimate_sample_time(seq_len, k)
        if t >= best_time:  # past the fastest size: wider groups only add ring steps
            break
        best, best_time = k, t
        k *= 2
    return best


def makespan_bound(model: CostModel, lens: Sequence[int], needs: Sequence[int],
                   widest: Callable[[int, int], int], dp_cp_size: int) -> float:
    """A lower bound (estimated, ignoring packing) on any plan's step time: the longest sample at
    its fastest size, or every sample's least rank-seconds (at its need or its fastest size)
    spread evenly over the N ranks."""
    longest, area = 0.0, 0.0
    for L, c in zip(lens, needs):
        k = widest(L, c)
        at_fastest = model.estimate_sample_time(L, k)
        longest = max(longest, at_fastest)
        area += min(c * model.estimate_sample_time(L, c), k * at_fastest)
    return max(longest, area / dp_cp_size)


def step_time_floor(model: CostModel, lens: Sequence[int], needs: Sequence[int],
                    largest: int) -> float:
    """A step time no plan is modeled below: the longest sample alone at its fastest size of
    any in [need, largest] (a group's time only grows with the samples packed into it, and a
    step lasts at least its longest group under every step rule)."""
    i = max(range(len(lens)), key=lambda j: (lens[j], needs[j]))
    L, k, floor = lens[i], needs[i], math.inf
    while k <= largest:
        floor = min(floor, model.sample_time(L, k))
        k *= 2
    return floor


def sample_figures(model: CostModel, lens: Sequence[int], needs: Sequence[int],
                   largest: int) -> tuple[Callable[[int, int], int], list[Figures]]:
    """`widest(L, need)`, fastest_cp_size with sizes up to `largest`, memoized; and per sample
    (estimate_sample_time at its need, its fastest size, estimate_sample_time there). Each is
    computed once per length class: the lengths estimate_sample_time and fastest_cp_size cannot
    tell apart."""
    fastest: dict[tuple[int, int, int], int] = {}

    def widest(L, c):
        # fastest_cp_size sees L only through estimate_sample_time (L's 7 leading bits) and
        # k <= L (L's bit length): lengths alike in both share one answer.
        bits = L.bit_length()
        key = (L >> max(0, bits - 7), bits, c)
        k = fastest.get(key)
        if k is None:
            k = fastest[key] = fastest_cp_size(model, L, c, largest)
        return k

    classes: dict[tuple[int, int, int], Figures] = {}
    per_sample = []
    for L, c in zip(lens, needs):
        bits = L.bit_length()
        key = (L >> max(0, bits - 7), bits, c)
        v = classes.get(key)
        if v is None:
            t, k = model.estimate_sample_time(L, c), widest(L, c)
            v = classes[key] = (t, k, t if k == c else model.estimate_sample_time(L, k))
        per_sample.append(v)
    return widest, per_sample


def target_plans(lens: Sequence[int], needs: Sequence[int], widest: Callable[[int, int], int],
                 per_sample: Sequence[Figures], *, done: Callable[[], bool],
                 give_up_at: Callable[[], float | None],
                 **finish_args) -> Iterator[tuple[int, Plan | None]]:
    """(i, plan) for the earliest-finish plans aimed at TARGET_FACTORS[i] times makespan_bound,
    smallest target first: each sample takes the narrowest size that meets the target, so long
    samples widen (and mix CP sizes) only where they must. Lazy: `done()` (stop) and
    `give_up_at()` (earliest_finish_plan's) are asked before each plan; `finish_args` go to
    earliest_finish_plan. A target that could only tie a smaller one's plan is skipped."""
    bound = max(max(v[2] for v in per_sample),  # makespan_bound, from the per-sample figures
                sum(min(c * t, k * tk) for c, (t, k, tk) in zip(needs, per_sample))
                / finish_args["dp_cp_size"])
    # A target below notes["same_plan_below"] of a smaller one's run (and whose widen_above
    # stays below notes["widen_below"]) gives that run's plan (earliest_finish_plan's `notes`).
    notes: dict = {}
    for i, factor in enumerate(TARGET_FACTORS):
        if done():
            return
        target = bound * factor
        if target < notes.get("same_plan_below", 0.0) \
                and target * _WIDEN_SHARE < notes["widen_below"]:
            continue
        yield i, earliest_finish_plan(
            lens, needs, widest, target=target, widen_above=target * _WIDEN_SHARE,
            give_up_at=give_up_at(), notes=notes, **finish_args)
