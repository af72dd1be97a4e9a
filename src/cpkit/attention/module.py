"""`ContextParallelAttention`: the MCore core-attention module over cpkit's CP attention.

It plugs into an MCore layer spec where `DotProductAttention` / `TEDotProductAttention` go
(`SelfAttentionSubmodules.core_attention`), follows their constructor and forward contract, and
runs `cpkit.attention.context_parallel_attention` over the CP group of `pg_collection`.

Groups are explicit: the CP group is `pg_collection.cp`, the hierarchical groups of `a2a+p2p`
are `pg_collection.hcp` (never MCore's global parallel_state). `set_context_parallel_group` has
Transformer Engine's signature, so code that rebinds groups (eval at another CP degree, dynamic
CP) treats both backends alike; a per-micro-batch `packed_seq_params.cp_group` is used for that
one forward and the previous binding restored afterwards.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from cpkit.attention.functional import check_comm_type, context_parallel_attention
from cpkit.attention.options import CPAttentionOptions, default_options
from cpkit.compat import get_pg
from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.group_info import check_hierarchical_groups, group_size, require_hierarchical_groups
from cpkit.parallel.layout import A2A_P2P, P2P

__all__ = ["ContextParallelAttention"]


# Causal masks that mean "top-left causal" for self-attention with equal q/kv lengths.
_CAUSAL_MASKS = {"causal", "causal_bottom_right"}
_SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_NO_MASKS = {"no_mask"}
# With THD, "padding" only says that cu_seqlens delimit the sequences (TE's reading); no tensor.
_THD_MASKS = {"padding_causal": True, "padding_causal_bottom_right": True, "padding": False}

CPGroup = Union[dist.ProcessGroup, Sequence[dist.ProcessGroup], None]

_HCP_FIX = ("build the collection with cpkit.parallel.groups.build_pg_collection(layout) for a layout with "
            "hierarchical_context_parallel_sizes, or set pg_collection.hcp = [a2a_group, p2p_group]")


def _mask_name(mask: Any) -> str:
    return mask.name if isinstance(mask, AttnMaskType) else str(mask)


def _is_causal(mask: Any, thd: Optional[bool]) -> bool:
    """True for causal, False for no mask; CPConfigError for masks that need a mask tensor.

    `thd`: True for a THD forward (padding masks allowed, as TE reads them), False for sbhd,
    None at build time (the format is not known yet: padding masks allowed, checked per forward).
    """
    name = _mask_name(mask)
    if name in _CAUSAL_MASKS:
        return True
    if name in _NO_MASKS:
        return False
    if name in _THD_MASKS and thd is not False:
        return _THD_MASKS[name]
    raise CPConfigError.single(
        "attn_mask_type",
        name,
        "ContextParallelAttention supports causal and no_mask (and padding / padding_causal "
        "only with THD, where cu_seqlens delimit the sequences); a mask tensor cannot be "
        "sharded across CP ranks",
        "use AttnMaskType.causal or AttnMaskType.no_mask; for packed variable-length "
        "sequences use THD (packed_seq_params.qkv_format='thd') instead of a padding mask",
    )


def _check_comm_type(cp_comm_type: Any) -> str:
    """None -> "p2p" (MCore passes None at cp=1); otherwise one of CP_COMM_TYPES or CPConfigError."""
    return P2P if cp_comm_type is None else check_comm_type(cp_comm_type)


def _resolve_build_groups(config, pg_collection, cp_comm_type: str) -> tuple[CPGroup, Optional[list]]:
    """(cp_group for the kernels, cp_global_ranks) at build time.

    CP is on when config.context_parallel_size > 1 (as in TE: a valid CP group may exist for a
    part of the model that runs without CP); the group then comes from pg_collection.cp.
    """
    cp_size = config.context_parallel_size
    if cp_size <= 1:
        return None, None
    cp = get_pg(pg_collection, "cp")
    if cp is None:
        raise CPConfigError.single(
            "pg_collection.cp",
            None,
            f"context_parallel_size={cp_size} needs the CP group in pg_collection",
            "pass pg_collection with cp set (cpkit.parallel.groups.build_pg_collection builds it); "
            "ContextParallelAttention does not read MCore's global parallel_state",
        )
    # The hierarchical gate first: its message says what is missing, not only that sizes differ.
    hcp = None
    if cp_comm_type == A2A_P2P:
        hcp = _require_hcp(pg_collection, getattr(config, "hierarchical_context_parallel_sizes", None))
    if dist.get_world_size(cp) != cp_size:
        raise CPConfigError.single(
            "pg_collection.cp",
            dist.get_world_size(cp),
            f"the CP group size must equal config.context_parallel_size={cp_size}",
            "build pg_collection for the same layout as the TransformerConfig",
        )
    return (hcp if hcp is not None else cp), dist.get_process_group_ranks(cp)


def _require_hcp(pg_collection, sizes: Optional[Sequence[int]]) -> list:
    """pg_collection.hcp checked for a2a+p2p (and against the config's
    hierarchical_context_parallel_sizes when set): the build-time gate of cpkit.parallel.group_info."""
    return list(require_hierarchical_groups(pg_collection, A2A_P2P, hierarchical_context_parallel_sizes=sizes))


class ContextParallelAttention(MegatronModule):
    """MCore core attention with context parallelism, backed by `context_parallel_attention`.

    Build it through a layer spec (`cpkit.attention.spec.get_gpt_layer_spec_with_cp_attention`);
    MCore's `Attention` calls the constructor with `config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection`.

    Shapes: sbhd `query` [s_local, b, heads, dim], `key`/`value` [s_local, b, kv_heads, dim]
    (GQA when kv_heads < heads), output [s_local, b, heads * dim]. THD
    (`packed_seq_params.qkv_format == "thd"`): MCore squeezes the batch dim, so `query` is
    [t_local, heads, dim] and the output [t_local, heads * dim], like TE's. Each rank holds its
    CP shard in the load-balanced 2*cp-chunk layout (`cpkit.sharding`, MCore's `get_batch_on_this_cp_rank`).

    Options: `options` (a `CPAttentionOptions`, e.g. from the layer spec's params) sets ring
    batching, a2a head chunks and the kernel; default `default_options()` (the environment, read
    once per process).

    Groups: pg_collection.cp (pg_collection.hcp = [a2a, p2p] for `a2a+p2p`). With
    config.context_parallel_size == 1 or no group it runs plain local attention through the
    same kernels.

    Masks: causal and no_mask; with THD also padding_causal / padding (TE's reading: the
    sequences are delimited by cu_seqlens, no mask tensor). `attention_mask` is ignored.

    Features: MLA (MCore passes k_channels / v_channels; q/k and v head dims may differ), the
    sliding window of config.window_size on the layers window_attn_skip_freq selects, and
    softmax_type "off-by-one" / "learnable" (the parameter `softmax_offset`, one logit per query
    head of this TP rank), under every comm type, sbhd and THD.

    Raises CPConfigError at build time for: an unknown cp_comm_type; `a2a+p2p` without
    valid hierarchical groups; attention dropout > 0; an arbitrary mask; an unknown
    softmax_type; qk-clip; cross attention.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = P2P,
        pg_collection=None,
        options: Optional[CPAttentionOptions] = None,
        **unused: Any,
    ):
        super().__init__(config=config)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.pg_collection = pg_collection
        # Speed settings (ring batching, a2a head chunks, kernel); a layer spec passes them as
        # ModuleSpec params. Read from the environment once per process when not given.
        self.options = default_options() if options is None else options
        self._check_config(attention_dropout, layer_number)
        _is_causal(attn_mask_type, thd=None)  # a bad mask fails at build, not at the first step

        # The effective scale of MCore's DotProductAttention: apply_query_key_layer_scaling
        # divides the scores by layer_number and the softmax multiplies them back, so the
        # math is softmax(q k^T * softmax_scale) either way.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.softmax_scale = softmax_scale

        self.cp_comm_type = _check_comm_type(cp_comm_type)
        self.cp_group, self.cp_global_ranks = _resolve_build_groups(
            config, pg_collection, self.cp_comm_type
        )
        self.cp_stream = None  # kept for TE parity; the pure-PyTorch kernels do not use it

        # Sliding window on the layers MCore's window_attn_skip_freq selects (as its own
        # DotProductAttention does); None elsewhere.
        window = getattr(config, "window_size", None)
        skip_freq = getattr(config, "window_attn_skip_freq", None)
        self.window_size = tuple(window) if window and is_layer_window_attention(window, skip_freq, self.layer_number) else None
        self._init_softmax_offset()

    def _init_softmax_offset(self) -> None:
        """MCore's sink logits, one per query head of this TP rank: "off-by-one" a zero buffer
        (not saved), "learnable" the parameter `softmax_offset` (MCore's name, so checkpoints
        load either way); None for the vanilla softmax. On the CUDA device unless
        config.use_cpu_initialization (or no CUDA)."""
        softmax_type = getattr(self.config, "softmax_type", "vanilla")
        if softmax_type == "vanilla":
            self.softmax_offset = None
            return
        tp = get_pg(self.pg_collection, "tp") if self.pg_collection is not None else None
        heads = self.config.num_attention_heads // group_size(tp)
        on_cpu = self.config.use_cpu_initialization or not torch.cuda.is_available()
        device = "cpu" if on_cpu else torch.cuda.current_device()
        zeros = torch.zeros(heads, device=device, dtype=self.config.params_dtype)
        if softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", zeros, persistent=False)
            return
        self.softmax_offset = torch.nn.Parameter(zeros)
        if self.config.perform_initialization:
            self.config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sink logits, split over TP along the heads (as MCore saves them)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        kwargs = {}
        if metadata is not None and "dp_cp_group" in metadata:
            kwargs["dp_cp_group"] = metadata["dp_cp_group"]
        tp = get_pg(self.pg_collection, "tp") if self.pg_collection is not None else None
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=tp, **kwargs)

    def _check_config(self, attention_dropout: Optional[float], layer_number: int) -> None:
        config = self.config
        violations = []
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and dropout > 0:
            violations.append(
                Violation(
                    "attention_dropout",
                    dropout,
                    "ContextParallelAttention does not implement attention dropout",
                    "set TransformerConfig.attention_dropout=0.0 (MCore's default is 0.1)",
                )
            )
        if self.attention_type != "self":
            violations.append(
                Violation(
                    "attention_type",
                    self.attention_type,
                    "only self-attention is supported (q and kv share the CP sharding)",
                    "use TEDotProductAttention or DotProductAttention for cross attention",
                )
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in _SOFTMAX_TYPES:
            violations.append(
                Violation(
                    "softmax_type",
                    softmax_type,
                    f"must be one of {list(_SOFTMAX_TYPES)}",
                    "use vanilla, off-by-one (sink logit 0) or learnable (a sink logit per head)",
                )
            )
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            violations.append(
                Violation(
                    "qk_clip",
                    True,
                    "qk-clip / max-logit logging is not supported",
                    "set qk_clip=False and log_max_attention_logit=False or use the TE spec",
                )
            )
        if violations:
            raise CPConfigError(violations)

    # ------------------------------------------------------------------ groups

    def set_context_parallel_group(
        self,
        cp_group: CPGroup,
        cp_global_ranks: Optional[Sequence[int]],
        cp_stream: Any = None,
        cp_comm_type: str = P2P,
    ) -> None:
        """Bind the CP group(s); TE's `DotProductAttention.set_context_parallel_group` signature.

        `cp_group` is a ProcessGroup for p2p / all_gather / a2a, a list [a2a_group, p2p_group]
        for a2a+p2p, or None (no CP: local attention). `cp_global_ranks` are the global ranks
        of the whole CP group; `cp_stream` is accepted and kept for parity (unused here).
        Raises CPConfigError for an unknown comm type or a group that does not fit it.
        """
        cp_comm_type = _check_comm_type(cp_comm_type)
        if cp_group is not None:
            if cp_comm_type == A2A_P2P:
                cp_group = list(check_hierarchical_groups(cp_group, source="cp_group", fix=_HCP_FIX))
            elif isinstance(cp_group, (list, tuple)):
                raise CPConfigError.single(
                    "cp_group",
                    cp_group,
                    f"a list of groups is only valid for a2a+p2p, not {cp_comm_type}",
                    "pass a single ProcessGroup, or cp_comm_type='a2a+p2p'",
                )
        self.cp_group = cp_group
        self.cp_global_ranks = list(cp_global_ranks) if cp_global_ranks is not None else None
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type

    @property
    def cp_size(self) -> int:
        """The CP size of the current binding (1 when CP is off)."""
        return group_size(self.cp_group)

    @contextlib.contextmanager
    def _micro_batch_group(self, packed_seq_params) -> Iterator[None]:
        """Use packed_seq_params.cp_group / local_cp_size (dynamic CP) for one forward."""
        group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params else None
        local_size = getattr(packed_seq_params, "local_cp_size", None) if packed_seq_params else None
        if group is None and local_size is None:
            yield
            return
        saved = (self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type)
        try:
            if group is None:
                if local_size != 1:
                    raise CPConfigError.single(
                        "packed_seq_params.local_cp_size",
                        local_size,
                        "without packed_seq_params.cp_group only local_cp_size == 1 (CP off) "
                        "is meaningful",
                        "pass the CP group of this micro-batch in packed_seq_params.cp_group",
                    )
                self.set_context_parallel_group(None, None, self.cp_stream, self.cp_comm_type)
            else:
                self._bind_micro_batch_group(group, local_size)
            yield
        finally:
            self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = saved

    def _bind_micro_batch_group(self, group: CPGroup, local_size: Optional[int]) -> None:
        comm = self.cp_comm_type
        if comm == A2A_P2P and not isinstance(group, (list, tuple)):
            raise CPConfigError.single(
                "packed_seq_params.cp_group",
                group,
                "cp_comm_type='a2a+p2p' needs a list [a2a_group, p2p_group] per micro-batch",
                "pass [a2a_group, p2p_group], or use p2p / a2a / all_gather with dynamic CP",
            )
        if local_size is not None and group_size(group) != local_size:
            raise CPConfigError.single(
                "packed_seq_params.local_cp_size",
                local_size,
                f"must equal the size of packed_seq_params.cp_group ({group_size(group)})",
                "set local_cp_size to the group's size (or leave it None)",
            )
        if isinstance(group, (list, tuple)):
            ranks = sorted(
                {r for g in group for r in dist.get_process_group_ranks(g)}
            )
        else:
            ranks = dist.get_process_group_ranks(group)
        self.set_context_parallel_group(group, ranks, self.cp_stream, comm)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """CP attention over this rank's shard; see the class docstring for shapes.

        `attention_mask` is ignored, as in TE for causal / no_mask (the mask type says
        everything). Raises CPConfigError for an attention bias, a padding mask without THD,
        or THD with padded sequence lengths and no causal mask.
        """
        if attention_bias is not None:
            raise CPConfigError.single(
                "attention_bias", tuple(attention_bias.shape),
                "attention bias is not supported", "use the TE spec for attention bias",
            )
        qkv_format = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params else None
        mask = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = _is_causal(mask, thd=qkv_format == "thd")
        with self._micro_batch_group(packed_seq_params):
            if qkv_format == "thd":
                return self._forward_thd(query, key, value, causal, packed_seq_params)
            if qkv_format not in (None, "sbhd"):
                raise CPConfigError.single(
                    "packed_seq_params.qkv_format", qkv_format,
                    "MCore hands core attention sbhd or thd tensors",
                    "use qkv_format='thd' for packed sequences, or no packed_seq_params",
                )
            out = self._attend(query, key, value, causal)
            return out.reshape(out.shape[0], out.shape[1], -1)

    def _forward_thd(self, query, key, value, causal: bool, psp) -> torch.Tensor:
        if query.dim() == 4:  # [t, 1, h, d] from callers that did not squeeze
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        cu_padded = getattr(psp, "cu_seqlens_q_padded", None)
        cu_seqlens = cu_padded if cu_padded is not None else psp.cu_seqlens_q
        if cu_seqlens is None:
            raise CPConfigError.single(
                "packed_seq_params.cu_seqlens_q", None,
                "THD needs cu_seqlens of the full (padded) packed sequences",
                "set packed_seq_params.cu_seqlens_q (and cu_seqlens_q_padded when padded)",
            )
        if (
            not causal
            and cu_padded is not None
            and psp.cu_seqlens_q is not None
            and not torch.equal(cu_padded, psp.cu_seqlens_q)
        ):
            # With a causal mask the padding at the end of a sequence only feeds its own
            # (loss-masked) padding rows; without it real tokens would attend to padding.
            raise CPConfigError.single(
                "packed_seq_params.cu_seqlens_q_padded", "differs from cu_seqlens_q",
                "padded THD sequences are only exact with a causal mask",
                "use a causal mask, or pad nothing (cu_seqlens_q_padded=None)",
            )
        max_seqlen = getattr(psp, "max_seqlen_q", None)
        out = self._attend(query, key, value, causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return out.reshape(out.shape[0], -1)

    def _attend(self, query, key, value, causal: bool, cu_seqlens=None, max_seqlen=None):
        if group_size(self.cp_group) > 1:
            group, comm = self.cp_group, self.cp_comm_type
        else:  # CP off: local attention, whatever the configured comm type
            group, comm = None, P2P
        return context_parallel_attention(
            query,
            key,
            value,
            cp_group=group,
            cp_comm_type=comm,
            causal=causal,
            softmax_scale=self.softmax_scale,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            options=self.options,
            window_size=self.window_size,
            softmax_offset=self.softmax_offset,
        )

    def extra_repr(self) -> str:
        return (
            f"cp_comm_type={self.cp_comm_type}, cp_size={self.cp_size}, "
            f"mask={_mask_name(self.attn_mask_type)}, softmax_scale={self.softmax_scale:.4g}"
        )
