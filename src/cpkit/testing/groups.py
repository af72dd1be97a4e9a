"""Real process groups for multi-rank tests that build them without a CPLayout."""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from cpkit.errors import CPConfigError
from cpkit.parallel.rank_grid import hierarchical_levels

__all__ = ["new_hierarchical_groups"]


def new_hierarchical_groups(cp_ranks: Sequence[int], a2a_size: int, backend: Optional[str] = None):
    """Create the a2a and p2p groups of one CP group and return this rank's (a2a, p2p).

    `cp_ranks`: the global ranks of the CP group in CP order; a2a groups are consecutive blocks
    of `a2a_size`, p2p groups take every a2a_size-th rank (cpkit.parallel.rank_grid.hierarchical_levels).
    Collective over the WORLD: every process must call it with the same arguments
    (torch.distributed.new_group's rule). A rank outside `cp_ranks` gets (None, None). Raises
    CPConfigError when a2a_size does not divide len(cp_ranks).
    """
    cp = len(cp_ranks)
    if a2a_size < 1 or cp % a2a_size:
        raise CPConfigError.single(
            "a2a_size", a2a_size, f"must be >= 1 and divide the CP size {cp}",
            "pick hierarchical sizes [a2a, p2p] whose product is the CP size",
        )
    me = dist.get_rank()
    mine = []
    for level in hierarchical_levels(list(cp_ranks), [a2a_size, cp // a2a_size]):
        found = None
        for ranks in level:
            group = dist.new_group(ranks, backend=backend)
            if me in ranks:
                found = group
        mine.append(found)
    return mine[0], mine[1]
