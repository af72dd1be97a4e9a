"""`a2a+p2p` (hierarchical CP): Ulysses all-to-all inside the a2a group, ring across p2p.

TE's convention: `cp_group = [a2a_group, p2p_group]`; the CP group's ranks are split into
blocks of A = |a2a_group| consecutive ranks (the a2a groups) and the p2p groups take one rank
of every block (strided). A rank's position in the whole CP group, which decides its sequence
shard, is p2p_rank * A + a2a_rank. After the all-to-all a rank holds h/A heads of the sequence
shard of its whole a2a block, which is the zigzag shard of the p2p level (2P chunks of A
original chunks each), so the ring runs unchanged over the p2p group.

The groups come from `cpkit.parallel.groups` (MCore's `pg_collection.hcp`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpkit.attention.a2a import a2a_attention
from cpkit.attention.options import CPAttentionOptions

__all__ = ["hierarchical_attention"]


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           a2a_group: dist.ProcessGroup, p2p_group: dist.ProcessGroup,
                           causal: bool, scale: float, options: CPAttentionOptions,
                           cu_seqlens: Optional[torch.Tensor] = None,
                           max_seqlen: Optional[int] = None, window=None,
                           sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a2a+p2p CP attention of this rank's shard (position p2p_rank * A + a2a_rank in the CP
    group); differentiable. Shapes as `a2a.a2a_attention`; heads must divide by |a2a_group|."""
    return a2a_attention(q, k, v, a2a_group, p2p_group, causal, scale, options, cu_seqlens, max_seqlen,
                         window, sink)
