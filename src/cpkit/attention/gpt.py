"""Small MCore GPT models for tests and benchmarks, built for an explicit ProcessGroupCollection.

Weights are a deterministic function of a seed and of each parameter's layout-independent name
(`init_weights`), sliced for this rank's tensor-parallel shard, so a cp=1 and a cp=N (or tp=2)
model start identical. `train_step` / `eval_step` reduce per token over the context-parallel
(and data-parallel) ranks (cpkit.loss) so every layout reports the same number as the
single-rank reference. A benchmark's model is a product part (users run the benchmarks), so
it lives here in the library; `cpkit.testing.models` re-exports it for the tests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.parallel.group_info import group_size
from cpkit.loss import forward_loss, global_loss, reduce_gradients, require_single_stage, total_tokens
from cpkit.parallel.layout import P2P

__all__ = [
    "FEATURE_MODELS",
    "GPTConfig",
    "build_gpt",
    "build_gpt_chunks",
    "prepare_cpu",
    "init_weights",
    "local_spec_name",
    "make_batch",
    "train_step",
    "eval_step",
    "named_gradients",
    "named_parameters_full",
]

AttentionBackend = Literal["cpkit", "local", "te"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the small GPT; defaults keep a CPU forward + backward well under a second."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    """KV heads (GQA); None means num_attention_heads."""
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 128
    seq_length: int = 64
    """Full (unsharded) sequence length."""
    dtype: torch.dtype = torch.float32
    seed: int = 1234
    position_embedding_type: str = "rope"
    """"rope" or "learned_absolute". MCore computes RoPE positions itself (from cu_seqlens and the
    CP group under THD) and reads the batch's position_ids only for learned absolute embeddings,
    so a test of the position_ids a CP path hands the model needs "learned_absolute"."""
    extra: dict = field(default_factory=dict)
    """Additional TransformerConfig keyword arguments."""

    def with_(self, **changes) -> "GPTConfig":
        return replace(self, **changes)


FEATURE_MODELS = {
    # q_lora_rank is set: MCore 0.16's MLA builds its q projection without the TP group when
    # q_lora_rank is None, which fails on groups passed by pg_collection (no parallel_state).
    "mla": dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
                qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope"),
    "window-learnable-softmax": dict(window_size=(8, 0), window_attn_skip_freq=2, softmax_type="learnable"),
}
"""GPTConfig.extra of the long-context attention features: MLA (q/k head dim 24 = 16 + 8 RoPE
dims, v head dim 16) and gpt-oss's sliding window on every other layer with a learnable sink
logit per head. MLA has no GQA: build it with num_query_groups=None."""


def _block_spec(layer_spec, attention: AttentionBackend, config, vp_stage, pp_rank: int):
    """The decoder block of `layer_spec` with the layer's own norm class as its final norm.

    Given a bare layer spec, MCore's TransformerBlock takes TENorm for the final norm whenever
    Transformer Engine is importable, and TE's norm cannot run a CPU model (a CPU test on a GPU
    host with TE failed with "CUDAGuardImpl initialized with non-CUDA DeviceType: cpu"). The TE
    spec keeps MCore's choice: its layers fuse their norms, so TENorm is what it would pick.
    """
    if attention == "te":
        return layer_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers,
                                      layer_norm=layer_spec.submodules.input_layernorm)


def _layer_spec(attention: AttentionBackend, num_layers: int, device: torch.device, mla: bool = False,
                num_experts: Optional[int] = None):
    if num_experts and attention != "cpkit":
        raise ValueError(f"attention={attention!r}: MoE layers (num_moe_experts) are built with 'cpkit' only")
    if mla and attention != "cpkit":
        raise ValueError(f"attention={attention!r}: multi-latent attention is built with 'cpkit' only")
    if attention == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from cpkit.compat import ensure_cuda_rng_tracker, ensure_global_memory_buffer

        ensure_global_memory_buffer()
        if device.type == "cuda":  # on CPU the shim's fork is a no-op: no CUDA state needed
            ensure_cuda_rng_tracker()
        return get_gpt_layer_local_spec()
    if attention == "cpkit":
        from cpkit.attention.spec import get_gpt_layer_spec_with_cp_attention

        if num_experts:
            return get_gpt_layer_spec_with_cp_attention(num_experts=num_experts)
        return get_gpt_layer_spec_with_cp_attention(multi_latent_attention=mla)
    if attention == "te":
        from cpkit.attention.spec import get_gpt_layer_spec_te

        return get_gpt_layer_spec_te()
    raise ValueError(f"attention={attention!r}: must be one of 'cpkit', 'local', 'te'")


def prepare_cpu() -> bool:
    """Let these models run on CPU in this process: installs cpkit.mcore_cpu (MCore calls
    CUDA in a few places). Returns False, doing nothing, when this process runs MCore on CUDA
    (the launcher's device). Benchmarks call this rather than patching MCore themselves."""
    from cpkit.mcore_cpu import install_mcore_cpu_shim

    return install_mcore_cpu_shim()


def build_gpt(
    cfg: GPTConfig,
    pg_collection,
    *,
    attention: AttentionBackend = "cpkit",
    cp_comm_type: str | list[str] = P2P,
    hierarchical_cp_sizes: Optional[list[int]] = None,
    sequence_parallel: bool = False,
    device: Optional[torch.device] = None,
    vp_stage: Optional[int] = None,
):
    """Build an MCore GPTModel (RoPE unless `cfg.position_embedding_type` says otherwise, no
    dropout) for `pg_collection`, weights from `cfg.seed`.

    The parallel sizes (tp, pp, cp) are read from the groups in `pg_collection`; pre/post
    processing follow this rank's pipeline stage. With virtual pipeline stages
    (`cfg.extra["virtual_pipeline_model_parallel_size"]`), `vp_stage` picks the chunk
    (build_gpt_chunks builds them all). `attention` picks the core attention:
    "cpkit" (cpkit.attention's ContextParallelAttention, any cp), "local" (MCore's
    DotProductAttention, cp=1 only) or "te" (TEDotProductAttention, needs Transformer Engine).
    `device` defaults to this process's launcher device (cuda in an NCCL rank, else cpu, also
    on a host with GPUs). Raises ValueError for an unknown backend; MCore raises for impossible
    sizes.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = group_size(get_pg(pg_collection, "tp"))
    pp_group = get_pg(pg_collection, "pp")
    pp = group_size(pp_group)
    cp = group_size(get_pg(pg_collection, "cp"))
    if device is None:  # the launcher's device for this process: cuda in an NCCL rank, else cpu
        from cpkit.process_device import device as launcher_device

        device = launcher_device()
    device = torch.device(device)
    tc_kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        cp_comm_type=cp_comm_type,
        hierarchical_context_parallel_sizes=hierarchical_cp_sizes,
        sequence_parallel=sequence_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=cfg.dtype,
        bf16=cfg.dtype == torch.bfloat16,
        fp16=cfg.dtype == torch.float16,
        pipeline_dtype=cfg.dtype,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # init_weights sets every parameter below
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        **cfg.extra,
    )
    mla = bool(cfg.extra.get("multi_latent_attention"))
    if mla:  # q/k and v head dims of their own (cfg.extra: qk_head_dim, v_head_dim, ...)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config = MLATransformerConfig(**tc_kwargs)
    else:
        config = TransformerConfig(**tc_kwargs)
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
    vp = config.virtual_pipeline_model_parallel_size or 1
    chunk = {} if vp_stage is None else {"vp_stage": vp_stage}
    layer_spec = _layer_spec(attention, cfg.num_layers, device, mla, cfg.extra.get("num_moe_experts"))
    if cfg.extra.get("mtp_num_layers"):  # MCore's MTP block after the decoder, on the last stage
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        chunk["mtp_block_spec"] = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False,
                                                         vp_stage=vp_stage, pp_rank=pp_rank)
    model = GPTModel(
        config,
        _block_spec(layer_spec, attention, config, vp_stage, pp_rank),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=pp_rank == 0 and (vp_stage or 0) == 0,
        post_process=pp_rank == pp - 1 and (vp_stage or 0) == vp - 1,
        position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
        **chunk,
    )
    model.to(device=device, dtype=cfg.dtype)
    init_weights(model, cfg.seed, tp_group=get_pg(pg_collection, "tp"))
    if attention == "te":
        # MCore's TE attention reads the global hierarchical groups, not pg_collection.hcp.
        from cpkit.attention.te import bind_te_attention_groups

        bind_te_attention_groups(model, pg_collection)
    from cpkit.parallel.groups import log_groups

    log_groups(pg_collection)  # the "verify in logs" signal, once, on global rank 0
    return model


def build_gpt_chunks(cfg: GPTConfig, pg_collection, *, vp_size: int, **kwargs) -> list:
    """The `vp_size` virtual-pipeline chunks of this rank's pipeline stage (a list of
    GPTModels, chunk i with vp_stage=i), for MCore's interleaved schedule; the other arguments
    as build_gpt. Each chunk's layers get their global numbers, so weights match a pp=1 model."""
    chunk_cfg = cfg.with_(extra={**cfg.extra, "virtual_pipeline_model_parallel_size": vp_size})
    return [build_gpt(chunk_cfg, pg_collection, vp_stage=i, **kwargs) for i in range(vp_size)]


