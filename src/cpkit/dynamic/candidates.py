"""Reference plans the scheduler weighs against its own, and the choice.

Pure Python. cpkit's own plans (cpkit.dynamic.scheduler: static CP, earliest finish, the target
searches, the balancer) are only as good as the step-time model that ranks them, so plans of
other schedulers compete with them on the same model, and cpkit takes the modeled fastest; plans
tied within TIE_BAND go to the most robust (fewest runtime micro-batches, then CP switches), then
a reference before its own (`choose_plan`).

References:
- `fill_to_capacity_plan`: fewer, fuller micro-batches, the trait of Megatron-LM dev's plans,
  which beat cpkit's emptier ones in an early real-step run that kept no evidence folder; in the
  recorded real steps cpkit chose this plan or Megatron-LM's in every batch (claim
  `dynamic-real-step` in cards/dynamic-context-parallel/card.yaml). cpkit's own
  first-fit packing, not a port: samples, widest need first, then longest, each into the first
  micro-batch with an aligned block of its need that has room (a free block, or a group of the
  same block with room for its tokens), taking the option that leaves the fewest tokens on the
  fullest rank; a new micro-batch when none has room.
- the caller's plans (`reference_plans` of cpkit.dynamic.scheduler.schedule): MCore's
  BalancedCPScheduler, Megatron-LM's DefaultDynamicCPScheduler (cpkit.dynamic.mcore,
  cpkit.dynamic.mlm), which need MCore or a checkout and so are not made here. They must plan
  the same batch (`usable_references`); one that breaks an invariant of
  cpkit.dynamic.invariants (MCore's and Megatron-LM's plans do at some DPxCP sizes) or puts a
  sample below its needed CP size is never taken.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.errors import CPConfigError

__all__ = ["choose_plan", "error_band_text", "fill_to_capacity_plan", "robustness", "TIE_BAND", "usable_references",
           "validated_band"]

TIE_BAND = 0.0
"""Plans modeled within this fraction of the fastest count as tied (then the most robust wins).
0: the model's ranking decides. `python -m cpkit.bench.dynamic.dynamic_step_order` over the real steps
of 10 bench runs (evidence/2026-11-27-4xH200-5b27ec5/, evidence/2026-11-28-2xH200-61901e3/,
evidence/2026-11-28-2xH200-d9dd766/): of 35 plan pairs modeled within 10% of each other and
really more than 1% apart, the model ordered 31 right, and the more robust of a pair won 8 of
25; over their 32 batches cpkit's choice took 1.0118x the best real step (worst 1.115x), the
modeled fastest 1.0039x (worst 1.086x): the 4 batches where they differ are robustness picks."""
def validated_band() -> tuple[float | None, str]:
    """(the largest |modeled / real - 1| of the step model's step over every plan and batch of the
    last `python -m cpkit.bench dynamic_step` runs at the current calibration code, both model
    sizes, or None where no such run exists; where it was measured: the evidence folder, or why
    there is none). Kept in a function's body, so that a new run's figure changes one function
    (`cpkit validate --changed` then selects its tests, not every test that imports the module).

    24.6% at 4ddbc47 (host-bound model, every plan of one batch +18.8% to +24.6% alike), -23.5%
    at 37c0956; 0.066 and 0.114 on the default, GPU-bound model. On 4 GPUs, before the
    calibration was timed back to back (5b27ec5): 0.193."""
    return 0.246, "2x H200, 2 model sizes: evidence/2026-11-29-2xH200-4ddbc47/ (and evidence/2026-11-28-2xH200-37c0956/)"


def error_band_text() -> str:
    """The validated error band of modeled step times, for every printed ratio."""
    error, where = validated_band()
    if error is None:
        return f"error band: {where}"
    return f"error band +-{error:.0%}, {where}"


def _blocks(dp_cp_size: int, size: int) -> list[int]:
    """First ranks of the aligned blocks of `size` inside [0, dp_cp_size)."""
    return [f for f in range(0, dp_cp_size, size) if f + size <= dp_cp_size]


def fill_to_capacity_plan(seq_lens: Sequence[int], needs: Sequence[int], *, dp_cp_size: int,
                          max_seq_len_per_rank: int,
                          workloads: Optional[Sequence[float]] = None,
                          microbatch_group_size: Optional[int] = None) -> Plan:
    """Fewer, fuller micro-batches (module docstring); every sample at its needed CP size.

    seq_lens / needs: per sample (needs from cpkit.dynamic.scheduler.needed_cp_sizes, which
    validates them). No rank holds more than max_seq_len_per_rank tokens (ceil(L / c) per sample).
    microbatch_group_size (VPP's multiple) is not honored: the caller offers this plan without VPP.
    """
    del microbatch_group_size
    lens, M = [int(L) for L in seq_lens], int(max_seq_len_per_rank)
    order = sorted(range(len(lens)), key=lambda i: (-needs[i], -lens[i], i))
    mbs: list[dict[int, list]] = []  # per micro-batch: first rank -> [cp, samples, tokens per rank]
    owners: list[list[Optional[int]]] = []
    for s in order:
        c, need_tokens = needs[s], -(-lens[s] // needs[s])
        placed = False
        for groups, owner in zip(mbs, owners):
            options = [(g[2] + need_tokens, f) for f, g in groups.items()
                       if g[0] == c and g[2] + need_tokens <= M]
            options += [(need_tokens, f) for f in _blocks(dp_cp_size, c)
                        if all(owner[r] is None for r in range(f, f + c))]
            if options:
                _, f = min(options)
                if f not in groups:
                    groups[f] = [c, [], 0]
                    for r in range(f, f + c):
                        owner[r] = f
                groups[f][1].append(s)
                groups[f][2] += need_tokens
                placed = True
                break
        if not placed:
            f = _blocks(dp_cp_size, c)[0]
            mbs.append({f: [c, [s], need_tokens]})
            owners.append([f if f <= r < f + c else None for r in range(dp_cp_size)])
    microbatches = tuple(Microbatch(tuple(CPGroupAssignment(tuple(range(f, f + g[0])), tuple(g[1]), g[0])
                                          for f, g in sorted(groups.items())))
                         for groups in mbs)
    return Plan(microbatches=microbatches, seq_lens=tuple(lens), dp_cp_size=dp_cp_size,
                max_seq_len_per_rank=M,
                workloads=tuple(workloads) if workloads is not None else tuple(float(L) for L in lens),
                needed_cp_sizes=tuple(needs), candidate="fill", packed=True)


def usable_references(references: Optional[Mapping[str, Plan]], seq_lens: Sequence[int],
                      needs: Sequence[int], *, dp_cp_size: int, max_seq_len_per_rank: int,
                      microbatch_group_size: Optional[int] = None) -> dict[str, Plan]:
    """The caller's reference plans that may be taken (name -> Plan). Each must plan this batch:
    CPConfigError names one with other seq_lens, dp_cp_size or max_seq_len_per_rank. A plan that
    breaks an invariant (cpkit.dynamic.invariants.plan_violations) or puts a sample on fewer
    ranks than its need (min_cp_size included) is left out: cpkit never runs a plan it would
    reject from its own scheduler."""
    from cpkit.dynamic.invariants import plan_violations

    usable = {}
    for name, plan in (references or {}).items():
        if plan is None:
            continue
        batch = (tuple(plan.seq_lens), plan.dp_cp_size, plan.max_seq_len_per_rank)
        if batch != (tuple(seq_lens), dp_cp_size, max_seq_len_per_rank):
            raise CPConfigError.single(
                f"reference_plans[{name!r}]", f"seq_lens of {len(plan.seq_lens)} samples, dp_cp_size "
                f"{plan.dp_cp_size}, max_seq_len_per_rank {plan.max_seq_len_per_rank}",
                "must plan the same seq_lens, dp_cp_size and max_seq_len_per_rank as schedule()",
                "plan the batch handed to schedule() with the other scheduler, or leave it out")
        below_need = any(g.cp_size < needs[s] for mb in plan.microbatches for g in mb.groups for s in g.samples)
        if not below_need and not plan_violations(plan, microbatch_group_size):
            usable[name] = plan
    return usable


def robustness(plan: Plan) -> tuple[int, int]:
    """(micro-batches the runtime runs, CP switches of the rank that switches most): each is a
    place where a real step pays what a model can miss (a micro-batch's fixed host cost, a
    group change), so of plans the model cannot tell apart the one with fewer is the safer."""
    from cpkit.dynamic.step_model import runtime_segments

    segments, _ = runtime_segments(plan)
    mbs = [mb for seg in segments for mb in seg]
    switches = 0
    for r in range(plan.dp_cp_size):
        sizes = [g.cp_size for mb in mbs for g in mb.groups if r in g.ranks]
        switches = max(switches, sum(a != b for a, b in zip(sizes, sizes[1:])))
    return len(mbs), switches


def choose_plan(own: tuple[float, str, Plan], references: Mapping[str, Plan], step_time,
                static_time: float, band: float = TIE_BAND) -> tuple[float, str, Plan]:
    """(modeled time, name, plan) to run, of cpkit's `own` (time, name, plan) and the
    `references` timed by `step_time(plan)`; a reference modeled slower than `static_time`
    (static CP) is never taken, so the choice is never modeled slower than static.

    The modeled fastest; of plans tied within `band` of it (TIE_BAND: exact ties), the most
    robust (`robustness`: fewest runtime micro-batches, then fewest CP switches), then a
    reference before cpkit's own (fuller plans; see fill_to_capacity_plan's reasons), then the
    fastest modeled."""
    timed = [(step_time(p), name, p) for name, p in references.items() if p is not None]
    eligible = [(*own, 1)] + [(t, name, p, 0) for t, name, p in timed if t <= static_time]
    fastest = min(t for t, *_ in eligible)
    near = [c for c in eligible if c[0] <= fastest * (1.0 + band)]
    t, name, plan, _ = min(near, key=lambda c: (*robustness(c[2]), c[3], c[0], c[1]))
    return t, name, plan
