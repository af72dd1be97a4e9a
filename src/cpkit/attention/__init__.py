"""CP core attention for MCore: `p2p` (ring), `all_gather`, `a2a` (Ulysses) and `a2a+p2p`.

`context_parallel_attention` is the functional entry point (sbhd and THD, causal or no mask,
GQA, fp32/bf16/fp16, gloo and NCCL). One file per comm type (`p2p.py`, `all_gather.py`,
`a2a.py`, `hierarchical.py`) over shared `comm.py` (ring, collectives), `merge.py` (fp32
log-sum-exp merge), `chunks.py` (this rank's two chunks, token permutations) and `kernels.py`
(single-device attention with LSE, choosing among the adapters `sdpa_kernels.py`,
`cudnn_fe.py` and `math_kernel.py`: cuDNN/flash/efficient on CUDA, exact math on CPU).
"""

from cpkit.attention.functional import CP_COMM_TYPES, check_comm_type, context_parallel_attention
from cpkit.attention.kernels import attn_bwd, attn_fwd, reference_attention
from cpkit.attention.options import CPAttentionOptions, default_options


# The MCore-facing names import megatron-core: load them on first use, so the functional core
# (and every rank that only needs it) does not pay for importing MCore.
_LAZY = {
    "ContextParallelAttention": "cpkit.attention.module",
    "get_gpt_layer_spec_te": "cpkit.attention.spec",
    "get_gpt_layer_spec_with_cp_attention": "cpkit.attention.spec",
    "replace_core_attention": "cpkit.attention.spec",
    "bind_te_attention_groups": "cpkit.attention.te",
    "te_available": "cpkit.attention.te",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cpkit.attention' has no attribute {name!r}")

__all__ = [
    "CP_COMM_TYPES",
    "CPAttentionOptions",
    "ContextParallelAttention",
    "bind_te_attention_groups",
    "get_gpt_layer_spec_te",
    "get_gpt_layer_spec_with_cp_attention",
    "replace_core_attention",
    "te_available",
    "attn_bwd",
    "attn_fwd",
    "check_comm_type",
    "context_parallel_attention",
    "default_options",
    "reference_attention",
]
