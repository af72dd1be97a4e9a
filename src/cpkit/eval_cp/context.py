"""Eval-time context parallelism: evaluate at another CP degree by rebinding process groups.

Three parts, one module each:
- eval groups (here): `eval_layout` validates the eval layout, `build_eval_pg_collection` builds
  an eval ProcessGroupCollection over the same ranks with another CP size (the training group
  objects kept where the membership is the same), and `eval_cp_context(model, eval_pgs)`
  rebinds the model to it for one evaluation; the planner is `cpkit.eval_cp.plan.plan_eval_cp`;
- the switch: `cpkit.eval_cp.rebind` (`install_pg_collection`, `Rebinding.restore`, `REBIND_TABLE`);
- the evaluation loop: `cpkit.eval_cp.loop` (`eval_shard`, `reduce_eval_loss`, `evaluate`).
The names of the other two are re-exported here, the public surface of eval CP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

from cpkit.compat import get_pg
from cpkit.eval_cp.loop import EvalResult, eval_shard, eval_shard_for, evaluate, reduce_eval_loss
from cpkit.eval_cp.plan import plan_eval_cp
from cpkit.parallel.group_info import members
from cpkit.parallel.layout import A2A_P2P, CPLayout
from cpkit.eval_cp.rebind import (
    CP_ATTENTION_ATTRS,
    REBIND_TABLE,
    UNSUPPORTED_MODULES,
    EvalCPWarning,
    ModelOrChunks,
    Rebinding,
    RebindRule,
    install_pg_collection,
    rebound,
)

__all__ = [
    "RebindRule",
    "REBIND_TABLE",
    "CP_ATTENTION_ATTRS",
    "UNSUPPORTED_MODULES",
    "EvalCPWarning",
    "Rebinding",
    "eval_layout",
    "build_eval_pg_collection",
    "install_pg_collection",
    "eval_cp_context",
    "eval_shard",
    "eval_shard_for",
    "reduce_eval_loss",
    "EvalResult",
    "evaluate",
    "plan_eval_cp",
]



def eval_layout(
    layout: CPLayout,
    eval_cp: int,
    *,
    hierarchical_sizes: Optional[Sequence[int]] = None,
    cp_comm_type: Optional[str] = None,
) -> CPLayout:
    """The validated eval layout: `layout` with cp = eval_cp (tp, pp, world unchanged; dp follows).

    `hierarchical_sizes` = [a2a, p2p] makes it an a2a+p2p layout (product eval_cp);
    `cp_comm_type` overrides the comm type. Without either, an a2a+p2p layout keeps a2a+p2p with
    a2a level gcd(old a2a, eval_cp) (CPLayout.with_cp). Raises CPConfigError (every violation,
    the eval ones reported under eval_context_parallel_size).
    """
    dataclasses.replace(layout, eval_context_parallel_size=eval_cp).validate()
    ev = layout.with_cp(eval_cp)
    if hierarchical_sizes is not None:
        ev = dataclasses.replace(ev, cp_comm_type=cp_comm_type or A2A_P2P,
                                 hierarchical_context_parallel_sizes=list(hierarchical_sizes))
    elif cp_comm_type is not None:
        hier = ev.hierarchical_context_parallel_sizes if cp_comm_type == A2A_P2P else None
        ev = dataclasses.replace(ev, cp_comm_type=cp_comm_type, hierarchical_context_parallel_sizes=hier)
    return ev.validate()


def _collection_fields() -> list[str]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    return [f.name for f in dataclasses.fields(ProcessGroupCollection)]


def build_eval_pg_collection(
    layout: CPLayout,
    eval_cp: int,
    *,
    hierarchical_sizes: Optional[Sequence[int]] = None,
    cp_comm_type: Optional[str] = None,
    train_pgs: Any = None,
    backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
):
    """The eval ProcessGroupCollection: the ranks of `layout` with cp = eval_cp.

    tp and pp groups have the training membership, dp shrinks or grows (dp x cp is unchanged);
    `hierarchical_sizes` = [a2a, p2p] gives it hcp groups (an a2a+p2p eval layout). With
    `train_pgs` (the training collection), every field whose membership is the same in both
    layouts (tp, pp, mp, dp_cp, tp_dp_cp, embd, ...) is the training group object itself, so
    only cp, dp, tp_cp (and hcp) are new and the model's tp/pp groups are kept.

    Collective over the default group (cpkit.parallel.groups.build_pg_collection): every rank calls it
    with the same arguments. Raises CPConfigError for an invalid eval layout.
    """
    from cpkit.parallel.groups import build_pg_collection

    ev = eval_layout(layout, eval_cp, hierarchical_sizes=hierarchical_sizes, cp_comm_type=cp_comm_type)
    pgs = build_pg_collection(ev, backend=backend, timeout=timeout)
    if train_pgs is not None:
        for name in _collection_fields():
            new, old = get_pg(pgs, name), get_pg(train_pgs, name)
            if new is not None and old is not None and new is not old and members(new) == members(old):
                setattr(pgs, name, old)
    return pgs


@contextlib.contextmanager
def eval_cp_context(model: ModelOrChunks, eval_pgs: Any, *, cp_comm_type: Optional[str] = None) -> Iterator[Rebinding]:
    """Inside the block `model` runs on `eval_pgs` (cpkit.eval_cp.rebind.install_pg_collection); on exit,
    also on an exception, every rebound attribute is the object it was before and the RoPE caches
    are cleared again. Nested use on the same model raises CPConfigError. Yields the Rebinding."""
    with rebound(model, eval_pgs, cp_comm_type=cp_comm_type) as rebinding:
        yield rebinding
