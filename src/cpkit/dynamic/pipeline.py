"""Dynamic CP inside MCore's training step: a plan's micro-batches through `get_forward_backward_func()`.

`dynamic_cp_forward_backward` is the one function a training loop calls per global batch, in
place of its own call to MCore's schedule. It works at any pipeline (PP), virtual-pipeline (VPP,
a list of model chunks) and tensor-parallel (TP) size:

1. Every rank prepares its micro-batches of the plan (cpkit.dynamic.runtime.prepare_microbatch:
   pack, shard, PackedSeqParams on the micro-batch's group). The plan is positional over the
   DPxCP group, so the same position on every pipeline stage and every tp rank holds the same
   samples; every stage reads them (the first for tokens, every stage for the packed
   sequence offsets, the last for labels).
2. A rank idle in a micro-batch still runs it (the pipeline needs an activation from every
   stage): a 2-token sequence with loss_mask 0 on its own CP group of size 1, run with the
   chunk in eval mode so that MoE routers add no aux or z-loss for it (MCore weights those by
   the local token count); it adds exactly zero to the loss and the gradients.
3. One all-reduce over the DPxCP group counts the loss tokens T of the whole global batch and
   the ranks that failed to prepare their data (then every rank raises together).
4. MCore's schedule runs the micro-batches: `forward_step` switches each chunk to its
   micro-batch's CP group (cpkit.dynamic.runtime.use_cp_group: cp, the registry's tp x cp group,
   the [a2a, p2p] pair where the block has one) and restores it in a `finally`; the backward
   runs outside the switch (the attention keeps the forward's group in its autograd context).
   The loss function returns (sum of local token losses, local token count), MCore's
   calculate_per_token_loss convention: the LM loss and the MoE aux and z losses (which MCore's
   router multiplies by the local token count) are all in "sum" scale, and every gradient is
   divided by T once, after the schedule.
5. With `config.finalize_model_grads_func` (MCore DDP) MCore's finalize sums the gradients over
   the DPxCP group and divides them by T (the token counts the loss function returned, summed
   over that group); without one, the gradients are summed over the DPxCP group and divided by
   T here. Either way they are the per-token mean's of the global batch, as at cp=1.

Failures: a rank whose step raises inside the schedule re-raises; its peers wait in a pipeline
transfer, a CP collective or the gradient all-reduce until the process group's timeout
(torch.distributed's `timeout`, e.g. `init_process_group(timeout=...)`) and raise there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from cpkit.compat import get_pg, schedule_pg_collection
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.dynamic.registry import GroupRegistry
from cpkit.dynamic.runtime import (
    agree_on_tokens,
    DynamicStepResult,
    LocalMicrobatch,
    SampleFn,
    dp_cp_position,
    pack_thd,
    packed_seq_params_for,
    prepare_microbatch,
    use_cp_group,
)
from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.group_info import group_size
from cpkit.parallel.layout import A2A_P2P, P2P
from cpkit.loss import all_reduce_gradients, gather_vocab

__all__ = [
    "ScheduledMicrobatch",
    "check_schedule_config",
    "dynamic_cp_forward_backward",
    "pad_plan",
    "token_loss_sum",
]

ModelOrChunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]
LossSumFn = Callable[[torch.Tensor, dict, Any], tuple[torch.Tensor, torch.Tensor]]

_IDLE_TOKENS = 2  # the shortest sequence cpkit.sharding pads to at cp = 1 (2 * cp)


@dataclass(frozen=True)
class ScheduledMicrobatch:
    """One micro-batch as forward_step consumes it on this rank (busy or idle)."""

    local: LocalMicrobatch
    """Its packed, sharded samples and group (for an idle rank: the masked filler on its own rank)."""
    idle: bool
    tp_cp_group: Any
    hcp: Optional[tuple[Any, Any]]
    comm_type: Optional[str]
    """The comm type this micro-batch's attention runs (None keeps each module's own)."""


def pad_plan(plan: Plan, multiple: int) -> Plan:
    """`plan` with empty micro-batches appended until their count is a multiple of `multiple`
    (MCore's interleaved schedule runs groups of pp micro-batches; every rank sits idle in an
    empty one). Raises CPConfigError for `multiple` < 1."""
    if not (isinstance(multiple, int) and multiple >= 1):
        raise CPConfigError.single("multiple", multiple, "must be an int >= 1", "pass the pipeline size")
    missing = -len(plan.microbatches) % multiple
    if not missing:
        return plan
    return dataclasses.replace(plan, microbatches=plan.microbatches + (Microbatch(()),) * missing)


def check_schedule_config(config: Any, *, pp_size: int, vp_size: Optional[int], num_microbatches: int) -> None:
    """Raise CPConfigError listing every setting of the model's TransformerConfig (and the
    plan's micro-batch count) that dynamic CP through MCore's schedule cannot run with:
    calculate_per_token_loss must be True (micro-batches hold different token counts; MCore's
    per-micro-batch mean would weight them unequally), variable_seq_lengths True at pp > 1
    (each micro-batch's activation has its own length), and with VPP the micro-batch count a
    multiple of microbatch_group_size_per_vp_stage (default pp) and at least pp, and at pp = 2
    with VPP overlap_p2p_comm False (cpkit.dynamic.p2p keeps the two directions apart only for
    transfers that complete inside one call)."""
    found = []
    if not getattr(config, "calculate_per_token_loss", False):
        found.append(Violation("config.calculate_per_token_loss", getattr(config, "calculate_per_token_loss", None),
                               "must be True: dynamic-CP micro-batches hold different token counts",
                               "build the TransformerConfig with calculate_per_token_loss=True"))
    if pp_size > 1 and not getattr(config, "variable_seq_lengths", False):
        found.append(Violation("config.variable_seq_lengths", getattr(config, "variable_seq_lengths", None),
                               "must be True at pp > 1: each micro-batch sends activations of its own length",
                               "build the TransformerConfig with variable_seq_lengths=True"))
    if vp_size is not None and vp_size > 1 and pp_size == 2 and getattr(config, "overlap_p2p_comm", False):
        found.append(Violation("config.overlap_p2p_comm", True,
                               "must be False at pp = 2 with virtual-pipeline chunks: the shape of each "
                               "activation is exchanged while earlier transfers may still be in flight",
                               "build the TransformerConfig with overlap_p2p_comm=False"))
    if vp_size is not None and vp_size > 1:
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp_size
        if num_microbatches < pp_size or num_microbatches % group:
            found.append(Violation(
                "len(plan.microbatches)", num_microbatches,
                f"must be a multiple of microbatch_group_size_per_vp_stage={group} and >= pp={pp_size} "
                "(MCore's interleaved schedule)",
                f"schedule(..., microbatch_group_size={group}) or pad_plan(plan, {group})"))
    if found:
        raise CPConfigError(found)


def token_loss_sum(logits: torch.Tensor, batch: dict, tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of loss-masked per-token cross entropies, number of loss tokens) of one micro-batch:
    `logits` [s, b, vocab / tp] gathered over tp (each tp rank keeps its slice's gradient),
    `batch["labels"]` and `batch["loss_mask"]` [b, s]."""
    if group_size(tp_group) > 1:
        logits = gather_vocab(logits, tp_group)
    losses = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none")
    mask = batch["loss_mask"].reshape(-1).float()
    return (losses * mask).sum(), mask.sum()


def _chunks(model: ModelOrChunks) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise CPConfigError.single("model", type(model).__name__, "must be a module or a list of model chunks",
                                   "pass the model, or the list of its virtual-pipeline chunks")
    return chunks


def _idle_microbatch(index: int, registry: GroupRegistry, position: int, device) -> LocalMicrobatch:
    if (1, position) not in registry.groups:
        raise CPConfigError.single(
            "registry sizes", list(registry.sizes),
            f"the plan leaves position {position} idle in micro-batch {index}; an idle rank runs a "
            "masked filler on its own CP group of size 1",
            "build_group_registry(..., min_cp_size=1) (the default)")
    group = registry.get(1, position)
    zeros = torch.zeros(_IDLE_TOKENS, dtype=torch.long, device=device)
    packed = pack_thd([{"tokens": zeros, "labels": zeros, "loss_mask": zeros.float()}], 1)
    assignment = CPGroupAssignment((position,), (), 1)
    return LocalMicrobatch(index=index, assignment=assignment, group=group, cp_rank=0, packed=packed,
                           batch=packed.shard(0), packed_seq_params=packed_seq_params_for(packed, group))


def _scheduled(local: Optional[LocalMicrobatch], index: int, registry: GroupRegistry, position: int,
               cp_comm_type: Optional[str], device) -> ScheduledMicrobatch:
    if local is None:
        filler = _idle_microbatch(index, registry, position, device)
        return ScheduledMicrobatch(filler, True, registry.tp_cp_for(filler.assignment), None,
                                   None if cp_comm_type == A2A_P2P else cp_comm_type)
    hcp = registry.hcp_for(local.assignment) if cp_comm_type == A2A_P2P else None
    comm = cp_comm_type
    if cp_comm_type == A2A_P2P and hcp is None:
        comm = P2P  # a block without an [a2a, p2p] pair runs the flat ring
    if hcp is not None:
        # MCore's RoPE reads packed_seq_params.cp_group as one ProcessGroup, cpkit's attention
        # as the [a2a, p2p] pair for a2a+p2p: leave it unset; use_cp_group rebinds both (RoPE
        # to the block's group, the attention to the pair) for the forward.
        psp = packed_seq_params_for(local.packed, None)
        psp.local_cp_size = None
        local = dataclasses.replace(local, packed_seq_params=psp)
    return ScheduledMicrobatch(local, False, registry.tp_cp_for(local.assignment), hcp, comm)


@contextlib.contextmanager
def _eval_mode(chunk: torch.nn.Module, enabled: bool):
    """`chunk` in eval mode while `enabled` (every module's own flag restored after)."""
    if not enabled:
        yield
        return
    flags = [(m, m.training) for m in chunk.modules()]
    chunk.train(False)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _model_config(chunk: torch.nn.Module) -> Any:
    from megatron.core.utils import get_model_config

    return get_model_config(chunk)


def dynamic_cp_forward_backward(
    model: ModelOrChunks,
    plan: Plan,
    registry: GroupRegistry,
    get_sample: SampleFn,
    *,
    pg_collection: Any,
    loss_sum_fn: LossSumFn = token_loss_sum,
    cp_comm_type: Optional[str] = None,
    forward_only: bool = False,
    device: Any = None,
) -> DynamicStepResult:
    """Run one global batch of `plan` through MCore's pipeline schedule with dynamic CP.

    `model` is the model, or the list of its virtual-pipeline chunks, built for the static
    layout (e.g. cp=1) with `pg_collection`; its TransformerConfig needs
    calculate_per_token_loss=True and, at pp > 1, variable_seq_lengths=True
    (check_schedule_config). `registry` holds the plan's CP groups for this rank's DPxCP group
    (build_group_registry, with tp_rank_lists at tp > 1 and hierarchical_sizes for a2a+p2p);
    `get_sample(i)` returns sample i as 1-D tensors (tokens, labels, loss_mask), on every
    pipeline stage and tp rank. `loss_sum_fn(logits, batch, tp_group)` returns (loss sum, token
    count) of one micro-batch (token_loss_sum by default). `cp_comm_type` sets the attention's
    comm type per micro-batch ("a2a+p2p": the pair where the registry has one, "p2p" on other
    blocks; None keeps the model's).

    Collective over the DPxCP group (call on every rank with the same plan) and the pipeline.
    Gradients accumulate into `.grad` (zero them before); they are the per-token mean's over the
    global batch (the LM loss and MoE aux and z losses alike), summed over the DPxCP group and
    divided by its token count here unless config.finalize_model_grads_func is set (then MCore's
    finalize does both). Returns the global per-token loss on every rank. Raises CPConfigError for a config the
    schedule cannot run (check_schedule_config), a plan or registry of another DPxCP size, or
    an idle rank without a size-1 group; re-raises a data error on every rank.
    """
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from cpkit.dynamic.p2p import pipeline_communicator  # imports MCore's pipeline code

    chunks = _chunks(model)
    config = _model_config(chunks[0])
    pp_group, tp_group = get_pg(pg_collection, "pp"), get_pg(pg_collection, "tp")
    pp = group_size(pp_group)
    vp = len(chunks) if len(chunks) > 1 else None
    num = len(plan.microbatches)
    check_schedule_config(config, pp_size=pp, vp_size=vp, num_microbatches=num)
    group = get_pg(pg_collection, "dp_cp")
    members = sorted(dist.get_process_group_ranks(group)) if group is not None else [dist.get_rank()]
    if members != sorted(registry.dp_cp_ranks) or plan.dp_cp_size != len(registry.dp_cp_ranks):
        raise CPConfigError.single(
            "registry", list(registry.dp_cp_ranks),
            f"must be built for pg_collection.dp_cp {members} and the plan's dp_cp_size {plan.dp_cp_size}",
            "build_group_registry with every DPxCP group of the world; schedule with dp_cp_size = its size")
    if device is None:
        device = next(chunks[0].parameters()).device
    position = dp_cp_position(registry)

    failure: Optional[BaseException] = None
    try:
        micro = [_scheduled(prepare_microbatch(plan, m, registry, position, get_sample, device=device), m,
                            registry, position, cp_comm_type, device) for m in range(num)]
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below, then re-raised
        failure, micro = exc, []
    total = agree_on_tokens(sum(mb.local.num_tokens for mb in micro), failure, group, device,
                            "dynamic_cp_forward_backward")
    divisor = max(total, 1.0)

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        local = mb.local
        with use_cp_group(chunk, local.group, pg_collection=pg_collection, cp_comm_type=mb.comm_type,
                          tp_cp_group=mb.tp_cp_group, hcp=mb.hcp), _eval_mode(chunk, mb.idle):
            output = chunk(local.batch["tokens"], local.batch["position_ids"], None,
                           packed_seq_params=local.packed_seq_params)

        def loss_func(logits):
            # MCore's per-token convention: the schedule backpropagates the sum, the gradients
            # are divided by the global token count once (finalize_model_grads or below)
            loss_sum, count = loss_sum_fn(logits, local.batch, tp_group)
            return loss_sum, count.to(torch.int), {"loss_share": (loss_sum.detach() / divisor).double()}

        return output, loss_func

    schedule = get_forward_backward_func(pp_size=pp, vp_size=vp)
    iterators = [iter(micro) for _ in chunks]
    kwargs = dict(pg_collection=schedule_pg_collection(pg_collection))
    if pp > 1:
        kwargs["p2p_communicator"] = pipeline_communicator(pp_group, config, interleaved=vp is not None)
    longest = max((int(mb.local.batch["tokens"].shape[1]) for mb in micro), default=1)
    stored = schedule(
        forward_step_func=forward_step, data_iterator=iterators if vp else iterators[0],
        model=chunks, num_microbatches=num, seq_length=longest, micro_batch_size=1,
        forward_only=forward_only, **kwargs)

    summed = torch.zeros((), dtype=torch.float64, device=device)
    for entry in stored or []:
        summed += entry["loss_share"]
    if pp > 1:
        dist.all_reduce(summed, group=pp_group)  # only the last stage has the losses
    if group_size(group) > 1:
        dist.all_reduce(summed, group=group)
    if not forward_only and getattr(config, "finalize_model_grads_func", None) is None:
        for chunk in chunks:
            all_reduce_gradients(chunk, group)
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
    return DynamicStepResult(
        loss=summed.item(), num_tokens=total,
        local_losses=tuple(float(e["loss_share"]) for e in stored or []),
        cp_sizes=tuple(None if mb.idle else mb.local.assignment.cp_size for mb in micro),
    )
