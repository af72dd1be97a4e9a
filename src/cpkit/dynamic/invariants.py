"""The invariants every dynamic-CP plan must keep, checked from the plan alone.

Used for every implementation (cpkit's scheduler, MCore's BalancedCPScheduler through
cpkit.dynamic.mcore, Megatron-LM's DefaultDynamicCPScheduler through cpkit.dynamic.mlm), by `cpkit schedule` and by the property tests. Properties:

- `each-sample-once`: every sample id in exactly one group of one micro-batch;
- `aligned-groups`: a group is a contiguous block of ranks whose size is a power of two, aligned
  to its size (first % size == 0) and inside one root block of N's binary decomposition, so the
  registry (cpkit.dynamic.registry) created it up front; with `full_group_fallback`, the group
  of all N ranks is accepted too (Megatron-LM's documented fallback; its parallel_state hands
  out the DPxCP group for a group of N ranks);
- `disjoint-groups`: no rank in two groups of one micro-batch;
- `fits-memory`: no rank holds more than max_seq_len_per_rank tokens: sum of ceil(L / cp) over a
  packed group's samples, the largest ceil(L / cp) when they run one at a time (plan.packed);
- `microbatch-multiple`: the micro-batch count is a multiple of microbatch_group_size;
- `deterministic`: the same input gives the same plan (checked by the caller, which runs twice);
- `no-crash`: the scheduler returned (reported by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpkit.dynamic.plan import Plan

__all__ = ["PROPERTIES", "PlanViolation", "plan_violations"]

PROPERTIES = ("each-sample-once", "aligned-groups", "disjoint-groups", "fits-memory",
              "microbatch-multiple", "deterministic", "no-crash")


@dataclass(frozen=True)
class PlanViolation:
    """One broken invariant: its name (PROPERTIES) and the first offending place, in one line."""

    property: str
    detail: str

    def to_dict(self) -> dict:
        """{"property": ..., "detail": ...}."""
        return {"property": self.property, "detail": self.detail}


def _roots(n: int) -> list[tuple[int, int]]:
    roots, first = [], 0
    for bit in reversed(range(n.bit_length())):
        if n & (1 << bit):
            roots.append((first, 1 << bit))
            first += 1 << bit
    return roots


def _block_problem(ranks: tuple[int, ...], n: int, full_group_fallback: bool) -> str | None:
    k = len(ranks)
    if k == 0:
        return "has no ranks"
    if full_group_fallback and ranks == tuple(range(n)):
        return None
    if ranks != tuple(range(ranks[0], ranks[0] + k)):
        return "is not a contiguous block"
    if k & (k - 1):
        return f"has {k} ranks, not a power of two"
    if ranks[0] % k:
        return f"starts at rank {ranks[0]}, not a multiple of its size {k}"
    if not any(f <= ranks[0] and ranks[-1] < f + s for f, s in _roots(n)):
        return f"crosses a root block of dp_cp_size={n} ({_roots(n)})"
    return None


def _span(ranks) -> str:
    return f"[{ranks[0]}..{ranks[-1]}]" if ranks else "[]"


def plan_violations(plan: Plan, microbatch_group_size: int | None = None, *,
                    full_group_fallback: bool = False) -> list[PlanViolation]:
    """Every broken invariant of `plan` (at most one per property: the first place found).
    `full_group_fallback`: accept the group of all dp_cp_size ranks (see aligned-groups)."""
    n, M, lens = plan.dp_cp_size, plan.max_seq_len_per_rank, plan.seq_lens
    found: dict[str, str] = {}

    def report(prop: str, detail: str) -> None:
        found.setdefault(prop, detail)

    seen = [0] * len(lens)
    for m, mb in enumerate(plan.microbatches):
        owner: dict[int, tuple[int, ...]] = {}
        for g in mb.groups:
            where = f"micro-batch {m}: group {_span(g.ranks)}"
            problem = _block_problem(tuple(g.ranks), n, full_group_fallback)
            if problem is None and g.cp_size != len(g.ranks):
                problem = f"says cp_size {g.cp_size} but has {len(g.ranks)} ranks"
            if problem:
                report("aligned-groups", f"{where} {problem}")
            if not g.samples:
                report("each-sample-once", f"{where} has no samples")
            for r in g.ranks:
                if not 0 <= r < n:
                    report("aligned-groups", f"{where} names rank {r}, outside [0, {n})")
                elif r in owner:
                    report("disjoint-groups", f"micro-batch {m}: rank {r} is in groups "
                                              f"{_span(owner[r])} and {_span(g.ranks)}")
                else:
                    owner[r] = g.ranks
            size = max(1, len(g.ranks))
            tokens = 0
            for s in g.samples:
                if 0 <= s < len(lens):
                    seen[s] += 1
                    t = -(-lens[s] // size)
                    tokens = tokens + t if plan.packed else max(tokens, t)
                else:
                    report("each-sample-once", f"{where} names sample {s}, outside "
                                               f"[0, {len(lens)})")
            if tokens > M:
                report("fits-memory", f"{where} holds {tokens} tokens per rank > "
                                      f"max_seq_len_per_rank={M}")
    missing = [s for s, c in enumerate(seen) if c == 0]
    twice = [s for s, c in enumerate(seen) if c > 1]
    if missing:
        report("each-sample-once", f"sample {missing[0]} (length {lens[missing[0]]}) is in no "
                                   f"group ({len(missing)} missing)")
    if twice:
        report("each-sample-once", f"sample {twice[0]} (length {lens[twice[0]]}) is in "
                                   f"{seen[twice[0]]} groups ({len(twice)} duplicated)")
    group = microbatch_group_size or 1
    if len(plan.microbatches) % group:
        report("microbatch-multiple", f"{len(plan.microbatches)} micro-batches, not a multiple "
                                      f"of microbatch_group_size={group}")
    return [PlanViolation(p, found[p]) for p in PROPERTIES if p in found]
