"""MCore GPT layer specs with cpkit's CP attention, or with Transformer Engine's.

MCore's local spec (`get_gpt_layer_local_spec`) uses `DotProductAttention`, which asserts
context_parallel_size == 1. `get_gpt_layer_spec_with_cp_attention` returns the same spec with
`ContextParallelAttention` as core attention, so a GPT model runs CP without TE. The helpers
pass only the keyword arguments the installed MCore accepts (0.16 and 0.19 differ).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec

from cpkit.attention.module import ContextParallelAttention
from cpkit.attention.options import CPAttentionOptions
from cpkit.attention.te import te_available, te_unavailable_reason

__all__ = [
    "get_gpt_layer_spec_with_cp_attention",
    "get_gpt_block_spec_with_cp_attention",
    "get_gpt_layer_spec_te",
    "replace_core_attention",
    "te_available",
]


def _call_with_supported(fn: Callable, kwargs: dict[str, Any]) -> Any:
    """Call `fn` with the kwargs it accepts; a TypeError names any it does not."""
    params = inspect.signature(fn).parameters
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        raise TypeError(
            f"{fn.__module__}.{fn.__name__} of the installed megatron-core does not accept "
            f"{unknown}; accepted: {sorted(params)}"
        )
    return fn(**kwargs)


def replace_core_attention(spec: ModuleSpec, core_attention: Any = ContextParallelAttention) -> ModuleSpec:
    """A deep copy of `spec` with every `core_attention` submodule set to `core_attention`.

    Works on any layer/block spec that follows MCore's ModuleSpec + submodules dataclasses
    (self attention, MLA, the TE and local specs alike). Raises ValueError when the spec has
    no `core_attention` at all, so a spec whose layout changed does not pass silently.
    """
    spec = copy.deepcopy(spec)
    found = _replace(spec, core_attention)
    if not found:
        raise ValueError(f"no core_attention submodule found in {type(spec).__name__} spec")
    return spec


def _replace(node: Any, core_attention: Any) -> int:
    found = 0
    if isinstance(node, ModuleSpec):
        return _replace(node.submodules, core_attention)
    if isinstance(node, (list, tuple)):
        return sum(_replace(n, core_attention) for n in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            if f.name == "core_attention":
                setattr(node, f.name, core_attention)
                found += 1
            else:
                found += _replace(getattr(node, f.name), core_attention)
    return found


def get_gpt_layer_spec_with_cp_attention(
    *,
    qk_layernorm: bool = False,
    normalization: str | None = None,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    options: CPAttentionOptions | None = None,
    **mcore_kwargs: Any,
) -> ModuleSpec:
    """MCore's local GPT layer spec with `ContextParallelAttention` as core attention.

    The arguments are those of MCore's `get_gpt_layer_local_spec` (`normalization="RMSNorm"`
    for RMSNorm; `mcore_kwargs` for others the installed version has, e.g. `qk_l2_norm`).
    `multi_latent_attention=True` gives MCore's MLA layer (MLASelfAttention; needs an
    MLATransformerConfig), whose q/k and v head dims differ. The per-layer
    `cp_comm_type` and the groups come from the TransformerConfig and pg_collection at build;
    `options` (a `CPAttentionOptions`) reaches every core attention as a ModuleSpec param.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    kwargs = dict(
        qk_layernorm=qk_layernorm,
        normalization=normalization,
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        **mcore_kwargs,
    )
    core = ContextParallelAttention
    if options is not None:
        core = ModuleSpec(module=ContextParallelAttention, params={"options": options})
    return replace_core_attention(_call_with_supported(get_gpt_layer_local_spec, kwargs), core)


def get_gpt_block_spec_with_cp_attention(config: Any, *, pp_rank: int = 0, vp_stage: int | None = None,
                                         **layer_kwargs: Any) -> Any:
    """The decoder block spec of a GPT with `ContextParallelAttention`: the layers of pipeline
    stage `pp_rank` (this rank's rank in its pp group; MCore's `get_num_layers_to_build`), each
    `get_gpt_layer_spec_with_cp_attention(**layer_kwargs)`, and the layer's own norm as the final
    norm. Pass it to `GPTModel` as `transformer_layer_spec`. Given a bare layer spec, MCore takes
    Transformer Engine's norm for the final norm whenever TE is importable, which cannot run a
    CPU model (gloo ranks on a GPU host with TE)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_spec_with_cp_attention(**layer_kwargs)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=layer.submodules.input_layernorm)


def get_gpt_layer_spec_te(*, qk_layernorm: bool = False, **mcore_kwargs: Any) -> ModuleSpec:
    """MCore's Transformer Engine GPT layer spec (`get_gpt_layer_with_transformer_engine_spec`).

    Raises ImportError, with the reason and the way out, when TE is not importable. After
    building a model from it on cpkit's decentralized groups, call
    `cpkit.attention.te.bind_te_attention_groups(model, pg_collection)` (needed for a2a+p2p).
    """
    if not te_available():
        raise ImportError(
            "Transformer Engine is not importable "
            f"({te_unavailable_reason()}); install it (pip install 'cpkit[te]', or "
            "on a GPU machine without network scripts/te-bundle.sh and scripts/te-install.sh) or use "
            "get_gpt_layer_spec_with_cp_attention()"
        )
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    kwargs = dict(qk_layernorm=qk_layernorm, **mcore_kwargs)
    return _call_with_supported(get_gpt_layer_with_transformer_engine_spec, kwargs)