# --- deterministic, layout-independent weights -----------------------------------------------


TE_FUSED_NORM_NAMES = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)
"""(TE-spec name part, local-spec name part) of the layer norms TE fuses into a linear."""


def local_spec_name(name: str) -> str:
    """The local-spec name of a parameter name: TE's fused layer norms are renamed, so a TE-spec
    and a local/cpkit-spec model get the same weights from one seed."""
    for fused, local in TE_FUSED_NORM_NAMES:
        head, sep, tail = name.partition(fused)
        if sep and (not head or head.endswith(".")):
            return head + local + tail
    return name


def _partition_dims(model) -> dict[str, int]:
    """Parameter name -> tensor-parallel partition dim, from MCore's parallel module types
    (and TE's linears, which say `parallel_mode` "column" or "row")."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    dims = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims[f"{prefix}weight"] = 0
            dims[f"{prefix}bias"] = 0
        elif isinstance(mod, RowParallelLinear):
            dims[f"{prefix}weight"] = 1
        elif getattr(mod, "parallel_mode", None) == "column":
            dims[f"{prefix}weight"] = 0
            dims[f"{prefix}bias"] = 0
        elif getattr(mod, "parallel_mode", None) == "row":
            dims[f"{prefix}weight"] = 1
    return dims


def _global_names(model) -> dict[str, str]:
    """Parameter name -> name with the layer's global number (pipeline stages number locally)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    renames = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, TransformerLayer):
            local = mod_name.rsplit(".", 1)[-1]
            renames[mod_name] = mod_name[: -len(local)] + str(mod.layer_number - 1)
    out = {}
    for name, _ in model.named_parameters():
        mod_name = name.rsplit(".", 1)[0]
        for prefix, new in renames.items():
            if mod_name == prefix or mod_name.startswith(prefix + "."):
                name_global = new + name[len(prefix):]
                break
        else:
            name_global = name
        out[name] = local_spec_name(name_global)
    return out


