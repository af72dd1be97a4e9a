"""A plan as the work each rank really does: local tokens and the ring's attention calls.

Pure Python (no torch): the replay's plan-to-work translation, tested on CPU.

What cpkit's runtime does with one CP group of c ranks (cpkit.dynamic.runtime.pack_thd,
cpkit.attention.p2p): its samples are packed into one THD sequence, each padded at its end to a
multiple of 2c (cpkit.sharding.pad_cu_seqlens; also at c = 1), and every rank keeps two chunks
of P / (2c) tokens of each padded sample of length P (the zigzag layout), so every rank of the
group holds T = sum(P) / c tokens. Per layer, the p2p ring runs c steps forward and c backward;
rank r's block at forward step s is the KV of src = (r - s) mod c, and one kernel call covers
every packed sample (varlen):

- "diag" (src == r): causal, q and k both chunks of every sample (2h tokens each, h = P / (2c));
- "kv_first" (src < r): no mask, q both chunks (2h) against k's first chunk (h);
- "q_second" (src > r): no mask, q's second chunk (h) against both of k's chunks (2h).

Backward runs the same blocks, src = (r + s + 1) mod c at step s. A group of c = 1 runs one
causal call over whole padded samples. A plan with packed=False (MCore's hybrid schedule) runs a
group's samples one after another, each alone: one pass per sample instead of one per group.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttnCall", "GroupPass", "RankWork", "padded", "plan_work", "rank_work"]

DIAG, KV_FIRST, Q_SECOND = "diag", "kv_first", "q_second"


def padded(seq_len: int, cp_size: int) -> int:
    """A sample's length in the runtime's THD layout: rounded up to a multiple of 2 * cp_size."""
    m = 2 * cp_size
    return -(-seq_len // m) * m


@dataclass(frozen=True)
class AttnCall:
    """One varlen kernel call of a ring step: `kind` (diag, kv_first, q_second) over samples
    whose chunks hold `chunks[i]` tokens (P_i / (2c)); c = 1: one diag call, chunks P_i / 2."""

    kind: str
    chunks: tuple[int, ...]

    @property
    def q_lens(self) -> tuple[int, ...]:
        """Query tokens per sample of the call."""
        return tuple(h if self.kind == Q_SECOND else 2 * h for h in self.chunks)

    @property
    def k_lens(self) -> tuple[int, ...]:
        """Key tokens per sample of the call."""
        return tuple(h if self.kind == KV_FIRST else 2 * h for h in self.chunks)

    @property
    def causal(self) -> bool:
        """Only the diagonal block is masked."""
        return self.kind == DIAG


@dataclass(frozen=True)
class RankWork:
    """One rank's work in one pass of its group (per layer: the GEMMs over `tokens` local tokens,
    the ring's calls in forward step order and in backward step order)."""

    tokens: int
    forward: tuple[AttnCall, ...]
    backward: tuple[AttnCall, ...]


@dataclass(frozen=True)
class GroupPass:
    """One forward/backward of one CP group: its ranks, their work, the KV bytes' token count."""

    ranks: tuple[int, ...]
    cp_size: int
    samples: tuple[int, ...]
    work: tuple[RankWork, ...]  # one per rank of the group, in group order

    @property
    def tokens(self) -> int:
        """Local tokens of every rank of the group (all ranks hold the same count)."""
        return self.work[0].tokens


def _case(src: int, rank: int) -> str:
    if src == rank:
        return DIAG
    return KV_FIRST if src < rank else Q_SECOND


def rank_work(seq_lens: tuple[int, ...] | list[int], cp_size: int, rank: int) -> RankWork:
    """The work of CP rank `rank` of a group of `cp_size` running the packed `seq_lens`."""
    c = cp_size
    chunks = tuple(padded(L, c) // (2 * c) for L in seq_lens)
    tokens = 2 * sum(chunks)
    fwd = tuple(AttnCall(_case((rank - s) % c, rank), chunks) for s in range(c))
    bwd = tuple(AttnCall(_case((rank + s + 1) % c, rank), chunks) for s in range(c))
    return RankWork(tokens=tokens, forward=fwd, backward=bwd)


def _group_passes(lens: list[int], group, packed: bool) -> list[GroupPass]:
    runs = [tuple(lens[s] for s in group.samples)] if packed else \
        [(lens[s],) for s in group.samples]
    ids = [tuple(group.samples)] if packed else [(s,) for s in group.samples]
    return [GroupPass(ranks=tuple(group.ranks), cp_size=group.cp_size, samples=i,
                      work=tuple(rank_work(run, group.cp_size, r) for r in range(group.cp_size)))
            for run, i in zip(runs, ids)]


def plan_work(plan) -> list[list[list[GroupPass]]]:
    """Per micro-batch, per group of the plan (a cpkit.dynamic.plan.Plan): the group's passes
    in the order they run (one packed pass, or one per sample when plan.packed is False)."""
    lens = list(plan.seq_lens)
    return [[_group_passes(lens, g, plan.packed) for g in mb.groups] for mb in plan.microbatches]
