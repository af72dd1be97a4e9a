"""Test support for the Transformer Engine backend: skips, parameter names, restore checks.

- `te_skip_reason()` / `requires_te()`: skip a test with the reason where TE is not importable.
- `map_te_names`, `copy_weights_from_local` (names through cpkit.testing.models.local_spec_name):
  MCore's TE layer spec fuses the layer norms into the following linear
  (`TELayerNormColumnParallelLinear`), so a TE-spec GPT names `input_layernorm.weight`
  `self_attention.linear_qkv.layer_norm_weight` (and `pre_mlp_layernorm.*`
  `mlp.linear_fc1.layer_norm_*`); every other parameter has the name and shape of the local
  (cpkit) spec. The mapping is the one MCore itself uses to load local-spec checkpoints into TE
  models (`sharded_state_dict_keys_map` of `get_gpt_layer_local_submodules`,
  megatron/core/models/gpt/gpt_layer_specs.py, 0.16 and 0.19).
- `rebind_snapshot` / `assert_rebind_restored`: every attribute eval CP (and dynamic CP) may
  rebind, captured by object identity, so a test can prove the restore put back the very objects.
- `TELikeAttention`: a TE-style CP attention stand-in that records its set_context_parallel_group
  calls, for rebinding tests without TE.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from cpkit.testing.models import local_spec_name

__all__ = [
    "te_skip_reason",
    "requires_te",
    "map_te_names",
    "copy_weights_from_local",
    "rebind_snapshot",
    "assert_rebind_restored",
    "TELikeAttention",
]


def te_skip_reason() -> Optional[str]:
    """Why the TE tests cannot run here (TE not importable), or None when they can."""
    from cpkit.attention.te import te_available, te_unavailable_reason

    if te_available():
        return None
    return (f"Transformer Engine is not importable ({te_unavailable_reason()}); install it "
            "(pip install 'cpkit[te]', or on a GPU machine without network scripts/te-bundle.sh and "
            "scripts/te-install.sh) to run the "
            "te backend tests")


def requires_te():
    """A skipif marker for tests that need TE (evaluated once, when the marker is made)."""
    reason = te_skip_reason()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


# --- TE <-> local parameter names -------------------------------------------------------------

def map_te_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` (keyed by TE-spec names) keyed by local-spec names; ValueError on a collision."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        local = local_spec_name(name)
        if local in out:
            raise ValueError(f"{name} and another parameter both map to {local}")
        out[local] = value
    return out


@torch.no_grad()
def copy_weights_from_local(te_model: torch.nn.Module, local_model: torch.nn.Module) -> int:
    """Copy every parameter of a local/cpkit-spec model into the same-layout TE-spec model.

    Both must be built for the same GPTConfig and parallel layout. Raises ValueError when a TE
    parameter has no local counterpart (or another shape), or a local parameter is left unused,
    so a spec whose names change fails loudly instead of training from other weights.
    Returns the number of parameters copied.
    """
    src = dict(local_model.named_parameters())
    used: set[str] = set()
    problems = []
    for name, param in te_model.named_parameters():
        local = local_spec_name(name)
        if local not in src:
            problems.append(f"TE parameter {name} (local name {local}) has no local counterpart")
        elif src[local].shape != param.shape:
            problems.append(f"{name}: TE shape {tuple(param.shape)} != local {tuple(src[local].shape)}")
        elif local in used:
            problems.append(f"{name}: local parameter {local} is used twice")
        else:
            param.copy_(src[local])
            used.add(local)
    problems += [f"local parameter {n} has no TE counterpart" for n in sorted(set(src) - used)]
    if problems:
        raise ValueError("TE and local specs do not match:\n" + "\n".join(problems))
    return len(used)


# --- restore checks ---------------------------------------------------------------------------

_ABSENT = object()
_CONFIG_ATTRS = ("context_parallel_size", "hierarchical_context_parallel_sizes", "cp_comm_type")


def _attrs_eval_cp_may_set() -> tuple[str, ...]:
    from cpkit.eval_cp.rebind import CP_ATTENTION_ATTRS, REBIND_TABLE

    rope_caches = ("max_seq_len_cached", "offset_cached", "dtype_cached", "packed_seq_cached",
                   "cos_cached", "sin_cached")
    return tuple(dict.fromkeys([r.attr for r in REBIND_TABLE] + list(CP_ATTENTION_ATTRS)
                               + list(rope_caches)))


def rebind_snapshot(model: torch.nn.Module) -> list[tuple[str, Any, str, Any]]:
    """(label, object, attribute, value) of every attribute eval CP may rebind in `model`.

    Covers each module's instance attributes in cpkit.eval_cp.rebind.REBIND_TABLE and
    CP_ATTENTION_ATTRS (and the RoPE caches), the CP fields of every distinct config, and the
    class-level `cp_stream` of every class that has one (MCore's TEDotProductAttention).
    """
    attrs = _attrs_eval_cp_may_set()
    out = []
    configs: dict[int, Any] = {}
    classes: dict[int, type] = {}
    for name, module in model.named_modules():
        state = vars(module)
        for attr in attrs:
            out.append((f"{name or '<model>'}.{attr}", module, attr, state.get(attr, _ABSENT)))
        config = state.get("config")
        if config is not None:
            configs.setdefault(id(config), config)
        for cls in type(module).__mro__:
            if "cp_stream" in vars(cls):
                classes.setdefault(id(cls), cls)
    for config in configs.values():
        for attr in _CONFIG_ATTRS:
            out.append((f"config.{attr}", config, attr, vars(config).get(attr, _ABSENT)))
    for cls in classes.values():
        out.append((f"{cls.__qualname__}.cp_stream (class)", cls, "cp_stream", vars(cls)["cp_stream"]))
    return out


def assert_rebind_restored(snapshot: list[tuple[str, Any, str, Any]]) -> int:
    """Assert every attribute of `snapshot` is (`is`) the object it was; return the count."""
    wrong = []
    for label, obj, attr, value in snapshot:
        now = vars(obj).get(attr, _ABSENT)
        if now is not value:
            wrong.append(f"{label}: now {now!r}, was {value!r}")
    assert not wrong, "not restored:\n" + "\n".join(wrong)
    return len(snapshot)


# --- a TE-style attention stand-in ------------------------------------------------------------

class TELikeAttention(torch.nn.Module):
    """Stands in for TE's DotProductAttention / MCore's TEDotProductAttention: TE's
    set_context_parallel_group signature, a class-level cp_stream as MCore keeps it, a
    load-balancing strategy, and `calls`, a record of every set_context_parallel_group call as
    (cp_group, cp_global_ranks, cp_stream, cp_comm_type, load_balancing_strategy)."""

    cp_stream = object()  # MCore keeps TEDotProductAttention.cp_stream on the class

    def __init__(self, cp_comm_type="p2p"):
        super().__init__()
        self.cp_group, self.cp_global_ranks, self.cp_comm_type = None, None, cp_comm_type
        self.load_balancing_strategy = "dual_chunk_swap"
        self.calls = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p",
                                   load_balancing_strategy="default"):
        """Record the call and set the attributes TE's version sets."""
        self.calls.append((cp_group, cp_global_ranks, cp_stream, cp_comm_type, load_balancing_strategy))
        self.cp_group, self.cp_global_ranks, self.cp_stream = cp_group, cp_global_ranks, cp_stream
        self.cp_comm_type, self.load_balancing_strategy = cp_comm_type, load_balancing_strategy
