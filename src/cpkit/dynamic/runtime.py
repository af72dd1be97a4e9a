"""Dynamic-CP runtime: run one global batch of a plan, each micro-batch on its own CP group.

Per micro-batch m, on the rank at DPxCP position p (`dp_cp_position`):
1. `plan.assignment_for_rank(p, m)` gives this rank's group (ranks, samples, cp_size), or None.
2. `pack_thd` concatenates the group's samples into one THD sequence, each padded to a
   multiple of 2*cp_size (`cpkit.sharding.pad_cu_seqlens`); `PackedTHD.shard` keeps this
   rank's tokens (`cpkit.sharding.shard_thd`) with their per-sequence RoPE positions.
3. `packed_seq_params_for` carries the group to the model: PackedSeqParams(qkv_format="thd",
   cu_seqlens_q = real offsets, cu_seqlens_q_padded = padded offsets, local_cp_size,
   cp_group). Newer MCore resolves the group from it (`resolve_cp_group`); MCore 0.16's
   TEDotProductAttention switches to it and never switches back, and 0.16's Attention applies
   THD RoPE over `self.pg_collection.cp`, the group it was built with.
4. `use_cp_group(model, group)` therefore also rebinds every cached CP group of the model
   (cpkit.eval_cp.rebind.install_pg_collection: pg_collection, RoPE and language-module groups, CP
   attention through set_context_parallel_group, config.context_parallel_size) for the forward
   and restores each of them, exactly, in a `finally` block.

Idle ranks and collectives (no hang by construction): inside a micro-batch only the CP group
of each assignment communicates, and only its members enter that forward. Everything that
spans the DPxCP group happens once per step, on every rank: the token count before the first
forward, the gradient and the loss reductions after the last backward. A rank without an
assignment backpropagates `zero_loss(model)`, a zero that touches every trainable parameter, so
gradient hooks (MCore DDP's bucketed all-reduce) fire on it exactly as on the busy ranks.

Loss: every rank returns sum(its local token losses) / T, T = the number of loss tokens of the
whole global batch (an all-reduce of the local counts). Summed over micro-batches and over the
DPxCP ranks it is the mean over all tokens of all samples, the number a cp=1 run reports, and
so are the summed gradients (`cpkit.loss.all_reduce_gradients`). MoE router aux and z losses
are per token of the global batch too: each backward runs with MCore's aux-loss scale 1/T
(the router multiplies them by the local token count under calculate_per_token_loss; without
it the scale is the micro-batch's token count / T), as in cpkit.dynamic.pipeline.

Backward may run outside `use_cp_group` (cpkit's and TE's attention keep the group of the
forward in the autograd context), so a pipeline schedule can wrap only its forward step.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.dynamic.plan import CPGroupAssignment, Plan
from cpkit.dynamic.registry import GroupRegistry
from cpkit.errors import CPConfigError
from cpkit.loss import all_reduce_gradients, forward_loss
from cpkit.parallel.group_info import global_ranks, group_rank, group_size
from cpkit.eval_cp.rebind import rebound
from cpkit.sharding import offsets_to, pad_cu_seqlens, shard_thd, thd_position_ids

__all__ = [
    "PackedTHD",
    "pack_thd",
    "packed_seq_params_for",
    "use_cp_group",
    "zero_loss",
    "dp_cp_position",
    "agree_on_tokens",
    "LocalMicrobatch",
    "prepare_microbatch",
    "forward_backward_local",
    "DynamicStepResult",
    "dynamic_cp_step",
]

SampleFn = Callable[[int], Mapping[str, torch.Tensor]]
LossFn = Callable[..., torch.Tensor]


def agree_on_tokens(local_tokens: int, failure: Optional[BaseException], group: Any, device: Any,
                    caller: str) -> float:
    """The token count of the whole step over the DPxCP `group` (each token is held by exactly
    one rank of its CP group), and in the same all-reduce the number of ranks that failed to
    prepare their data: every rank then raises together (`failure` itself where it is this
    rank's, else RuntimeError naming `caller`) instead of the healthy ones waiting in a later
    collective."""
    stats = torch.tensor([local_tokens, failure is not None], dtype=torch.float64, device=device)
    if group_size(group) > 1:
        dist.all_reduce(stats, group=group)
    if failure is not None:
        raise failure
    if stats[1].item() > 0:
        raise RuntimeError(f"{caller}: {int(stats[1].item())} other rank(s) of the DPxCP group failed "
                           "to prepare their micro-batches (get_sample or packing); see their errors")
    return stats[0].item()


# ---------------------------------------------------------------------------------------------
# Packing (pure tensor logic, no process groups)


@dataclass(frozen=True)
class PackedTHD:
    """The samples of one CP group as one packed THD sequence (before sharding).

    `tensors[key]` is [1, T] (T = cu_seqlens_padded[-1]); sequence i occupies
    [cu_seqlens_padded[i], cu_seqlens_padded[i] + seq_lens[i]), followed by its padding.
    `cu_seqlens` are the real offsets, `cu_seqlens_padded` the offsets with every length
    rounded up to a multiple of 2*cp_size (both int32, [n + 1], on the tensors' device).
    """

    tensors: dict[str, torch.Tensor]
    seq_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    cp_size: int
    max_seqlen: int
    """The longest padded sequence (what TE and MCore's RoPE take as max_seqlen)."""

    def shard(self, cp_rank: int) -> dict[str, torch.Tensor]:
        """CP rank `cp_rank`'s tokens of every tensor ([1, T / cp_size], the 2*cp zigzag of
        each sequence, cpkit.sharding.shard_thd) plus `position_ids`: each local token's
        position in its own sequence (RoPE restarts at 0 for every packed sequence)."""
        cu = self.cu_seqlens_padded
        out = {k: shard_thd(v, cu, cp_rank, self.cp_size, seq_dim=1) for k, v in self.tensors.items()}
        out["position_ids"] = thd_position_ids(cu, cp_rank, self.cp_size).to(cu.device).unsqueeze(0)
        return out


def _check_samples(samples: Sequence[Mapping[str, torch.Tensor]]) -> tuple[list[str], list[int]]:
    if not samples:
        raise CPConfigError.single("samples", [], "at least one sample is needed to pack",
                                   "pass the samples of one CP group")
    keys = sorted(samples[0])
    lens = []
    for i, sample in enumerate(samples):
        if sorted(sample) != keys:
            raise CPConfigError.single(f"samples[{i}]", sorted(sample), f"must have the keys {keys}",
                                       "give every sample the same tensors (tokens, labels, loss_mask)")
        shapes = {k: tuple(v.shape) for k, v in sample.items()}
        lengths = {s[0] if len(s) == 1 else None for s in shapes.values()}
        if len(lengths) != 1 or None in lengths or 0 in lengths:
            raise CPConfigError.single(f"samples[{i}]", shapes, "every tensor must be 1-D, of one length >= 1",
                                       "pass one [L] tensor per key (no batch dim)")
        lens.append(lengths.pop())
    return keys, lens


def pack_thd(
    samples: Sequence[Mapping[str, torch.Tensor]],
    cp_size: int,
    *,
    pad_values: Optional[Mapping[str, float]] = None,
) -> PackedTHD:
    """Concatenate `samples` (each a dict of 1-D [L_i] tensors with the same keys) into THD.

    Each sequence is padded at its end up to a multiple of 2*cp_size with `pad_values[key]`
    (default 0: token 0, label 0, loss_mask 0, so padding never counts in the loss). Padding at
    the end of a sequence is exact under a causal mask: real tokens never attend to it.
    Raises CPConfigError for no samples, differing keys, or tensors that are not 1-D of one
    length per sample.
    """
    keys, lens = _check_samples(samples)
    pads = dict(pad_values or {})
    cu_padded = pad_cu_seqlens(lens, cp_size)
    padded = [b - a for a, b in zip(cu_padded[:-1].tolist(), cu_padded[1:].tolist())]
    tensors = {}
    for key in keys:
        parts = []
        for sample, length, width in zip(samples, lens, padded):
            x = sample[key]
            parts.append(x)
            if width > length:
                parts.append(x.new_full((width - length,), pads.get(key, 0)))
        tensors[key] = torch.cat(parts).unsqueeze(0)
    device = tensors[keys[0]].device
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PackedTHD(tensors=tensors, seq_lens=tuple(lens), cu_seqlens=offsets_to(cu, device),
                     cu_seqlens_padded=offsets_to(cu_padded, device), cp_size=cp_size, max_seqlen=max(padded))


def packed_seq_params_for(packed: PackedTHD, group: Any):
    """MCore PackedSeqParams for one packed micro-batch on CP group `group` (of packed.cp_size).

    qkv_format="thd"; cu_seqlens_q/kv are the real offsets and cu_seqlens_q/kv_padded the
    padded ones, both GLOBAL (TE's and cpkit's convention); max_seqlen_q/kv the longest padded
    sequence; local_cp_size and cp_group the micro-batch's group. On an MCore whose
    PackedSeqParams lacks cp_group / local_cp_size they are set as plain attributes (cpkit's
    attention reads them with getattr).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens,
        cu_seqlens_kv=packed.cu_seqlens,
        cu_seqlens_q_padded=packed.cu_seqlens_padded,
        cu_seqlens_kv_padded=packed.cu_seqlens_padded,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    psp.local_cp_size = packed.cp_size
    psp.cp_group = group
    return psp


# ---------------------------------------------------------------------------------------------
# The per-micro-batch group switch


def _model_collection(model: torch.nn.Module) -> Any:
    for module in model.modules():
        coll = vars(module).get("pg_collection")
        if coll is not None:
            return coll
    raise CPConfigError.single(
        "pg_collection", None, "the model keeps no pg_collection to derive the micro-batch collection from",
        "pass pg_collection= (the collection the model was built with)")


@contextlib.contextmanager
def use_cp_group(
    model: torch.nn.Module,
    group: Any,
    *,
    pg_collection: Any = None,
    cp_comm_type: Optional[str] = None,
    tp_cp_group: Any = None,
    hcp: Any = None,
) -> Iterator[Any]:
    """Inside the block `model` runs with CP group `group` (one micro-batch of dynamic CP).

    `pg_collection` is the collection the model was built with (default: the first one found
    on its modules); the block runs on a shallow copy of it whose `cp` is `group`, whose `tp_cp`
    is `tp_cp_group` (default: `group` at tp == 1, else the static one) and, when given, whose
    `hcp` is the block's [a2a, p2p] pair (for cp_comm_type "a2a+p2p"; GroupRegistry.hcp_for),
    installed with cpkit.eval_cp.rebind.install_pg_collection: every cached CP
    group, CP attention through set_context_parallel_group (cpkit's and TE's alike),
    config.context_parallel_size. On exit, also when the block raises, every rebound attribute
    is the object it was before. Yields the Rebinding. Raises CPConfigError for a nested use on
    the same model or a module that cannot change its CP size (MCore's local attention).
    """
    static = pg_collection if pg_collection is not None else _model_collection(model)
    target = copy.copy(static)  # never mutate the caller's collection
    target.cp = group
    if tp_cp_group is not None:
        target.tp_cp = tp_cp_group
    elif group_size(get_pg(static, "tp")) == 1:
        target.tp_cp = group  # tp x cp is cp itself at tp == 1
    if hcp is not None:
        target.hcp = list(hcp)
    with rebound(model, target, cp_comm_type=cp_comm_type) as rebinding:
        yield rebinding


def zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A float32 scalar 0 whose backward gives every trainable parameter a zero gradient.

    An idle rank backpropagates it so that per-parameter gradient hooks (MCore DDP's bucketed
    all-reduce) fire as on the ranks that ran a forward, and `.grad` exists everywhere.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise CPConfigError.single("model", type(model).__name__, "has no trainable parameter",
                                   "pass the model being trained")
    return torch.stack([p.reshape(-1)[0].float() for p in params]).sum() * 0.0


# ---------------------------------------------------------------------------------------------
# One micro-batch on this rank


def dp_cp_position(registry: GroupRegistry, global_rank: Optional[int] = None) -> int:
    """This rank's position in the registry's DPxCP group (the plan's rank numbering)."""
    rank = dist.get_rank() if global_rank is None else global_rank
    if rank not in registry.dp_cp_ranks:
        raise CPConfigError.single("global_rank", rank, f"is not in the DPxCP group {list(registry.dp_cp_ranks)}",
                                   "use the registry built for this rank (build_group_registry(..., rank))")
    return registry.dp_cp_ranks.index(rank)


@dataclass(frozen=True)
class LocalMicrobatch:
    """What this rank runs in one micro-batch: its shard of the group's packed samples."""

    index: int
    assignment: CPGroupAssignment
    group: Any
    cp_rank: int
    packed: PackedTHD
    batch: dict[str, torch.Tensor]
    """tokens, labels, loss_mask, position_ids (and any other sample key), each [1, T / cp]."""
    packed_seq_params: Any

    @property
    def num_tokens(self) -> float:
        """Loss tokens this rank holds (padding excluded)."""
        return float(self.batch["loss_mask"].float().sum())


def _check_plan(plan: Plan, registry: GroupRegistry) -> None:
    if plan.dp_cp_size != len(registry.dp_cp_ranks):
        raise CPConfigError.single(
            "plan.dp_cp_size", plan.dp_cp_size, f"must equal the registry's DPxCP size {len(registry.dp_cp_ranks)}",
            "schedule with dp_cp_size = the size of the DPxCP group the registry was built for")


def prepare_microbatch(
    plan: Plan,
    index: int,
    registry: GroupRegistry,
    position: int,
    get_sample: SampleFn,
    *,
    device: Any = None,
) -> Optional[LocalMicrobatch]:
    """This rank's micro-batch `index` of `plan`, or None when the rank is idle in it.

    `position` is this rank's DPxCP position (dp_cp_position); `get_sample(i)` returns sample
    i as 1-D tensors (tokens, labels, loss_mask, ...), called only for this rank's samples.
    Raises CPConfigError when the plan and the registry disagree on the DPxCP size or the
    registry lacks the assignment's group.
    """
    _check_plan(plan, registry)
    assignment = plan.assignment_for_rank(position, index)
    if assignment is None:
        return None
    group = registry.for_assignment(assignment)
    samples = []
    for sid in assignment.samples:
        sample = get_sample(sid)
        samples.append({k: (v.to(device) if device is not None else v) for k, v in sample.items()})
    packed = pack_thd(samples, assignment.cp_size)
    cp_rank = group_rank(group)  # the attention orders chunks by it; new_group sorts ranks
    return LocalMicrobatch(
        index=index, assignment=assignment, group=group, cp_rank=cp_rank, packed=packed,
        batch=packed.shard(cp_rank), packed_seq_params=packed_seq_params_for(packed, group),
    )


# ---------------------------------------------------------------------------------------------
# One global batch


@dataclass(frozen=True)
class DynamicStepResult:
    """The outcome of dynamic_cp_step on this rank."""

    loss: float
    """Mean loss per token over every sample of the global batch (same on every rank)."""
    num_tokens: float
    """Loss tokens of the global batch."""
    local_losses: tuple[float, ...]
    """This rank's share per micro-batch (0.0 where idle); they sum, over ranks, to `loss`."""
    cp_sizes: tuple[Optional[int], ...]
    """This rank's CP size per micro-batch (None where idle)."""


def _default_loss(model, batch, pg_collection, *, total_tokens, packed_seq_params):
    return forward_loss(model, batch, pg_collection, total_tokens=total_tokens,
                        packed_seq_params=packed_seq_params)


def forward_backward_local(
    model: torch.nn.Module,
    microbatches: Sequence[Optional[LocalMicrobatch]],
    *,
    total_tokens: float,
    pg_collection: Any,
    loss_fn: LossFn = _default_loss,
    cp_comm_type: Optional[str] = None,
    recorder: Any = None,
) -> list[torch.Tensor]:
    """Forward and backward of this rank's micro-batches, in order; no DPxCP collective.

    Each micro-batch runs under use_cp_group on its own group (only that group communicates);
    None (idle) backpropagates zero_loss. Gradients accumulate into `.grad`. Returns this
    rank's detached loss share per micro-batch (float64 scalars, 0 where idle). `recorder`
    (cpkit.dynamic.microbatch_timeline.MicrobatchTimeline): start(mb) and stop() around each
    micro-batch, marks without a sync.
    """
    per_token = bool(getattr(_config_of(model), "calculate_per_token_loss", False))
    shares = []
    for mb in microbatches:
        if recorder is not None:
            recorder.start(mb)
        if mb is None:
            loss = zero_loss(model)
        else:
            with use_cp_group(model, mb.group, pg_collection=pg_collection, cp_comm_type=cp_comm_type):
                loss = loss_fn(model, mb.batch, pg_collection, total_tokens=total_tokens,
                               packed_seq_params=mb.packed_seq_params)
        # MoE router aux and z losses: per token of the global batch, like the LM loss (a no-op
        # for a dense model); MCore's router weights them by the local token count only with
        # calculate_per_token_loss, so without it the micro-batch's count is the scale's
        routed = 1.0 if per_token or mb is None else float(mb.batch["tokens"].numel())
        with _router_loss_scale(routed / max(total_tokens, 1.0), loss.device):
            loss.backward()  # outside the switch: autograd kept the forward's group
        shares.append(loss.detach().double())
        if recorder is not None:
            recorder.stop()
    return shares


def _config_of(model: torch.nn.Module) -> Any:
    """The model's TransformerConfig (through DDP-style wrappers), or None."""
    while model is not None and not hasattr(model, "config"):
        model = getattr(model, "module", None)
    return getattr(model, "config", None)


@contextlib.contextmanager
def _router_loss_scale(scale: float, device: Any):
    """MCore's MoEAuxLossAutoScaler backward scale set to `scale` (the aux and z losses'
    gradient factor), the previous one restored after (MCore's schedule sets its own)."""
    try:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    except ImportError:  # no MCore MoE: nothing to scale
        yield
        return
    previous = MoEAuxLossAutoScaler.main_loss_backward_scale
    # torch.full fills on the device; torch.tensor(scale, device=cuda) would copy from pageable
    # host memory and wait for the stream: a host sync between every micro-batch's forward and
    # backward, so the host could not queue the backward while the forward ran.
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((), scale, dtype=torch.float32, device=device)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = previous


def dynamic_cp_step(
    model: torch.nn.Module,
    plan: Plan,
    registry: GroupRegistry,
    get_sample: SampleFn,
    *,
    pg_collection: Any,
    dp_cp_group: Any = None,
    loss_fn: LossFn = _default_loss,
    cp_comm_type: Optional[str] = None,
    device: Any = None,
) -> DynamicStepResult:
    """Forward and backward of every micro-batch of `plan`, then the DPxCP reductions.

    Collective over `dp_cp_group` (default pg_collection.dp_cp; its members must be the
    registry's): call on every rank of it with the same plan. Gradients accumulate into
    `.grad` (call model.zero_grad() before) and are summed over the DPxCP group at the end;
    the optimizer step is the caller's. `loss_fn(model, batch, pg_collection, total_tokens=,
    packed_seq_params=)` returns this rank's share sum(local token losses) / total_tokens
    (cpkit.loss.forward_loss by default). Raises CPConfigError for a DPxCP group that does
    not match the registry or the plan.
    """
    group = dp_cp_group if dp_cp_group is not None else get_pg(pg_collection, "dp_cp")
    members = sorted(global_ranks(group)) if group is not None else [dist.get_rank()]
    if members != sorted(registry.dp_cp_ranks):
        raise CPConfigError.single(
            "dp_cp_group", members, f"must have the registry's ranks {sorted(registry.dp_cp_ranks)}",
            "pass the DPxCP group the registry was built from")
    _check_plan(plan, registry)
    if device is None:
        device = next(model.parameters()).device
    position = dp_cp_position(registry)
    failure: Optional[BaseException] = None
    try:
        local = [prepare_microbatch(plan, m, registry, position, get_sample, device=device)
                 for m in range(len(plan.microbatches))]
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below, then re-raised
        failure, local = exc, []

    total = agree_on_tokens(sum(mb.num_tokens for mb in local if mb is not None), failure, group,
                            device, "dynamic_cp_step")

    shares = forward_backward_local(model, local, total_tokens=total, pg_collection=pg_collection,
                                    loss_fn=loss_fn, cp_comm_type=cp_comm_type)
    all_reduce_gradients(model, group)

    summed = torch.stack(shares).sum() if shares else torch.zeros((), dtype=torch.float64, device=device)
    if group_size(group) > 1:
        dist.all_reduce(summed, group=group)
    return DynamicStepResult(
        loss=summed.item(),
        num_tokens=total,
        local_losses=tuple(float(s) for s in shares),
        cp_sizes=tuple(mb.assignment.cp_size if mb is not None else None for mb in local),
    )
