"""The step-time candidate of the dynamic-CP scheduler: list scheduling by earliest finish time.

Works on modeled seconds (cpkit.dynamic.cost), not on a compute-only workload. Every rank has a
ready time. Samples are placed one by one, widest need first, then slowest first:

1. Sizes tried: the sample's need (smallest power of two that fits max_seq_len_per_rank); wider
   sizes, up to the fastest one (cpkit.dynamic.search.fastest_cp_size), only for a sample
   that would take longer at its need than `widen_above` (default a rank's mean load): short
   samples stay on few ranks (no CP communication, full kernels), only the long ones spread.
2. For each size, the aligned block with the earliest start (the latest ready time of its ranks);
   its finish counts only the added time where the sample would pack into the block's last
   group (step 3). The size and block that finish first win (lowest rank on ties); with a
   `target` makespan, the narrowest size that finishes by the target wins instead, so a sample
   takes no more ranks than the target needs.
3. If that block's last group is the same block and the sample fits its tokens, the sample is
   packed into it (THD: one kernel call for both, better GEMM efficiency); otherwise it opens a
   new group, in the first micro-batch after every previous one of its ranks.

A rank runs its groups in order and waits for the ranks it shares a group with; cpkit's runtime
has no other barrier, so the plan's modeled step time (CostModel.step_time) is the latest finish.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from cpkit.dynamic.cost import CostModel
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.dynamic.static import fill_padding

__all__ = ["earliest_finish_plan", "placing_order"]


class _Group:
    __slots__ = ("first", "size", "samples", "lens", "tokens", "time", "index")

    def __init__(self, first, size, index):
        self.first, self.size, self.index = first, size, index
        self.samples: list[int] = []
        self.lens: list[int] = []
        self.tokens, self.time = 0, 0.0


class _ReadyTimes:
    """Ready time per rank, and per aligned block of every power-of-two size the latest ready
    time of its ranks (inf for a block that crosses a root of N, which no group may use).
    The ranks also sit in a heap of (ready time, rank) entries: an entry whose time is no longer
    its rank's is stale and dropped when it reaches the top (ready times only grow)."""

    def __init__(self, roots: Sequence[tuple[int, int]], n: int):
        self.n = n
        self.rank = [0.0] * n
        self.heap = [(0.0, r) for r in range(n)]  # sorted, so a heap
        self.levels: dict[int, list[float]] = {}
        size = 1
        while size <= n:
            blocks = [float("inf")] * (-(-n // size))
            for first, root in roots:
                if root >= size:
                    for f in range(first, first + root, size):
                        blocks[f // size] = 0.0
            self.levels[size] = blocks
            size *= 2

    def earliest(self, size: int) -> tuple[float, int]:
        """(start, first rank) of the block of `size` whose ranks are all free first (the
        lowest on ties)."""
        if size == 1:  # the most asked, and the longest list: the heap
            return self.earliest_rank()
        blocks = self.levels[size]
        start = min(blocks)
        return start, blocks.index(start) * size

    def earliest_rank(self) -> tuple[float, int]:
        """(ready time, rank) of the rank free first (the lowest on ties)."""
        heap, ready = self.heap, self.rank
        while ready[heap[0][1]] != heap[0][0]:
            heapq.heappop(heap)
        return heap[0]

    def set(self, first: int, size: int, end: float) -> None:
        """Ranks [first, first + size) are busy until `end` (>= their ready times)."""
        self.rank[first:first + size] = [end] * size
        for r in range(first, first + size):
            heapq.heappush(self.heap, (end, r))
        for s, blocks in self.levels.items():
            if s <= size:  # blocks inside an aligned group never cross a root: all finite
                blocks[first // s:(first + size) // s] = [end] * (size // s)
            else:
                j = first // s
                if blocks[j] < end:  # inf (a block across roots) stays inf
                    blocks[j] = end


def placing_order(lens: Sequence[int], needs: Sequence[int],
                  at_need: Sequence[float]) -> list[int]:
    """Sample ids widest need first, then slowest at the need, then longest (then lowest id)."""
    return sorted(range(len(lens)), key=lambda i: (-needs[i], -at_need[i], -lens[i], i))


def earliest_finish_plan(
    seq_lens: Sequence[int],
    needs: Sequence[int],
    widest: Callable[[int, int], int],
    *,
    roots: Sequence[tuple[int, int]],
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    cost_model: CostModel,
    microbatch_group_size: int | None = None,
    workloads: Sequence[float] | None = None,
    target: float | None = None,
    widen_above: float | None = None,
    at_need: Sequence[float] | None = None,
    order: Sequence[int] | None = None,
    give_up_at: float | None = None,
    notes: dict | None = None,
) -> Plan | None:
    """Plan a validated batch by earliest finish time (algorithm: module docstring).

    needs[i]: sample i's smallest CP size; widest(L, need): the largest size a sample may get
    (its fastest), asked only for the long samples.
    roots: the root blocks of N (cpkit.dynamic.scheduler.aligned_roots).
    target: a makespan in seconds (step 2), or None for the earliest finish.
    widen_above: samples slower than this at their need may take wider sizes (default: the
    mean load per rank of every sample at its need).
    at_need, order: model.estimate_sample_time(L, need) of every sample and the placing order
    (`placing_order`), when the caller has them.
    give_up_at: return None as soon as a rank's ready time reaches this (ready times only grow,
    so the step time could not be less): for a search that needs only plans faster than the
    best so far.
    notes: if given (with a `target`), set once every sample before the single-rank tail is
    placed: a run with a larger target below notes["same_plan_below"] and a widen_above (no
    smaller) below notes["widen_below"] gives this same plan. Each sample's choice stays while
    the target is below the finish of every other size it tried and, where it took more than
    its need, widen_above stays below its time at the need; a sample that moves into the tail
    took the earliest single rank, as the tail does.
    """
    lens, M, model = seq_lens, max_seq_len_per_rank, cost_model
    n = dp_cp_size
    if at_need is None:
        at_need = [model.estimate_sample_time(L, c) for L, c in zip(lens, needs)]
    if widen_above is None:
        widen_above = sum(t * c for t, c in zip(at_need, needs)) / n  # mean load per rank
    limit = float("inf") if give_up_at is None else give_up_at
    if order is None:
        order = placing_order(lens, needs, at_need)
    times = _ReadyTimes(roots, n)
    ready = times.rank
    last: list[_Group | None] = [None] * n  # the last group of each rank
    next_index = [0] * n  # the first micro-batch a new group of this rank may use
    groups: list[_Group] = []

    def place(i: int, first: int, size: int) -> float:
        g = last[first]
        chunk = -(-lens[i] // size)
        if g is not None and g.first == first and g.size == size and g.tokens + chunk <= M \
                and all(last[r] is g for r in range(first, first + size)):
            old = g.time
            g.samples.append(i)
            g.lens.append(lens[i])
            g.tokens += chunk
            g.time = model.group_time(g.lens, size)
            end = ready[first] + g.time - old
        else:
            index = max(next_index[first:first + size])
            g = _Group(first, size, index)
            g.samples.append(i)
            g.lens.append(lens[i])
            g.tokens = chunk
            g.time = model.group_time([lens[i]], size)
            groups.append(g)
            end = max(ready[first:first + size]) + g.time
        times.set(first, size, end)
        last[first:first + size] = [g] * size
        next_index[first:first + size] = [g.index + 1] * size
        return end

    # Sorted widest need first, then slowest: the single-rank samples that stay on one rank
    # form the tail of `order`; they need only the per-rank ready times (a heap).
    tail = len(order)
    while tail and needs[order[tail - 1]] == 1 and at_need[order[tail - 1]] <= widen_above:
        tail -= 1
    same_below = widen_below = float("inf")
    for i in order[:tail]:
        need = needs[i]
        wide = None if at_need[i] > widen_above else need  # None: asked when needed
        best, size, tried = None, need, []
        while wide is None or size <= wide:
            if size > need and wide is None:
                wide = widest(lens[i], need)
                if size > wide:
                    break
            start, first = times.earliest(size)
            g = last[first]
            if g is not None and g.first == first and g.size == size \
                    and g.tokens + -(-lens[i] // size) <= M \
                    and all(last[r] is g for r in range(first, first + size)):
                # packed into that group: one kernel call for both (start == its ranks' end)
                finish = start + model.group_time(g.lens + [lens[i]], size) - g.time
            else:
                finish = start + model.sample_time(lens[i], size)
            tried.append(finish)
            if target is not None and finish <= target:
                best = (finish, first, size)  # the narrowest size that meets the target
                break
            if best is None or finish < best[0]:
                best = (finish, first, size)
            size *= 2
        if len(tried) > 1:
            chosen = (best[2] // need).bit_length() - 1  # the place of best's size in `tried`
            same_below = min(same_below, *tried[:chosen], *tried[chosen + 1:])
            if best[2] > need:
                widen_below = min(widen_below, at_need[i])
        if place(i, best[1], best[2]) >= limit:
            return None
    if notes is not None and target is not None:
        notes["same_plan_below"], notes["widen_below"] = same_below, widen_below

    heap = times.heap  # ranks by ready time, with stale entries (_ReadyTimes)
    group_time = model._group_time  # group_time without its argument conversions
    for i in order[tail:]:
        start, r = heapq.heappop(heap)
        while ready[r] != start:
            start, r = heapq.heappop(heap)
        L, g = lens[i], last[r]
        if g is not None and g.size == 1 and g.tokens + L <= M:
            g.samples.append(i)
            g.lens.append(L)
            g.tokens += L
            t = group_time(tuple(g.lens), 1)
            end = start + t - g.time
            g.time = t
        else:
            g = _Group(r, 1, next_index[r])
            g.samples.append(i)
            g.lens.append(L)
            g.tokens, g.time = L, group_time((L,), 1)
            groups.append(g)
            end = start + g.time
            last[r], next_index[r] = g, g.index + 1
        if end >= limit:
            return None
        ready[r] = end
        heapq.heappush(heap, (end, r))

    count = max((g.index + 1 for g in groups), default=1)
    step = microbatch_group_size or 1
    count = -(-count // step) * step
    slots: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(count)]
    for g in groups:
        slots[g.index].append((g.first, g.size, g.samples))
    fill_padding(slots)
    return Plan(
        microbatches=tuple(
            Microbatch(groups=tuple(
                CPGroupAssignment(ranks=tuple(range(f, f + k)), samples=tuple(sorted(s)), cp_size=k)
                for f, k, s in sorted(mb)))
            for mb in slots),
        seq_lens=tuple(lens),
        dp_cp_size=n,
        max_seq_len_per_rank=M,
        workloads=tuple(workloads) if workloads is not None else tuple(at_need),
        needed_cp_sizes=tuple(needs),
    )
