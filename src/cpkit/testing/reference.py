"""Single-rank references inside a multi-rank test."""

from __future__ import annotations

import torch.distributed as dist

from cpkit.compat import new_pg_collection

__all__ = ["single_rank_pg_collection"]

_PG_FIELDS = ("tp", "pp", "mp", "cp", "dp", "tp_cp", "dp_cp", "tp_dp_cp", "embd", "pos_embd",
              "intra_dp_cp", "expt_dp", "intra_expt_dp", "expt_tp", "tp_ep", "tp_ep_pp", "ep")


def single_rank_pg_collection():
    """A ProcessGroupCollection in which every group is this rank alone (a cp=1, tp=1 reference).

    Collective over the default group: every rank creates every singleton group, in rank order.
    """
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            mine = group
    return new_pg_collection(**{name: mine for name in _PG_FIELDS})
