"""Transformer Engine adapter: availability, TE's class-level CP stream, explicit group binding.

Why `bind_te_attention_groups` exists: MCore's `TEDotProductAttention.__init__`
(`megatron/core/extensions/transformer_engine.py`, 0.16.1 and the 0.19 line alike) takes the CP
group from `pg_collection.cp`, but for `cp_comm_type == "a2a+p2p"` it replaces it with
`parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)`, the *global*
groups, and never reads `pg_collection.hcp`. On cpkit's decentralized path (groups built by
`cpkit.parallel.groups`, MCore's parallel_state not initialized) that is None, and TE then runs each rank
on its own chunk with no CP communication; with parallel_state initialized for another layout it
silently uses the wrong groups. TE's public `DotProductAttention.set_context_parallel_group(
cp_group, cp_global_ranks, cp_stream, cp_comm_type)` accepts the [a2a, p2p] list, so the fix is
on cpkit's side, without patching MCore: call `bind_te_attention_groups(model, pg_collection)`
after building the model (and after any rebuild of the groups).

Two more MCore behaviours to know (not changed here): `TEDotProductAttention.forward` rebinds the
module to `packed_seq_params.cp_group` permanently (it does not restore the previous group) and
passes that single group even for a2a+p2p; and TE needs `NVTE_APPLY_QK_LAYER_SCALING` to match
`config.apply_query_key_layer_scaling`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.parallel.layout import A2A_P2P

__all__ = [
    "te_available",
    "te_unavailable_reason",
    "te_version",
    "te_cp_stream",
    "te_attention_modules",
    "bind_te_attention_groups",
]


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str]:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError / RuntimeError without CUDA
        return False, f"{type(exc).__name__}: {exc}".strip()
    return True, ""


def te_available() -> bool:
    """True when `transformer_engine.pytorch` imports (TE installed with its PyTorch extension)."""
    return _probe()[0]


def te_unavailable_reason() -> str:
    """Why TE is not importable ("" when it is)."""
    return _probe()[1]


def te_version() -> Optional[str]:
    """The installed TE version string, or None when TE is not importable."""
    if not te_available():
        return None
    import transformer_engine

    return getattr(transformer_engine, "__version__", "unknown")


def te_cp_stream():
    """MCore's class-level `TEDotProductAttention.cp_stream`, created if still None.

    MCore creates it only when a TE attention is built with context_parallel_size > 1; a model
    built at cp=1 and rebound to CP later needs it too. Returns None without CUDA or TE.
    """
    if not (te_available() and torch.cuda.is_available()):
        return None
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if TEDotProductAttention.cp_stream is None:
        TEDotProductAttention.cp_stream = torch.cuda.Stream()
    return TEDotProductAttention.cp_stream


def _te_attention_type():
    if not te_available():
        return None
    import transformer_engine.pytorch as te

    return te.DotProductAttention


def te_attention_modules(model: torch.nn.Module, attention_type: Any = None) -> list[tuple[str, Any]]:
    """(name, module) of every TE DotProductAttention in `model` (MCore's TEDotProductAttention
    included); `attention_type` overrides the class looked for. Empty without TE."""
    attention_type = attention_type or _te_attention_type()
    if attention_type is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, attention_type)]


def bind_te_attention_groups(
    model: torch.nn.Module,
    pg_collection,
    *,
    cp_comm_type: Optional[str] = None,
    cp_stream: Any = None,
    attention_type: Any = None,
) -> int:
    """Bind every TE attention of `model` to the CP groups of `pg_collection`; return the count.

    Each module keeps its own `cp_comm_type` unless `cp_comm_type` is given. For `a2a+p2p` the
    group bound is `pg_collection.hcp` = [a2a_group, p2p_group] (TE's list convention), checked
    against `pg_collection.cp`; otherwise `pg_collection.cp`. A CP group of size 1 (or none)
    binds None: TE then runs without CP. `cp_stream` defaults to `te_cp_stream()`.

    Raises CPConfigError when a module is a2a+p2p and pg_collection.hcp is missing or does not
    fit pg_collection.cp (the case where MCore would silently leave CP off).
    """
    from cpkit.attention.module import _check_comm_type
    from cpkit.parallel.group_info import check_hierarchical_groups

    modules = te_attention_modules(model, attention_type)
    if not modules:
        return 0
    cp = get_pg(pg_collection, "cp")
    cp_size = dist.get_world_size(cp) if cp is not None else 1
    ranks: Optional[Sequence[int]] = dist.get_process_group_ranks(cp) if cp_size > 1 else None
    stream = cp_stream if cp_stream is not None else (te_cp_stream() if cp_size > 1 else None)
    hcp = None
    for _, module in modules:
        comm = _check_comm_type(cp_comm_type or getattr(module, "cp_comm_type", None))
        if cp_size <= 1:
            module.set_context_parallel_group(None, None, None, comm)
            continue
        if comm == A2A_P2P:
            if hcp is None:
                hcp = list(check_hierarchical_groups(get_pg(pg_collection, "hcp"), cp))
            group = hcp
        else:
            group = cp
        module.set_context_parallel_group(group, ranks, stream, comm)
    return len(modules)

