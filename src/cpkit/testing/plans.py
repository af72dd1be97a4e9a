"""Dynamic-CP plans written out by hand, for tests that need one exact assignment."""

from __future__ import annotations

from cpkit.dynamic import CPGroupAssignment, Microbatch, Plan, cp_size_for

__all__ = ["MIXED_CP_LENS", "MIXED_CP_MAX_PER_RANK", "hand_plan", "largest_pow2_le", "mixed_cp_plan"]


def hand_plan(groups_per_mb, lens, dp_cp_size: int, max_seq_len_per_rank: int = 64) -> Plan:
    """A Plan with micro-batch m's CP groups given as `groups_per_mb[m]` = [(ranks, sample ids),
    ...], samples of lengths `lens`, workloads length^2 and the CP size each length needs."""
    mbs = tuple(Microbatch(tuple(CPGroupAssignment(tuple(r), tuple(s), len(r)) for r, s in mb))
                for mb in groups_per_mb)
    return Plan(microbatches=mbs, seq_lens=tuple(lens), dp_cp_size=dp_cp_size,
                max_seq_len_per_rank=max_seq_len_per_rank, workloads=tuple(float(n * n) for n in lens),
                needed_cp_sizes=tuple(cp_size_for(n, max_seq_len_per_rank) for n in lens))


def largest_pow2_le(n: int) -> int:
    """The largest power of two <= n (n >= 1), counted by doubling: the tests' own arithmetic for
    the widest aligned CP group of n ranks, apart from the scheduler's."""
    k = 1
    while k * 2 <= n:
        k *= 2
    return k


MIXED_CP_LENS = tuple(n * 16 - 3 for n in (13, 54, 11, 29, 8, 26, 12, 10, 11))
"""functional/test_dynamic_cp.py's mixed lengths at GPU scale (x16), minus 3 so THD pads them."""
MIXED_CP_MAX_PER_RANK = 24 * 16


def mixed_cp_plan() -> Plan:
    """MIXED_CP_LENS on 4 ranks at CP sizes 4, 2 and 1, written out rather than searched (the
    scheduler is free to prefer another plan, e.g. everything at CP 4, and a test of mixed CP
    sizes must not depend on its preference): the longest sample (861) on all four ranks, 461
    and 413 on a pair each, the rest one or two per rank; every rank holds at most
    MIXED_CP_MAX_PER_RANK tokens per micro-batch."""
    groups = [
        [((0, 1, 2, 3), (1,))],
        [((0, 1), (3,)), ((2, 3), (5,))],
        [((0,), (0,)), ((1,), (2,)), ((2,), (4, 6)), ((3,), (7, 8))],
    ]
    return hand_plan(groups, MIXED_CP_LENS, 4, MIXED_CP_MAX_PER_RANK)
