"""`a2a+p2p` (hierarchical CP): Ulysses all-to-all inside the a2a group, ring across p2p.

TE's convention: `cp_group = [a2a_group, p2p_group]`; the CP group's ranks are split into
blocks of A = |a2a_group| consecutive ranks (the a2a groups) and the p2p groups take one rank
of every block (strided). A rank's position in the whole CP group, which decides its sequence
shard, is p2p_rank * A + a2a_rank. After the all-to-all a rank holds h/A heads of the sequence
shard of its whole a2a block, which is the zigzag shard of the p2p level (2P chunks of A
original chunks each), so the ring runs unchanged over the p2p group.

`new_hierarchical_groups` builds such groups for tests; production code gets them from
`cpkit.groups` (MCore's `pg_collection.hcp`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from cpkit.attention.a2a import a2a_attention
from cpkit.errors import CPConfigError

__all__ = ["hierarchical_attention", "new_hierarchical_groups"]


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           a2a_group: dist.ProcessGroup, p2p_group: dist.ProcessGroup,
                           causal: bool, scale: float, cu_seqlens: Optional[torch.Tensor] = None,
                           max_seqlen: Optional[int] = None) -> torch.Tensor:
    """a2a+p2p CP attention of this rank's shard (position p2p_rank * A + a2a_rank in the CP
    group); differentiable. Shapes as `a2a.a2a_attention`; heads must divide by |a2a_group|."""
    return a2a_attention(q, k, v, a2a_group, p2p_group, causal, scale, cu_seqlens, max_seqlen)


def new_hierarchical_groups(cp_ranks: Sequence[int], a2a_size: int, backend: Optional[str] = None):
    """Create the a2a and p2p groups of one CP group and return this rank's (a2a, p2p).

    `cp_ranks`: the global ranks of the CP group in CP order; a2a groups are consecutive blocks
    of `a2a_size`, p2p groups take every a2a_size-th rank. Collective over the WORLD: every
    process must call it with the same arguments (torch.distributed.new_group's rule). A rank
    outside `cp_ranks` gets (None, None). Raises CPConfigError when a2a_size does not divide
    len(cp_ranks).
    """
    cp = len(cp_ranks)
    if a2a_size < 1 or cp % a2a_size:
        raise CPConfigError.single(
            "a2a_size", a2a_size, f"must be >= 1 and divide the CP size {cp}",
            "pick hierarchical sizes [a2a, p2p] whose product is the CP size",
        )
    me = dist.get_rank()
    mine_a2a = mine_p2p = None
    for start in range(0, cp, a2a_size):
        ranks = list(cp_ranks[start:start + a2a_size])
        group = dist.new_group(ranks, backend=backend)
        if me in ranks:
            mine_a2a = group
    for offset in range(a2a_size):
        ranks = list(cp_ranks[offset::a2a_size])
        group = dist.new_group(ranks, backend=backend)
        if me in ranks:
            mine_p2p = group
    return mine_a2a, mine_p2p
