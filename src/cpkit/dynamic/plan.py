"""The dynamic-CP plan: micro-batches of CP groups, per-rank views and balance figures.

Ranks are positions 0..N-1 in the DPxCP group (N = dp_cp_size), not global ranks; the group
registry (cpkit.dynamic.registry) maps a block of positions to its process group. Sample ids are
indices into the scheduled `seq_lens`.

Balance figures count compute only (the modeled step time is cpkit.dynamic.cost's, in
plan.step_time_s): sample i has total workload w_i; a group of size k running
samples S costs sum(w_i for i in S) / k on each of its k ranks, and holds
sum(ceil(L_i / k) for i in S) tokens on each rank. Balance figures:

- load(r, m): the cost of rank r in micro-batch m (0 when r has no group there).
- imbalance(m) = max_r load(r, m) / mean_r load(r, m), the mean over all N ranks (1.0 when empty).
- ideal critical path = sum_i w_i / N: every rank equally busy, no idle time.
- actual critical path = sum_m max_r load(r, m): each micro-batch waits for its slowest rank.
- critical_path_efficiency = ideal / actual (1.0 = perfect balance).
- token_fill(m) = tokens held by all ranks in micro-batch m / (N * max_seq_len_per_rank): how much
  of the memory budget the micro-batch uses (fewer, fuller micro-batches waste less per-step
  overhead, which the cost model does not see).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from cpkit.errors import CPConfigError

__all__ = ["CPGroupAssignment", "Microbatch", "Plan", "PlanStats", "assign_slots"]


@dataclass(frozen=True)
class CPGroupAssignment:
    """One CP group in one micro-batch.

    `ranks` is a contiguous block of DPxCP positions aligned to its size (first % cp_size == 0),
    so it matches a group the registry created up front. `samples` are packed together (THD) and
    each one is sharded over all `cp_size` ranks of the block.
    """

    ranks: tuple[int, ...]
    samples: tuple[int, ...]
    cp_size: int

    @property
    def first_rank(self) -> int:
        """The lowest DPxCP position of the block (the registry's lookup key with cp_size)."""
        return self.ranks[0]

    def to_dict(self) -> dict:
        """JSON form: {"ranks": [...], "samples": [...], "cp_size": k}."""
        return {"ranks": list(self.ranks), "samples": list(self.samples), "cp_size": self.cp_size}


@dataclass(frozen=True)
class Microbatch:
    """The CP groups of one micro-batch; they never share a rank."""

    groups: tuple[CPGroupAssignment, ...]

    @property
    def samples(self) -> tuple[int, ...]:
        """All sample ids of the micro-batch, group by group."""
        return tuple(s for g in self.groups for s in g.samples)

    def to_dict(self) -> dict:
        """JSON form: {"groups": [...]}."""
        return {"groups": [g.to_dict() for g in self.groups]}


def assign_slots(
    groups: tuple[CPGroupAssignment, ...] | list[CPGroupAssignment], dp_cp_size: int
) -> list[CPGroupAssignment | None]:
    """Rank slot table of one micro-batch: slot r holds the group that rank r belongs to, or None.

    Raises CPConfigError if a group names a rank outside [0, dp_cp_size) or a rank whose slot is
    already taken (a group never silently overwrites another).
    """
    slots: list[CPGroupAssignment | None] = [None] * dp_cp_size
    for group in groups:
        for r in group.ranks:
            if not 0 <= r < dp_cp_size:
                raise CPConfigError.single(
                    "ranks", list(group.ranks), f"rank {r} is outside [0, {dp_cp_size})",
                    "build groups from positions inside the DPxCP group",
                )
            if slots[r] is not None:
                raise CPConfigError.single(
                    "ranks", list(group.ranks),
                    f"rank {r} is already in group {list(slots[r].ranks)} of this micro-batch",
                    "give every rank at most one group per micro-batch",
                )
            slots[r] = group
    return slots


@dataclass(frozen=True)
class PlanStats:
    """Balance figures of a plan (definitions in the module docstring)."""

    num_microbatches: int
    max_load: tuple[float, ...]
    mean_load: tuple[float, ...]
    imbalance: tuple[float, ...]
    ideal_critical_path: float
    actual_critical_path: float
    critical_path_efficiency: float
    max_tokens_per_rank: int
    idle_rank_slots: int
    expanded_samples: int
    token_fill: tuple[float, ...]

    @property
    def mean_token_fill(self) -> float:
        """Mean over micro-batches of token_fill (0.0 for a plan without micro-batches)."""
        return sum(self.token_fill) / len(self.token_fill) if self.token_fill else 0.0

    @property
    def median_imbalance(self) -> float:
        """Median over micro-batches of max/mean load (1.0 for a plan without micro-batches)."""
        return statistics.median(self.imbalance) if self.imbalance else 1.0

    def to_dict(self) -> dict:
        """JSON form (lists for the per-micro-batch figures)."""
        return {
            "num_microbatches": self.num_microbatches,
            "ideal_critical_path": self.ideal_critical_path,
            "actual_critical_path": self.actual_critical_path,
            "critical_path_efficiency": self.critical_path_efficiency,
            "median_imbalance": self.median_imbalance,
            "imbalance": list(self.imbalance),
            "max_load": list(self.max_load),
            "mean_load": list(self.mean_load),
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "idle_rank_slots": self.idle_rank_slots,
            "expanded_samples": self.expanded_samples,
            "token_fill": list(self.token_fill),
            "mean_token_fill": self.mean_token_fill,
        }


@dataclass(frozen=True)
class Plan:
    """A schedule of one global batch over the DPxCP ranks (see cpkit.dynamic.scheduler.schedule).

    `workloads[i]` is sample i's total workload; `needed_cp_sizes[i]` the smallest CP size its
    length allows (cp_size_for); a group may be larger than a sample needs (to fill or balance).
    `step_time_s` / `static_step_time_s`: modeled seconds of this plan and of static CP
    (cpkit.dynamic.cost), set by the scheduler; `candidate` names the plan it chose. `packed`:
    a group's samples run packed in one forward/backward (cpkit); False: one after another, a
    forward/backward each (MCore's hybrid CP schedule), so memory holds one sample at a time.
    """

    microbatches: tuple[Microbatch, ...]
    seq_lens: tuple[int, ...]
    dp_cp_size: int
    max_seq_len_per_rank: int
    workloads: tuple[float, ...]
    needed_cp_sizes: tuple[int, ...]
    step_time_s: float | None = None
    static_step_time_s: float | None = None
    candidate: str | None = None
    packed: bool = True
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _check_microbatch_index(self, microbatch_index: int) -> None:
        # No negative indexing: -1 silently meaning "the last micro-batch" hides caller bugs.
        if not (isinstance(microbatch_index, int) and 0 <= microbatch_index < len(self.microbatches)):
            raise CPConfigError.single(
                "microbatch_index", microbatch_index,
                f"must be an int in [0, {len(self.microbatches)})",
                "iterate over range(len(plan.microbatches))",
            )

    def _slots(self, microbatch_index: int) -> list[CPGroupAssignment | None]:
        self._check_microbatch_index(microbatch_index)
        if microbatch_index not in self._cache:
            groups = self.microbatches[microbatch_index].groups
            self._cache[microbatch_index] = assign_slots(groups, self.dp_cp_size)
        return self._cache[microbatch_index]

    def assignment_for_rank(self, rank: int, microbatch_index: int) -> CPGroupAssignment | None:
        """The group that DPxCP position `rank` runs in micro-batch `microbatch_index`, or None
        when the rank is idle there. Raises CPConfigError for an index out of range (negative
        indices included)."""
        if not (isinstance(rank, int) and 0 <= rank < self.dp_cp_size):
            raise CPConfigError.single(
                "rank", rank, f"must be an int in [0, {self.dp_cp_size})",
                "pass the position of this rank in the DPxCP group",
            )
        return self._slots(microbatch_index)[rank]

    def samples_per_rank(self, microbatch_index: int) -> list[list[int]]:
        """Sample ids each rank works on in one micro-batch: one new, independent list per rank."""
        return [list(g.samples) if g else [] for g in self._slots(microbatch_index)]

    def rank_loads(self, microbatch_index: int) -> list[float]:
        """Per-rank cost in one micro-batch (0.0 for an idle rank)."""
        loads = [0.0] * self.dp_cp_size
        self._slots(microbatch_index)  # checks the index, and that no two groups share a rank
        for g in self.microbatches[microbatch_index].groups:
            per_rank = sum(self.workloads[s] for s in g.samples) / g.cp_size
            for r in g.ranks:
                loads[r] = per_rank
        return loads

    def rank_tokens(self, microbatch_index: int) -> list[int]:
        """Per-rank token count in one micro-batch: sum of ceil(L / cp_size) over its group's samples."""
        tokens = [0] * self.dp_cp_size
        self._slots(microbatch_index)  # checks the index, and that no two groups share a rank
        for g in self.microbatches[microbatch_index].groups:
            per_rank = sum(-(-self.seq_lens[s] // g.cp_size) for s in g.samples)
            for r in g.ranks:
                tokens[r] = per_rank
        return tokens

    def locate(self, sample_id: int) -> tuple[int, CPGroupAssignment]:
        """(micro-batch index, group) that runs `sample_id`; raises CPConfigError if none does."""
        for m, mb in enumerate(self.microbatches):
            for g in mb.groups:
                if sample_id in g.samples:
                    return m, g
        raise CPConfigError.single(
            "sample_id", sample_id, f"is not in the plan ({len(self.seq_lens)} samples)",
            "pass an index into the scheduled seq_lens",
        )

    @cached_property
    def stats(self) -> PlanStats:
        """Balance figures (computed once)."""
        n = self.dp_cp_size
        max_load, mean_load, imbalance, fill = [], [], [], []
        max_tokens, idle = 0, 0
        for m, mb in enumerate(self.microbatches):
            loads = self.rank_loads(m)
            top, mean = max(loads), sum(loads) / n
            max_load.append(top)
            mean_load.append(mean)
            imbalance.append(top / mean if mean > 0 else 1.0)
            tokens = self.rank_tokens(m)
            max_tokens = max(max_tokens, max(tokens))
            fill.append(sum(tokens) / (n * self.max_seq_len_per_rank))
            idle += sum(1 for g in self._slots(m) if g is None)
        ideal = sum(self.workloads) / n
        actual = sum(max_load)
        expanded = sum(
            1 for mb in self.microbatches for g in mb.groups for s in g.samples
            if g.cp_size > self.needed_cp_sizes[s]
        )
        return PlanStats(
            num_microbatches=len(self.microbatches),
            max_load=tuple(max_load),
            mean_load=tuple(mean_load),
            imbalance=tuple(imbalance),
            ideal_critical_path=ideal,
            actual_critical_path=actual,
            critical_path_efficiency=ideal / actual if actual > 0 else 1.0,
            max_tokens_per_rank=max_tokens,
            idle_rank_slots=idle,
            expanded_samples=expanded,
            token_fill=tuple(fill),
        )

    def to_dict(self) -> dict[str, Any]:
        """{"microbatches": [{"groups": [{"ranks", "samples", "cp_size"}]}], "stats": {...}};
        stats carries the modeled step times when the scheduler set them."""
        stats = self.stats.to_dict()
        if self.step_time_s is not None:
            stats["modeled_step_time_s"] = self.step_time_s
            stats["candidate"] = self.candidate
        if self.static_step_time_s is not None:
            stats["static_step_time_s"] = self.static_step_time_s
            stats["speedup_vs_static"] = (self.static_step_time_s / self.step_time_s
                                          if self.step_time_s else 1.0)
        return {"microbatches": [mb.to_dict() for mb in self.microbatches], "stats": stats}
