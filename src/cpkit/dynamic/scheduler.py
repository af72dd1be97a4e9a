"""Dynamic-CP scheduler: the plan of a global batch with the least modeled step time. Pure
Python (no torch): every rank runs it on the same global batch and gets the same plan.

Terms. N = dp_cp_size ranks, M = max_seq_len_per_rank tokens. A CP group of size k is a block
of ranks [f, f + k) with k a power of two and f % k == 0 (so it matches a group the registry
created up front). If N is not a power of two, the blocks form a forest whose roots are N's
binary decomposition (6 = 4 + 2: [0, 4) and [4, 6)); no group crosses a root. Samples in one
group are packed together (THD) and each is sharded over all k ranks, so a rank of the group
holds sum(ceil(L / k)) tokens.

`schedule`, per global batch:
1. need(L) = cp_size_for(L, M, min_cp_size): the smallest CP size that fits the memory limit.
2. Candidates, each timed by the step-time model (cpkit.dynamic.cost.CostModel.step_time):
   - earliest finish (cpkit.dynamic.earliest_finish): samples keep their need unless the model
     says a wider group finishes sooner (`fastest_cp_size`), and go, widest need first, then
     slowest, to the aligned block that finishes them first, packed into its last group when
     the tokens fit;
   - the same list scheduling aimed at target makespans (cpkit.dynamic.search; TARGET_FACTORS
     times `makespan_bound`, a lower bound on any plan's step time): each sample, widest need
     first, takes the narrowest size whose earliest finish meets the target (else the earliest
     finish), and every sample longer than a quarter of the target may widen. So a long sample
     spreads wide while short ones stay narrow and pack: CP sizes mix inside a micro-batch;
   - static CP (cpkit.dynamic.static): every sample at the batch's largest need, and at each
     wider power of two ("wider-static": fewer, fuller micro-batches);
   - with a caller's `workload`, or when micro-batches end together (`step_rule="lockstep"`
     or pp_size > 1): the balancer (`balanced_plan`, below; without a workload it balances
     the model's rank-seconds of each sample at its need).
3. The fastest wins, static CP on ties: no plan is modeled slower than static CP.
4. Reference plans replace it unless it is modeled faster by more than the model's error
   (cpkit.dynamic.candidates: fewer, fuller micro-batches; the caller's `reference_plans`).

The compute-only balancer (`balanced_plan`; w = workload, W = a micro-batch's mean load per
rank): the fewest micro-batches B for which a balanced plan fits in memory (`_initial_count`,
rounded up to a multiple of microbatch_group_size, grown by ~1/8 until it packs); samples,
largest need first, then heaviest, to the micro-batch with the least work that still has room
(LPT); each micro-batch packed by cpkit.dynamic.packing.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import gc
import heapq
import math
import operator
from typing import Callable, Iterable, Mapping, Sequence

from cpkit.dynamic.candidates import TIE_BAND, choose_plan, fill_to_capacity_plan, usable_references
from cpkit.dynamic.cost import CostModel, default_cost_model
from cpkit.dynamic.earliest_finish import earliest_finish_plan, placing_order
from cpkit.dynamic.packing import Overflow, pack_microbatch
from cpkit.dynamic.plan import Microbatch, Plan
from cpkit.dynamic.search import (
    TARGET_FACTORS, fastest_cp_size, makespan_bound, sample_figures, step_time_floor, target_plans,
)
from cpkit.dynamic.static import static_cp_plan, static_cp_size
from cpkit.errors import CPConfigError, Violation

__all__ = ["DEFAULT_BALANCE_TOLERANCE", "aligned_roots", "balanced_plan", "cp_size_for", "fastest_cp_size",
           "largest_group_size", "makespan_bound", "needed_cp_sizes", "schedule", "step_time_floor"]

DEFAULT_BALANCE_TOLERANCE = 0.03
_FILL = 0.8  # token fill per micro-batch that B is planned for: headroom for packing
_MAX_LISTED = 5  # per-sample violations listed in one error before "... and k more"


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


def _is_pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def largest_group_size(dp_cp_size: int) -> int:
    """The largest aligned CP group in a DPxCP group of `dp_cp_size` ranks (largest power of two
    <= dp_cp_size)."""
    if not _is_pos_int(dp_cp_size):
        raise CPConfigError.single("dp_cp_size", dp_cp_size, "must be an int >= 1", "pass e.g. 8")
    return _pow2_floor(dp_cp_size)


def aligned_roots(dp_cp_size: int) -> list[tuple[int, int]]:
    """(first rank, size) of the root blocks of [0, dp_cp_size): its binary decomposition,
    largest first. Every aligned power-of-two block lies inside exactly one root."""
    largest_group_size(dp_cp_size)  # validates
    roots, first = [], 0
    for bit in reversed(range(dp_cp_size.bit_length())):
        size = 1 << bit
        if dp_cp_size & size:
            roots.append((first, size))
            first += size
    return roots


def cp_size_for(
    seq_len: int, max_seq_len_per_rank: int, min_cp_size: int = 1, dp_cp_size: int | None = None
) -> int:
    """Smallest power of two cp >= min_cp_size with ceil(seq_len / cp) <= max_seq_len_per_rank.

    ceil because a rank holds whole tokens: with cp ranks, the fullest one holds ceil(L / cp).
    Raises CPConfigError (a ValueError) naming the numbers for seq_len <= 0, a
    max_seq_len_per_rank <= 0, a min_cp_size that is not a power of two, or (when dp_cp_size is
    given) a size larger than the largest aligned group of the DPxCP world.
    """
    if not _is_pos_int(seq_len):
        raise CPConfigError.single(
            "seq_len", seq_len, "must be an int >= 1", "drop empty samples before scheduling"
        )
    if not _is_pos_int(max_seq_len_per_rank):
        raise CPConfigError.single(
            "max_seq_len_per_rank", max_seq_len_per_rank, "must be an int >= 1", "pass e.g. 8192"
        )
    if not _is_pow2(min_cp_size):
        raise CPConfigError.single(
            "min_cp_size", min_cp_size, "must be a power of two >= 1", "pass 1, 2, 4, ..."
        )
    ranks_needed = -(-seq_len // max_seq_len_per_rank)
    cp = max(min_cp_size, 1 << (ranks_needed - 1).bit_length())
    if dp_cp_size is not None:
        largest = largest_group_size(dp_cp_size)
        if cp > largest:
            raise CPConfigError.single(
                "seq_len", seq_len,
                f"needs cp_size {cp} (ceil({seq_len} / {cp}) <= max_seq_len_per_rank="
                f"{max_seq_len_per_rank}) but the largest aligned CP group of dp_cp_size="
                f"{dp_cp_size} has {largest} ranks",
                f"raise max_seq_len_per_rank to >= {-(-seq_len // largest)}, raise dp_cp_size "
                f"to >= {cp}, or split the sequence",
            )
    return cp


def needed_cp_sizes(
    seq_lens: Iterable[int],
    *,
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    min_cp_size: int = 1,
    microbatch_group_size: int | None = None,
) -> list[int]:
    """Validate a batch as `schedule` does and return every sample's needed CP size
    (cp_size_for); raises CPConfigError listing every violation."""
    lens = tuple(_as_int(L) for L in seq_lens)
    return _validate(lens, dp_cp_size, max_seq_len_per_rank, min_cp_size, microbatch_group_size,
                     DEFAULT_BALANCE_TOLERANCE)


def _validate(lens, dp_cp_size, max_seq_len_per_rank, min_cp_size, group_size, tolerance):
    """Every sample's needed CP size; raises CPConfigError listing all configuration violations
    at once (per-sample ones capped at _MAX_LISTED)."""
    bad: list[Violation] = []
    if not _is_pos_int(dp_cp_size):
        bad.append(Violation("dp_cp_size", dp_cp_size, "must be an int >= 1", "pass e.g. 8"))
    if not _is_pos_int(max_seq_len_per_rank):
        bad.append(Violation("max_seq_len_per_rank", max_seq_len_per_rank, "must be an int >= 1",
                             "pass e.g. 8192"))
    if not _is_pow2(min_cp_size):
        bad.append(Violation("min_cp_size", min_cp_size, "must be a power of two >= 1",
                             "pass 1, 2, 4, ..."))
    elif _is_pos_int(dp_cp_size) and dp_cp_size % min_cp_size:
        bad.append(Violation(
            "min_cp_size", min_cp_size,
            f"does not divide dp_cp_size={dp_cp_size}, so some ranks would have no aligned group",
            f"use a power of two dividing {dp_cp_size} (at most {dp_cp_size & -dp_cp_size})",
        ))
    if group_size is not None and not _is_pos_int(group_size):
        bad.append(Violation("microbatch_group_size", group_size, "must be None or an int >= 1",
                             "with VPP pass microbatch_group_size_per_vp_stage (default: pp), else None"))
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
        bad.append(Violation("balance_tolerance", tolerance, "must be a finite number >= 0",
                             f"pass e.g. {DEFAULT_BALANCE_TOLERANCE}"))
    if not lens:
        bad.append(Violation("seq_lens", [], "must hold at least one sample",
                             "skip scheduling for an empty batch"))
    if bad:
        raise CPConfigError(bad)
    per_sample: list[Violation] = []
    needs: list[int] = []
    largest = _pow2_floor(dp_cp_size)
    for i, L in enumerate(lens):
        if type(L) is int and L >= 1:  # fast path of cp_size_for
            need = max(min_cp_size, 1 << (-(-L // max_seq_len_per_rank) - 1).bit_length())
            if need <= largest:
                needs.append(need)
                continue
        try:
            cp_size_for(L, max_seq_len_per_rank, min_cp_size, dp_cp_size)
        except CPConfigError as err:
            v = err.violations[0]
            per_sample.append(Violation(f"seq_lens[{i}]", v.value, v.constraint, v.fix))
    if per_sample:
        extra = len(per_sample) - _MAX_LISTED
        listed = per_sample[:_MAX_LISTED]
        if extra > 0:
            listed.append(Violation("seq_lens", f"{extra} more", "also invalid",
                                    "fix the samples listed above the same way"))
        raise CPConfigError(listed)
    return needs


class _Distributor:
    """Per-batch constants; spreads samples over micro-batches and packs each one."""

    def __init__(self, lens, works, needs, dp_cp_size, max_len, min_cp_size, tolerance,
                 widest=None):
        self.lens, self.works, self.needs = lens, works, needs
        self.n_ranks, self.max_len = dp_cp_size, max_len
        self.roots = aligned_roots(dp_cp_size)
        self.pack_args = dict(lens=lens, works=works, needs=needs, roots=self.roots,
                              base=min_cp_size, max_len=max_len, tolerance=tolerance)
        largest = self.roots[0][1]
        # span: the largest group that keeps all its ranks busy (>= 1 real token each), or the need.
        spans = [max(c, _pow2_floor(min(L, largest))) for L, c in zip(lens, needs)]
        if widest is not None:  # never wider than the cost model's fastest size
            spans = [max(c, min(s, w)) for s, w, c in zip(spans, widest, needs)]
        self.pack_args["spans"] = spans
        self.pack_args["cover_idle"] = widest is None
        # Exclusive samples fill more than half a rank at their need: two never share a group
        # of that size, so their need-blocks must fit side by side.
        self.blocks = [c if -(-L // c) * 2 > max_len else 0 for L, c in zip(lens, needs)]

    def distribute(self, order: list[int], count: int) -> list[list[int]]:
        """LPT of samples over `count` micro-batches by work, with room for tokens and blocks."""
        if count >= len(order):  # one sample per micro-batch: always packable
            return [[i] for i in order] + [[] for _ in range(count - len(order))]
        lens, works, blocks = self.lens, self.works, self.blocks
        cap_tokens = self.n_ranks * self.max_len
        bins: list[list[int]] = [[] for _ in range(count)]
        tokens, used = [0] * count, [0] * count
        heap = [(0.0, m) for m in range(count)]
        for i in order:
            skipped = []
            while heap:
                load, m = heapq.heappop(heap)
                if tokens[m] + lens[i] <= cap_tokens and used[m] + blocks[i] <= self.n_ranks:
                    break
                skipped.append((load, m))
            else:
                raise Overflow
            bins[m].append(i)
            tokens[m] += lens[i]
            used[m] += blocks[i]
            heapq.heappush(heap, (load + works[i], m))
            for item in skipped:
                heapq.heappush(heap, item)
        return bins

    def pack(self, bag: list[int]) -> Microbatch:
        """The CP groups of one micro-batch; raises Overflow."""
        return Microbatch(groups=tuple(pack_microbatch(bag, **self.pack_args)))


def _initial_count(works, lens, blocks, n_ranks, max_len, tolerance) -> int:
    """Fewest micro-batches B at which a balanced plan is likely to fit in memory.

    Lower bounds: the tokens at _FILL of N * M per micro-batch; the blocks of exclusive samples;
    and the light samples (w <= (1 + tolerance) * W, W = a micro-batch's mean load per rank),
    which share ranks at their need, must reach W within _FILL * M tokens per rank:
    B >= total_work * light_tokens / (_FILL * M * N * light_work). Lights are the shortest
    samples, the least work per token: this bound keeps ranks full of short samples from
    running out of memory before they reach the mean load. A giant sample, heavier than a
    micro-batch's share of the rest, gets a micro-batch of its own (the LPT pass then keeps the
    others away from it), so it does not raise W for everybody.
    """
    order = sorted(range(len(works)), key=lambda i: works[i])  # ascending work
    sorted_works = [works[i] for i in order]
    cum_work, cum_tokens = [0.0], [0]
    for i in order:
        cum_work.append(cum_work[-1] + works[i])
        cum_tokens.append(cum_tokens[-1] + lens[i])
    base = max(1, math.ceil(sum(blocks) / n_ranks))
    giants = 0
    while True:
        rest = len(works) - giants  # the lightest `rest` samples
        count = max(1, math.ceil(cum_tokens[rest] / (_FILL * n_ranks * max_len)))
        total = cum_work[rest]
        while total > 0 and count < rest:  # count only grows, so this ends
            mean = total / (n_ranks * count)
            n_light = bisect.bisect_right(sorted_works, (1.0 + tolerance) * mean, 0, rest)
            if cum_work[n_light] <= 0:
                break
            needed = math.ceil(total * cum_tokens[n_light]
                               / (_FILL * max_len * n_ranks * cum_work[n_light]))
            if needed <= count:
                break
            count = min(needed, rest)
        if rest <= 1 or sorted_works[rest - 1] < total / count:
            return max(base, giants + count)
        giants += 1


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _as_int(x):
    """Integers of any integer type (numpy's included) as int; anything else unchanged, so
    validation reports it."""
    if type(x) is int or isinstance(x, bool):
        return x
    try:
        return operator.index(x)
    except TypeError:
        return x


def _workloads(workload: Callable[[int], float], lens: Sequence[int]) -> list[float]:
    """workload(L) for every sample, called with exactly one argument; checked finite and >= 0."""
    works = []
    for i, L in enumerate(lens):
        w = workload(L)
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise CPConfigError.single(
                "workload", w, f"workload({L}) for sample {i} must be a finite number >= 0",
                "return a non-negative float cost from the workload function",
            )
        works.append(float(w))
    return works


def balanced_plan(
    lens: Sequence[int],
    needs: Sequence[int],
    works: Sequence[float],
    *,
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    min_cp_size: int,
    microbatch_group_size: int | None,
    balance_tolerance: float,
    widest: Sequence[int] | None = None,
) -> Plan:
    """The balancing candidate (algorithm: module docstring) of a validated batch: `works[i]` is
    sample i's cost, spread as works[i] / k over a group of k ranks; `widest[i]` (optional) caps
    the group size sample i may be spread over."""
    group_size = microbatch_group_size or 1
    planner = _Distributor(lens, works, needs, dp_cp_size, max_seq_len_per_rank, min_cp_size,
                           balance_tolerance, widest)
    # Largest need first (so need-blocks pack like first-fit-decreasing), then heaviest (LPT).
    order = sorted(range(len(lens)), key=lambda i: (-needs[i], -works[i], -lens[i], i))
    count = _round_up(_initial_count(works, lens, planner.blocks, dp_cp_size,
                                     max_seq_len_per_rank, balance_tolerance), group_size)
    last = _round_up(len(lens), group_size)  # one sample per micro-batch: always packable
    while True:
        try:
            microbatches = tuple(planner.pack(b) for b in planner.distribute(order, count))
            break
        except Overflow:
            if count >= last:
                raise RuntimeError("cpkit bug: one sample per micro-batch must always fit")
            # Grow by ~1/8 so a hard batch needs O(log) re-plans, never an endless loop.
            count = min(last, _round_up(count + max(1, count // 8), group_size))
    return Plan(
        microbatches=microbatches,
        seq_lens=tuple(lens),
        dp_cp_size=dp_cp_size,
        max_seq_len_per_rank=max_seq_len_per_rank,
        workloads=tuple(works),
        needed_cp_sizes=tuple(needs),
    )


def _collector_paused(fn):
    """`fn` with the cyclic garbage collector paused (if on) while it runs. The search builds
    and drops thousands of short-lived objects and no reference cycles, so a collection during
    it only scans (a full one took 100-300 ms against a 50 ms budget at 4096 samples);
    reference counting still frees them at once, and the collector runs as before after."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
    return paused


@_collector_paused
def schedule(
    seq_lens: Iterable[int],
    *,
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    min_cp_size: int = 1,
    microbatch_group_size: int | None = None,
    workload: Callable[[int], float] | None = None,
    balance_tolerance: float = DEFAULT_BALANCE_TOLERANCE,
    cost_model: CostModel | None = None,
    step_rule: str = "free",
    pp_size: int = 1,
    reference_plans: Mapping[str, Plan] | None = None,
    tie_band: float = TIE_BAND,
) -> Plan:
    """Plan one global batch of packed samples over the DPxCP ranks with the least modeled step
    time (algorithm: module docstring).

    seq_lens: length in tokens of each sample; sample ids in the plan index this sequence.
    dp_cp_size: N, the size of the DPxCP group (need not be a power of two).
    max_seq_len_per_rank: M, the most tokens any rank may hold in one micro-batch.
    min_cp_size: smallest CP group size (power of two dividing N).
    microbatch_group_size: if set, the number of micro-batches is a multiple of it: with VPP,
        Megatron-LM's microbatch_group_size_per_vp_stage (default: the pipeline-parallel size);
        None without VPP; micro-batches are left empty only when there are fewer samples.
    workload: cost of one sample from its length that the balancing candidate spreads over its
        group (default: the cost model's time of the sample at its needed CP size, times that
        size: the rank-seconds it takes).
    balance_tolerance: how far above its micro-batch's mean load per rank a group may cost
        before the balancing candidate gives it more ranks.
    cost_model: cpkit.dynamic.cost.CostModel that times the candidates (default
        cpkit.dynamic.cost.default_cost_model(): the shipped calibration, a 4096-wide model).
    step_rule, pp_size: the runtime's step semantics the candidates are timed under
        (cpkit.dynamic.step_rules: "free", cpkit's runtime at PP = 1; "lockstep", micro-batches
        end together, which pp_size > 1 implies).
    reference_plans, tie_band: other schedulers' plans (name -> Plan); the modeled fastest, of
        plans within tie_band of it the most robust (cpkit.dynamic.candidates.choose_plan); one
        that breaks an invariant is never taken (cpkit.dynamic.candidates.usable_references).

    The plan is the faster, by the model, of the balancing candidate and static CP
    (cpkit.dynamic.static.static_cp_plan), static winning ties, so it is never modeled slower
    than static CP; plan.step_time_s and plan.static_step_time_s hold both figures.

    Guarantees: every sample in exactly one group of one micro-batch; groups are aligned
    power-of-two blocks, disjoint within a micro-batch, of size >= the samples' needs; no rank
    holds more than M tokens; the same inputs give the same plan. Raises CPConfigError for
    invalid input (a sample longer than the largest group can hold included).
    """
    lens = tuple(_as_int(L) for L in seq_lens)
    needs = _validate(lens, dp_cp_size, max_seq_len_per_rank, min_cp_size, microbatch_group_size,
                      balance_tolerance)
    model = cost_model or default_cost_model()
    largest = _pow2_floor(dp_cp_size)
    args = dict(dp_cp_size=dp_cp_size, max_seq_len_per_rank=max_seq_len_per_rank,
                microbatch_group_size=microbatch_group_size)
    works = None if workload is None else _workloads(workload, lens)
    widest, per_sample = sample_figures(model, lens, needs, largest)
    at_need = [v[0] for v in per_sample]
    finish_args = dict(roots=aligned_roots(dp_cp_size), cost_model=model, workloads=works,
                       at_need=at_need, order=placing_order(lens, needs, at_need), **args)
    # Each candidate is timed as soon as it is built and only the best so far is kept (fewer
    # live objects, fewer garbage-collector passes). Candidates come in rank order, so a later
    # one must be strictly faster to win. With PP = 1 and no padded micro-batches, the ready
    # times of an earliest-finish plan being built never exceed its step time (free, or
    # lockstep, which only waits more): a build whose ready time reaches the best gives up.
    # Once the best is at `floor`, which no plan beats, the search stops.
    prune = pp_size == 1 and (microbatch_group_size or 1) == 1
    floor = step_time_floor(model, lens, needs, largest)
    best: list = []  # [step time, rank, name, plan]

    def offer(rank, name, plan):
        if plan is not None:
            t = model.step_time(plan, step_rule, pp_size)
            if not best or (t, rank) < (best[0], best[1]):
                best[:] = [t, rank, name, plan]

    def give_up_at():
        return best[0] if prune else None

    static = static_cp_plan(lens, needs, cost_model=model, min_cp_size=min_cp_size,
                            workloads=works or at_need, **args)
    offer(0, "static", static)
    static_time = best[0]
    wider = 2 * static_cp_size(needs, min_cp_size)
    while wider <= largest and best[0] > floor:
        offer(0.5, "wider-static", static_cp_plan(lens, needs, cost_model=model, min_cp_size=wider,
                                                  workloads=works or at_need, **args))
        wider *= 2
    if best[0] > floor:
        offer(1, "earliest-finish", earliest_finish_plan(lens, needs, widest,
                                                        give_up_at=give_up_at(), **finish_args))
    # The same list scheduling aimed at makespans from the lower bound up (cpkit.dynamic.search).
    for i, plan in target_plans(lens, needs, widest, per_sample, done=lambda: best[0] <= floor,
                                give_up_at=give_up_at, **finish_args):
        offer(2 + i, "earliest-finish", plan)
    rank = 2 + len(TARGET_FACTORS)
    if best[0] > floor and works is None and (step_rule != "free" or pp_size > 1):
        # Micro-batches end together: balance each one by the model's rank-seconds at the need.
        works_lock = [model.estimate_sample_time(L, c) * c for L, c in zip(lens, needs)]
        offer(rank, "balanced", balanced_plan(
            lens, needs, works_lock, min_cp_size=min_cp_size, balance_tolerance=balance_tolerance,
            **args))
    if best[0] > floor and works is not None:  # the caller's compute-only workload: balance by it as well
        offer(rank + 1, "balanced", balanced_plan(
            lens, needs, works, min_cp_size=min_cp_size, balance_tolerance=balance_tolerance,
            **args))
    refs = usable_references(reference_plans, lens, needs, **args)
    if pp_size == 1 and (microbatch_group_size or 1) == 1:  # fill ignores VPP's multiple
        refs.setdefault("fill", fill_to_capacity_plan(lens, needs, workloads=works or at_need, **args))
    step_time, name, chosen = choose_plan((best[0], best[2], best[3]), refs, lambda p: model.step_time(
        p, step_rule, pp_size), static_time, tie_band)
    return dataclasses.replace(chosen, step_time_s=step_time, static_step_time_s=static_time,
                               candidate=name)