@torch.no_grad()
def init_weights(model, seed: int, tp_group=None) -> None:
    """Set every parameter from (seed, its global name), as the same slice a tp=1 model would hold.

    Norm weights are drawn around 1, everything else around 0 with std 0.02 (biases too, so
    that tests notice a bias that is lost). The full tensor is generated on CPU in fp32 and the
    tensor-parallel shard sliced from it, so any tp, pp or cp layout starts identical.
    """
    tp = group_size(tp_group)
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    dims = _partition_dims(model)
    names = _global_names(model)
    for name, param in model.named_parameters():
        global_name = names[name]
        dim = dims.get(name)
        full_shape = list(param.shape)
        if dim is not None and tp > 1:
            full_shape[dim] *= tp
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
        full = torch.randn(full_shape, generator=gen) * 0.02
        if "layernorm" in global_name and global_name.endswith("weight"):
            full = 1.0 + 5 * full
        if dim is not None and tp > 1:
            full = full.chunk(tp, dim=dim)[tp_rank]
        param.copy_(full.to(param.dtype))


# --- batches and losses ----------------------------------------------------------------------


def make_batch(cfg: GPTConfig, batch_size: int = 2, seed: int = 0, device=None) -> dict:
    """A fixed batch of the full sequence: tokens, labels, position_ids [b, s]; loss_mask [b, s]."""
    gen = torch.Generator().manual_seed(cfg.seed + 7919 * seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length + 1), generator=gen)
    batch = {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(cfg.seq_length).expand(batch_size, -1).contiguous(),
        "loss_mask": torch.ones(batch_size, cfg.seq_length),
    }
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    return batch


def train_step(model, local_batch: dict, pg_collection, *, lr: float = 0.1, packed_seq_params=None) -> float:
    """Forward, backward, gradient reduction over dp x cp, one SGD step; returns the global loss.

    Gradients stay in `.grad` after the step so tests can compare them (see named_gradients).
    Raises CPConfigError for pp > 1 (no pipeline schedule here).
    """
    require_single_stage(pg_collection, "train_step")
    model.zero_grad(set_to_none=True)
    total = total_tokens(local_batch, pg_collection)
    loss = forward_loss(model, local_batch, pg_collection, total_tokens=total,
                        packed_seq_params=packed_seq_params)
    loss.backward()
    reduce_gradients(model, pg_collection)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
    return global_loss(loss, pg_collection)


@torch.no_grad()
def eval_step(model, local_batch: dict, pg_collection, *, packed_seq_params=None) -> float:
    """Forward only; returns the global mean loss over the dp x cp ranks (pp = 1 only)."""
    require_single_stage(pg_collection, "eval_step")
    was_training = model.training
    model.eval()
    try:
        total = total_tokens(local_batch, pg_collection)
        loss = forward_loss(model, local_batch, pg_collection, total_tokens=total,
                            packed_seq_params=packed_seq_params)
        return global_loss(loss, pg_collection)
    finally:
        model.train(was_training)


def _full_tensors(model, tp_group, pick) -> dict[str, torch.Tensor]:
    tp = group_size(tp_group)
    dims = _partition_dims(model)
    names = _global_names(model)
    out = {}
    for name, p in model.named_parameters():
        t = pick(p)
        if t is None:
            continue
        t = t.detach()
        dim = dims.get(name)
        if dim is not None and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=dim)
        out[names[name]] = t.float().cpu().clone()  # a snapshot, never a view of the live tensor
    return out


def named_gradients(model, tp_group=None) -> dict[str, torch.Tensor]:
    """Gradients by global parameter name, gathered to the full (tp=1) shape, on CPU in fp32.

    Collective over `tp_group` when its size is > 1.
    """
    return _full_tensors(model, tp_group, lambda p: p.grad)


def named_parameters_full(model, tp_group=None) -> dict[str, torch.Tensor]:
    """Parameters by global name, gathered to the full (tp=1) shape, on CPU in fp32."""
    return _full_tensors(model, tp_group, lambda p: p)
