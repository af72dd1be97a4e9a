"""Static CP as a plan: every sample at one CP size, data-parallel replicas balanced by step time.

The CP size is the smallest that fits the batch's longest sample (and >= min_cp_size). The DPxCP
ranks form R aligned blocks of that size (DP replicas). Samples, slowest first, go to the replica
with the least modeled time so far (LPT); each replica packs its samples into micro-batches of at
most max_seq_len_per_rank tokens per rank (first fit, longest first), and orders them slowest
first, so that micro-batch m runs every replica's m-th slowest micro-batch (a plan's step time
charges each micro-batch its slowest rank). This is the baseline dynamic CP must beat, and one of
the scheduler's candidates.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from cpkit.dynamic.cost import CostModel
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan

__all__ = ["fill_padding", "static_cp_plan", "static_cp_size"]


def static_cp_size(needs: Sequence[int], min_cp_size: int = 1) -> int:
    """The CP size of static CP: the largest need of the batch (needs from cp_size_for)."""
    return max([min_cp_size, *needs])


def _blocks(dp_cp_size: int, size: int) -> list[int]:
    """First ranks of the aligned blocks of `size` inside the binary decomposition of N."""
    firsts, first = [], 0
    for bit in reversed(range(dp_cp_size.bit_length())):
        root = 1 << bit
        if dp_cp_size & root:
            if root >= size:
                firsts.extend(range(first, first + root, size))
            first += root
    return firsts


def fill_padding(slots: list[list[tuple[int, int, list[int]]]]) -> None:
    """Give every empty micro-batch (padding to microbatch_group_size) a sample while samples
    allow: split one sample off the fullest group into the same block, or move a lone group
    from a micro-batch that has several. `slots[m]` holds (first rank, size, samples) groups."""
    for m, groups in enumerate(slots):
        if groups:
            continue
        donors = [(len(g[2]), -k, -j) for k, mb in enumerate(slots) for j, g in enumerate(mb)
                  if len(g[2]) >= 2]
        if donors:
            _, neg_k, neg_j = max(donors)
            first, size, samples = slots[-neg_k][-neg_j]
            groups.append((first, size, [samples.pop()]))
            continue
        crowded = [k for k, mb in enumerate(slots) if len(mb) >= 2]
        if crowded:
            groups.append(slots[crowded[0]].pop())


def static_cp_plan(
    seq_lens: Sequence[int],
    needs: Sequence[int],
    *,
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    cost_model: CostModel,
    min_cp_size: int = 1,
    microbatch_group_size: int | None = None,
    workloads: Sequence[float] | None = None,
) -> Plan:
    """Static-CP plan of a validated batch (algorithm: module docstring).

    `needs[i]` is sample i's smallest CP size (cp_size_for); `workloads` only fills the plan's
    field of that name (default: each sample's modeled time at the static size).
    """
    lens, M = list(seq_lens), max_seq_len_per_rank
    cp = static_cp_size(needs, min_cp_size)
    firsts = _blocks(dp_cp_size, cp)
    times = [cost_model.estimate_sample_time(L, cp) for L in lens]
    order = sorted(range(len(lens)), key=lambda i: (-times[i], -lens[i], i))
    heap = [(0.0, r) for r in range(len(firsts))]
    per_replica: list[list[int]] = [[] for _ in firsts]
    for i in order:
        load, r = heapq.heappop(heap)
        per_replica[r].append(i)
        heapq.heappush(heap, (load + times[i], r))
    replica_bins = []
    for samples in per_replica:
        bins: list[list] = []  # [tokens per rank, sample ids]
        for i in sorted(samples, key=lambda i: (-lens[i], i)):
            t = -(-lens[i] // cp)
            for b in bins:
                if b[0] + t <= M:
                    b[0] += t
                    b[1].append(i)
                    break
            else:
                bins.append([t, [i]])
        keyed = [(cost_model.group_time([lens[i] for i in b[1]], cp), b[1]) for b in bins]
        keyed.sort(key=lambda kb: (-kb[0], kb[1]))
        replica_bins.append([sorted(b) for _, b in keyed])
    count = max(len(b) for b in replica_bins)
    group = microbatch_group_size or 1
    count = -(-count // group) * group
    slots = [[(f, cp, bins[m]) for f, bins in zip(firsts, replica_bins) if m < len(bins)]
             for m in range(count)]
    fill_padding(slots)
    microbatches = tuple(
        Microbatch(groups=tuple(
            CPGroupAssignment(ranks=tuple(range(f, f + k)), samples=tuple(sorted(s)), cp_size=k)
            for f, k, s in sorted(groups)))
        for groups in slots)
    return Plan(
        microbatches=tuple(microbatches),
        seq_lens=tuple(lens),
        dp_cp_size=dp_cp_size,
        max_seq_len_per_rank=M,
        workloads=tuple(workloads) if workloads is not None else tuple(times),
        needed_cp_sizes=tuple(needs),
    )
