"""Process groups that a pool rank (cpkit.harness.rank_worker) keeps across cases and hands out again.

A persistent rank runs hundreds of cases; each builds the groups of its layout through
`torch.distributed.new_group` (cpkit's builders, MCore's `initialize_model_parallel`,
HyperCommGrid). Kept per case, those groups piled up until the pool retired (on gloo: three
threads per group, 773 threads per rank; on NCCL: a communicator each). c10d's own
find-or-create by ranks and tag is the model: the k-th request in a case for a group of the same
ranks, backend, timeout and options gets the k-th group made for that key by an earlier case, so
the number of groups is bounded by the layouts used, not by the number of cases. The k-th, not
the first: one case may ask twice for the same ranks (MCore's tp and cp groups over one pair)
and must get two groups, as it would outside a pool.

Every rank takes the same path (hit or new), so `new_group`'s collective naming stays in step;
`group_count()` lets the pool check that after every case. A case's `destroy_process_group` of
a kept group is deferred to the pool's exit: on some ranks (members) a destroyed group would be
made anew next time while non-members reused their placeholder, and the ranks would disagree.
Groups made with `pg_options` are never shared (options objects have no comparable value).
`max_timeout` caps the collective timeout of the groups made: MCore asks for 30 minutes, and a
case whose ranks disagree on their collectives (a fault under test) would otherwise wait for its
whole case deadline instead of raising where it stuck.
`drop_all()` frees the kept groups: a gloo pool drops them after each grid, since idle gloo
groups cost CPU (their TCP loops poll), while NCCL pools keep their communicators.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
import datetime
from typing import Any

__all__ = ["GroupReuse", "group_count", "live_groups"]


def live_groups() -> list:
    """The process groups c10d holds in this process (the world group included)."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def group_count() -> int:
    """How many times `new_group` ran in this process: equal on every rank of a world whose ranks
    made the same groups in the same order (c10d names groups by it)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.group_count


class GroupReuse:
    """Installs a find-or-create `new_group` (and a deferring `destroy_process_group`) into
    torch.distributed for this process; `new_case()` starts a case's request count afresh."""

    def __init__(self, max_timeout: datetime.timedelta | None = None):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self._dist, self._c10d = dist, c10d
        self._new_group, self._destroy = c10d.new_group, c10d.destroy_process_group
        self._signature = inspect.signature(self._new_group)
        self._kept: dict[tuple, list] = defaultdict(list)
        self._asked: dict[tuple, int] = defaultdict(int)
        self.made = self.reused = 0
        self.max_timeout = max_timeout

    def install(self) -> "GroupReuse":
        for module in (self._dist, self._c10d):
            module.new_group = self.new_group
            module.destroy_process_group = self.destroy_process_group
        return self

    def uninstall(self) -> None:
        for module in (self._dist, self._c10d):
            module.new_group, module.destroy_process_group = self._new_group, self._destroy

    def __enter__(self) -> "GroupReuse":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def drop_all(self) -> int:
        """Destroy every kept group (each rank its own; no collective) and forget them; how many.
        Every rank of the world must drop at the same point, or their counts part (the pool
        drops between grids). A gloo group costs CPU while it lives: its TCP loop wakes about
        every 10 ms, about 1 ms of CPU a second per group."""
        from torch.distributed.distributed_c10d import GroupMember

        dropped = 0
        for groups in self._kept.values():
            for group in groups:
                if group is not None and group is not GroupMember.NON_GROUP_MEMBER and group in self._c10d._world.pg_map:
                    self._destroy(group)
                    dropped += 1
        self._kept.clear()
        self._asked.clear()
        return dropped

    def new_case(self) -> None:
        self._asked.clear()

    def kept(self) -> int:
        return sum(len(groups) for groups in self._kept.values())

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("pg_options") is not None:
            return None
        ranks = a.get("ranks")
        if ranks is not None:
            ranks = tuple(sorted(ranks)) if a.get("sort_ranks", True) else tuple(ranks)
        backend = a.get("backend")
        return (ranks, str(backend).lower() if backend is not None else None, a.get("timeout"),
                bool(a.get("use_local_synchronization")), str(a.get("device_id")))

    def _make(self, args: tuple, kwargs: dict):
        if self.max_timeout is not None:
            bound = self._signature.bind(*args, **kwargs)
            asked = bound.arguments.get("timeout")
            bound.arguments["timeout"] = min(asked, self.max_timeout) if asked is not None else self.max_timeout
            args, kwargs = bound.args, bound.kwargs
        self.made += 1
        return self._new_group(*args, **kwargs)

    def new_group(self, *args: Any, **kwargs: Any):
        key = self._key(args, kwargs)
        if key is None:
            return self._make(args, kwargs)
        index = self._asked[key]
        self._asked[key] += 1
        groups = self._kept[key]
        if index < len(groups):
            self.reused += 1
            return groups[index]
        group = self._make(args, kwargs)
        groups.append(group)
        return group

    def destroy_process_group(self, group=None) -> None:
        if group is not None and any(group is g for groups in self._kept.values() for g in groups):
            return  # kept for later cases; destroyed with the world at the pool's exit
        self._destroy(group)
