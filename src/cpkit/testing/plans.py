"""Dynamic-CP plans written out by hand, for tests that need one exact assignment."""

from __future__ import annotations

from cpkit.dynamic import CPGroupAssignment, Microbatch, Plan, cp_size_for

__all__ = ["hand_plan", "largest_pow2_le"]


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
