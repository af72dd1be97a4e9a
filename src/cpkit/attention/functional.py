"""`context_parallel_attention`: the one entry point of the CP attention variants.

It checks the configuration and the inputs (CPConfigError, a ValueError, naming the field, the
value, the rule and the fix), then runs `p2p`, `all_gather`, `a2a` or `a2a+p2p`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from cpkit.attention.a2a import a2a_attention
from cpkit.attention.all_gather import all_gather_attention
from cpkit.attention.band import check_window
from cpkit.attention.chunks import local_seq
from cpkit.attention.comm import group_size
from cpkit.attention.hierarchical import hierarchical_attention
from cpkit.attention.options import CPAttentionOptions, default_options
from cpkit.attention.p2p import ring_attention
from cpkit.errors import CPConfigError
from cpkit.parallel.group_info import check_hierarchical_groups
from cpkit.parallel.layout import A2A, A2A_P2P, ALL_GATHER, COMM_TYPE_SPELLING_HINTS, CP_COMM_TYPES, P2P
from cpkit.sharding import check_cu_seqlens

__all__ = ["context_parallel_attention", "check_comm_type", "check_a2a_heads", "CP_COMM_TYPES"]

CPGroup = Union[dist.ProcessGroup, Sequence[dist.ProcessGroup], None]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_comm_type(cp_comm_type: str) -> str:
    """Return `cp_comm_type` if it is one of CP_COMM_TYPES; CPConfigError otherwise."""
    if cp_comm_type in CP_COMM_TYPES:
        return cp_comm_type
    hint = COMM_TYPE_SPELLING_HINTS.get(str(cp_comm_type).lower())
    fix = f'use "{hint}"' if hint else f"use one of {', '.join(CP_COMM_TYPES)}"
    raise CPConfigError.single("cp_comm_type", cp_comm_type, f"must be one of {list(CP_COMM_TYPES)}", fix)


def check_a2a_heads(heads: int, kv_heads: int, a2a_size: int, comm: str = A2A) -> None:
    """CPConfigError unless heads and kv heads divide by the all-to-all group size."""
    for name, value in (("heads (q.shape[-2])", heads), ("kv heads (k.shape[-2])", kv_heads)):
        if value % a2a_size:
            raise CPConfigError.single(
                name, value, f"{comm} splits heads over the {a2a_size} ranks of its all-to-all "
                f"group, so it must be divisible by {a2a_size}",
                "use p2p or all_gather, a smaller a2a group, or a head count divisible by it",
            )


def _groups(cp_group: CPGroup, comm: str):
    """(a2a_group, p2p_group) for a2a+p2p, else (group,) ; () for no CP."""
    if cp_group is None:
        return ()
    is_list = isinstance(cp_group, (list, tuple))
    if comm == A2A_P2P:
        return check_hierarchical_groups(cp_group, source="cp_group",
                                         fix="pass pg_collection.hcp (cpkit.parallel.groups builds it)")
    if is_list or not isinstance(cp_group, dist.ProcessGroup):
        raise CPConfigError.single(
            "cp_group", _describe(cp_group),
            f"cp_comm_type={comm!r} takes one process group",
            "pass the CP group (pg_collection.cp); a [a2a, p2p] list is for cp_comm_type='a2a+p2p'",
        )
    return (cp_group,)


def _describe(cp_group) -> str:
    if isinstance(cp_group, (list, tuple)):
        return f"{type(cp_group).__name__} of {len(cp_group)}: [{', '.join(type(g).__name__ for g in cp_group)}]"
    return type(cp_group).__name__


def _check_tensors(q, k, v, cu_seqlens) -> bool:
    """Shape/dtype checks; returns True for THD."""
    if q.dim() not in (3, 4):
        raise CPConfigError.single("q.shape", tuple(q.shape), "must be [s, b, heads, dim] or THD [t, heads, dim]",
                                   "pass sequence-first q (MCore's layout)")
    thd = q.dim() == 3
    if thd and cu_seqlens is None:
        raise CPConfigError.single("cu_seqlens", None, "THD input [t, heads, dim] needs cu_seqlens",
                                   "pass the global padded cu_seqlens (cpkit.sharding.pad_cu_seqlens)")
    if not thd and cu_seqlens is not None:
        raise CPConfigError.single("cu_seqlens", "given", "cu_seqlens is only for THD input [t, heads, dim]",
                                   "drop cu_seqlens, or pass packed [t, heads, dim] tensors")
    if k.shape[:-1] != v.shape[:-1] or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise CPConfigError.single(
            "k.shape/v.shape", (tuple(k.shape), tuple(v.shape)),
            f"must equal q.shape={tuple(q.shape)} except for the (kv) heads dim (and v's head dim, "
            "which may differ: MLA)",
            "pass k and v of the same local tokens, batch and kv heads, k with q's head dim",
        )
    if q.shape[-2] % k.shape[-2]:
        raise CPConfigError.single("kv heads (k.shape[-2])", k.shape[-2],
                                   f"must divide the query heads {q.shape[-2]} (GQA)", "fix num_query_groups")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise CPConfigError.single("dtype", (q.dtype, k.dtype, v.dtype),
                                   "q, k, v must share one of float32, bfloat16, float16", "cast them")
    if k.device != q.device or v.device != q.device:
        raise CPConfigError.single("device", (q.device, k.device, v.device), "q, k, v must be on one device",
                                   "move them to one device")
    return thd


# The host check of an offsets tensor (one device sync) runs once per tensor, not once per
# layer: its result is kept on the tensor itself, so it lives and dies with it (no process-wide
# cache), and an in-place change (a new _version) or other sizes check it again.
_CHECKED_ATTR = "_cpkit_cu_checked"


def _longest_sequence(cu_seqlens: torch.Tensor, t_local: int, cp: int) -> int:
    """Check the global padded offsets on the host (once per tensor); return the longest length."""
    hit = getattr(cu_seqlens, _CHECKED_ATTR, None)
    if hit is not None and hit[:3] == (cu_seqlens._version, cp, t_local):
        return hit[3]
    cu = check_cu_seqlens(cu_seqlens, cp)
    if cu[-1] != t_local * cp:
        raise CPConfigError.single(
            "cu_seqlens[-1]", cu[-1], f"must equal t_local * cp = {t_local} * {cp}",
            "pass the GLOBAL padded cu_seqlens of the full packed batch, and q of this rank's "
            "shard (cpkit.sharding.shard_thd)",
        )
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    setattr(cu_seqlens, _CHECKED_ATTR, (cu_seqlens._version, cp, t_local, longest))
    return longest


def _check_thd(cu_seqlens: torch.Tensor, max_seqlen, t_local: int, cp: int, device):
    """(global padded cu_seqlens as int64 on `device`, max length divisible by 2*cp).

    The offsets are checked on the host once per tensor object (one sync per micro-batch on
    GPU, not per layer). The max length is the larger of `max_seqlen` and the longest padded
    sequence, so an unpadded max_seqlen is safe too.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise CPConfigError.single("cu_seqlens", (tuple(cu_seqlens.shape), cu_seqlens.dtype),
                                   "must be 1-D integer offsets [n + 1]", "pass int32 cumulative lengths")
    longest = _longest_sequence(cu_seqlens, t_local, cp)
    max_seqlen = longest if max_seqlen is None else max(int(max_seqlen), longest)
    mult = 2 * cp if cp > 1 else 1
    max_seqlen = (max_seqlen + mult - 1) // mult * mult
    return cu_seqlens.to(device=device, dtype=torch.int64), max(max_seqlen, 1)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group: CPGroup,
    cp_comm_type: str,
    causal: bool,
    softmax_scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    options: Optional[CPAttentionOptions] = None,
    window_size: Optional[tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Context-parallel attention of this rank's shard; differentiable; output shaped like q.

    Shapes (sequence-first, MCore's): q [s_local, b, heads, dim], k/v [s_local, b, kv_heads, dim]
    (GQA when kv_heads < heads); or THD q [t_local, heads, dim] with `cu_seqlens`. v may have
    its own head dim (MLA: MCore's v_channels); the output then has v's head dim. Under
    all_gather the smaller of the two is zero-padded to the larger inside (exact: zero value
    columns add zero output columns, zero q/k columns add zero scores), at the cost of the
    padding's bytes, as it gathers k and v as one tensor; the ring (p2p, a2a+p2p) packs k and v
    flat in one buffer and a2a's all-to-alls pack each tensor's heads flat, so they send and
    compute v as it is (the cuDNN frontend takes it natively, the other kernels get padded
    copies per call). Every input
    is this rank's shard in the load-balanced layout (`cpkit.sharding`: chunks r and 2cp-1-r).

    cu_seqlens: THD only, the GLOBAL padded offsets (int32 [n + 1], every length a multiple of
    2*cp; TE's `cu_seqlens_padded`), not the local ones. They are checked on the host once per
    tensor object (one device sync per micro-batch). max_seqlen: optional hint; the longest
    padded sequence is used when larger. Padding tokens at the end of a sequence are attended
    like real tokens, which is exact for the real tokens only under a causal mask. Without CP
    (cp_group None or of size 1) no length constraint applies.

    cp_group: the CP process group; for "a2a+p2p" the list [a2a_group, p2p_group] (TE's
    convention, CP position = p2p_rank * |a2a| + a2a_rank); None runs local attention.
    cp_comm_type: "p2p" (ring), "all_gather", "a2a" (Ulysses) or "a2a+p2p".
    causal: causal (top-left) mask over the full sequence, or no mask.
    softmax_scale: defaults to 1/sqrt(dim).
    window_size: sliding window (left, right) as MCore/TE give it (-1: unbounded; the right side
    is 0 under a causal mask): a query at position i sees keys i - left .. i + right of its own
    sequence. Ring steps whose blocks lie wholly outside the window skip their compute (sbhd);
    the rest use the band mask (exact math; `band.py`).
    softmax_offset: per-head sink logits [heads] (MCore softmax_type "off-by-one": zeros,
    "learnable": a parameter, which gets its gradient; summed over the CP ranks it is the
    gradient of the whole sequence). Applied once, after the last LSE merge.
    options: ring batching, a2a head chunks and kernel choice (`CPAttentionOptions`; default
    `default_options()`, the environment read once). Every rank must pass equal options.

    Memory: inputs are used through views (sbhd -> the kernels' layouts); p2p and all_gather
    keep one float32 output accumulator (merged by LSE) and a float32 dq accumulator in
    backward; dKV is accumulated and communicated in the input dtype (as TE does). Nothing of
    size s^2 and, besides all_gather's gathered KV, nothing of size cp x local. The output is
    in q.dtype and may be a non-contiguous view (use reshape).
    Backward returns grads in the dtypes of q, k, v.

    Raises CPConfigError (ValueError) for an unknown comm type, a group that does not fit it,
    mismatched shapes/dtypes, an odd local sequence (global not divisible by 2*cp), heads or
    kv heads not divisible by the a2a size, or THD offsets that are not padded to 2*cp.
    """
    comm = check_comm_type(cp_comm_type)
    window = check_window(window_size, causal)
    if options is None:
        options = default_options()
    elif not isinstance(options, CPAttentionOptions):
        raise CPConfigError.single("options", type(options).__name__, "must be a CPAttentionOptions or None",
                                   "pass cpkit.attention.CPAttentionOptions(...)")
    groups = _groups(cp_group, comm)
    thd = _check_tensors(q, k, v, cu_seqlens)
    cp = group_size(groups)  # the product over both levels; 1 without CP
    if comm in (A2A, A2A_P2P) and groups:
        check_a2a_heads(q.shape[-2], k.shape[-2], group_size(groups[0]), comm)
    if not thd and cp > 1 and q.shape[0] % 2:
        raise CPConfigError.single(
            "s_local (q.shape[0])", q.shape[0],
            "must be even: each rank holds 2 chunks (the global sequence is divisible by 2*cp)",
            "pad the global sequence to a multiple of 2*cp and shard it with cpkit.sharding.shard_seq",
        )
    _check_sink(softmax_offset, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    v_dim = v.shape[-1]
    if cp > 1 and comm == ALL_GATHER:  # it gathers k and v as one tensor; the ring packs them
        q, k, v = _pad_head_dims(q, k, v)  # flat (RingKV) and a2a packs flat heads: v as it is
    # The kernels need a unit stride on the head dim; anything else is fine as a view.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cu = None
    if thd:
        cu, max_seqlen = _check_thd(cu_seqlens, max_seqlen, q.shape[0], cp, q.device)
    extra = (window, softmax_offset)
    if cp == 1:
        out = ring_attention(q, k, v, None, causal, scale, local_seq(q.shape[0], 1, cu, max_seqlen), options, *extra)
    elif comm == P2P:
        out = ring_attention(q, k, v, groups[0], causal, scale, local_seq(q.shape[0], cp, cu, max_seqlen), options,
                             *extra)
    elif comm == ALL_GATHER:
        out = all_gather_attention(q, k, v, groups[0], causal, scale, local_seq(q.shape[0], cp, cu, max_seqlen),
                                   options, *extra)
    elif comm == A2A:
        out = a2a_attention(q, k, v, groups[0], None, causal, scale, options, cu, max_seqlen, *extra)
    else:
        out = hierarchical_attention(q, k, v, groups[0], groups[1], causal, scale, options, cu, max_seqlen, *extra)
    return out if out.shape[-1] == v_dim else out[..., :v_dim]


def _pad_head_dims(q, k, v):
    """q, k, v with one head dim: v zero-padded up to q/k's, or q and k up to v's (MLA)."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        v = torch.nn.functional.pad(v, (0, dq - dv))
    elif dv > dq:
        q, k = (torch.nn.functional.pad(x, (0, dv - dq)) for x in (q, k))
    return q, k, v


def _check_sink(sink, q) -> None:
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor) or sink.shape != (q.shape[-2],) or not sink.dtype.is_floating_point:
        raise CPConfigError.single(
            "softmax_offset", tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__,
            f"must be a float tensor [heads] = [{q.shape[-2]}], one sink logit per query head of this rank",
            "pass zeros for softmax_type='off-by-one' or the learnable per-head parameter",
        )
    if sink.device != q.device:
        raise CPConfigError.single("softmax_offset.device", sink.device, f"must be q's device {q.device}",
                                   "move it to q's device")
