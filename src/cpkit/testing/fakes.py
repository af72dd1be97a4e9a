"""Process groups without processes, for unit tests: torch's fake backend behind a real ProcessGroup.

`fake_group(ranks)` is a `torch.distributed.ProcessGroup` over the global `ranks` whose collectives
are torch's FakeProcessGroup (they return at once and move no data). Its size, rank and global
ranks answer as a real group's do (`dist.get_process_group_ranks` included), so library code reads
it through the same calls as a real group and never branches on a stand-in. It suits code that
only reads a group's shape (registries, rebinding, the hierarchical-group checks), never results
of a collective.

`fake_group(ranks, device_type="cuda")` stands in for an NCCL group on a CPU-only host: its one
backend serves CUDA tensors, so a collective on a CPU tensor raises what NCCL raises ("No backend
type associated with device type cpu"), which gloo never does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed import distributed_c10d as c10d

__all__ = ["fake_group"]


def fake_group(ranks: Sequence[int], rank: Optional[int] = None, device_type: str = "cpu") -> dist.ProcessGroup:
    """A fake-backend ProcessGroup over global `ranks`, in which this process is at position `rank`.

    `rank` defaults to this process's global rank's position in `ranks` (0 when it is not in
    them, or torch.distributed is not initialized). `device_type` is the one device type its
    backend serves ("cuda": NCCL's, refusing CPU tensors). The membership is registered where
    torch.distributed looks it up, so `dist.get_process_group_ranks(group)` returns `ranks`.
    """
    ranks = list(ranks)
    if rank is None:
        me = dist.get_rank() if dist.is_initialized() else 0
        rank = ranks.index(me) if me in ranks else 0
    group = dist.ProcessGroup(dist.HashStore(), rank, len(ranks))
    create = getattr(FakeProcessGroup, "_create_internal", FakeProcessGroup)  # its name before torch 2.12
    backend = create(rank, len(ranks))
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    group._register_backend(torch.device(device_type), dist.ProcessGroup.BackendType.CUSTOM, backend)
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    return group
