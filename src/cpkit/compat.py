"""MCore version differences, absorbed in one place.

cpkit runs on MCore 0.16.x (Python 3.11, CPU CI) and 0.19.x (Python 3.12, GPU machines).
Known differences handled here:
- MCore's local DotProductAttention takes scratch space from parallel_state's global memory
  buffer, which only initialize_model_parallel creates; the decentralized path must create it
  (`ensure_global_memory_buffer`; a buffer, not a process group).
- An unset ProcessGroupCollection field raises AttributeError in 0.16 and returns None in 0.19:
  `get_pg` returns None for both.
- `megatron.core.utils.get_batch_on_this_cp_rank(batch, cp_group=None)` in 0.16 became
  `(batch, is_hybrid_cp, cp_group=None, ...)` in 0.19: `mcore_batch_on_this_cp_rank` calls either.
- MCore's pipeline schedules check `hasattr` for embd and pos_embd, which 0.16 fails for an
  unset field: `schedule_pg_collection` sets them to None.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron.core import package_info
from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = [
    "MCORE_VERSION",
    "ensure_global_memory_buffer",
    "ensure_cuda_rng_tracker",
    "get_pg",
    "mcore_batch_on_this_cp_rank",
    "mcore_version_at_least",
    "new_pg_collection",
    "schedule_pg_collection",
    "set_pg",
]


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


MCORE_VERSION: tuple[int, ...] = _parse(package_info.__version__)


def mcore_version_at_least(version: str) -> bool:
    """True when the installed megatron-core is at least `version` (e.g. "0.19")."""
    return MCORE_VERSION >= _parse(version)


def get_pg(pg_collection: ProcessGroupCollection | None, name: str) -> Any:
    """The group `name` of `pg_collection`, or None when unset (or no collection)."""
    if pg_collection is None:
        return None
    try:
        return getattr(pg_collection, name)
    except AttributeError:
        return None


def set_pg(pg_collection: ProcessGroupCollection, name: str, value: Any) -> None:
    """Set (or, with None, clear) one field of a ProcessGroupCollection in a version-safe way."""
    if value is None:
        if name in pg_collection.__dict__:
            del pg_collection.__dict__[name]
        return
    setattr(pg_collection, name, value)


def schedule_pg_collection(pg_collection: ProcessGroupCollection) -> ProcessGroupCollection:
    """A shallow copy of `pg_collection` for MCore's pipeline schedules: embd and pos_embd,
    when unset (ranks off the first / last stage), are None instead of missing."""
    out = copy.copy(pg_collection)
    for name in ("embd", "pos_embd"):
        if get_pg(out, name) is None:
            out.__dict__[name] = None
    return out


def new_pg_collection(**groups: Any) -> ProcessGroupCollection:
    """A ProcessGroupCollection with only the given (non-None) groups set."""
    return ProcessGroupCollection(**{k: v for k, v in groups.items() if v is not None})


def ensure_global_memory_buffer() -> None:
    """Create MCore's global memory buffer if initialize_model_parallel has not (idempotent)."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def ensure_cuda_rng_tracker(seed: int = 1234) -> None:
    """Add MCore's "model-parallel-rng" CUDA RNG state if nothing has (idempotent; CUDA only).

    MCore's local DotProductAttention forks it on every forward; model_parallel_cuda_manual_seed
    adds it, which the decentralized process-group path never calls. With dropout off, as in
    cpkit's models, no random number is drawn from it.
    """
    if not torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", seed)


def mcore_batch_on_this_cp_rank(batch: dict, cp_group: Any) -> dict:
    """MCore's own zigzag slicing of `batch` (tensors [b, s, ...]) for this rank of `cp_group`."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)
