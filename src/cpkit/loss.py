"""Per-token losses and their reductions over the data- and context-parallel ranks.

Every rank computes its share of the loss, sum(its local token losses) / T with T the number of
loss tokens over all dp x cp ranks, so summing the shares (and their gradients) over dp x cp
gives the global mean per token, the number a single-rank run reports. `forward_loss` is that
share for a GPT-style model (logits gathered over tp, `gather_vocab`); `reduce_group` is the
dp x cp group; `all_reduce_gradients` / `reduce_gradients` sum gradients over it, as MCore's DDP
does over its dp_cp group; `attach_grad_sync` gives a model without MCore's DDP the two methods
MCore's `finalize_model_grads` calls, with DDP's scaling, and `reduce_reported_losses` is
Megatron-LM's reduction of the loss_func's [sum, tokens] pairs to the logged loss. Eval CP (cpkit.eval_cp.loop) and dynamic CP (cpkit.dynamic.runtime) use
them, and so do the test models' train and eval steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.errors import CPConfigError
from cpkit.parallel.group_info import group_device, group_size

__all__ = [
    "reduce_group",
    "forward_loss",
    "gather_vocab",
    "all_reduce_gradients",
    "reduce_gradients",
    "global_loss",
    "total_tokens",
    "require_single_stage",
    "attach_grad_sync",
    "reduce_reported_losses",
]


def reduce_group(pg_collection: Any) -> Any:
    """The group over which per-token losses and gradients are summed: dp x cp (`dp_cp`; `cp`
    where the collection has no dp_cp; None where it has neither)."""
    group = get_pg(pg_collection, "dp_cp")
    if group is None:
        group = get_pg(pg_collection, "cp")
    return group


def forward_loss(model, local_batch: dict, pg_collection, *, total_tokens: float, packed_seq_params=None):
    """Mean per-token loss as this rank's share: sum(local token losses) / `total_tokens`.

    Summing the returned value over the dp x cp ranks gives the global mean loss, and its
    gradients, summed the same way, the reference gradients. Logits are gathered over tp for
    the cross entropy (MCore 0.16's vocab-parallel cross entropy reads global groups).
    Returns None on pipeline stages other than the last.
    """
    logits = model(
        local_batch["tokens"],
        local_batch["position_ids"],
        None,
        packed_seq_params=packed_seq_params,
    )
    if logits is None or not getattr(model, "post_process", True):
        return None
    tp_group = get_pg(pg_collection, "tp")
    logits = gather_vocab(logits, tp_group)
    losses = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), local_batch["labels"].reshape(-1), reduction="none"
    )
    mask = local_batch["loss_mask"].reshape(-1).float()
    return (losses * mask).sum() / total_tokens


class _GatherLastDim(torch.autograd.Function):
    """All-gather vocab shards over tp; every tp rank then computes the same (replicated) loss,
    so the backward keeps only this rank's slice of the gradient, with no reduction."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        chunks = grad.chunk(dist.get_world_size(ctx.group), dim=-1)
        return chunks[dist.get_rank(ctx.group)].contiguous(), None


def gather_vocab(logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """[..., vocab / tp] logits shards gathered over `tp_group` into [..., vocab] (as they are at
    tp = 1); differentiable, the backward keeps this rank's slice. A collective over tp_group."""
    if group_size(tp_group) <= 1:
        return logits
    return _GatherLastDim.apply(logits, tp_group)


def all_reduce_gradients(model, group) -> None:
    """Sum `.grad` of every trainable parameter over `group`, in one all-reduce per dtype.

    A missing `.grad` becomes zeros first, so every rank sends the same buffers whatever it ran
    (a rank that skipped work, as in dynamic CP, can never desynchronize the collective).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def reduce_gradients(model, pg_collection) -> None:
    """Sum gradients over the dp x cp ranks (what MCore's DDP does over its dp_cp group)."""
    all_reduce_gradients(model, reduce_group(pg_collection))


def global_loss(local_loss: torch.Tensor, pg_collection) -> float:
    """This rank's loss share summed over the dp x cp ranks (reduce_group): the global mean."""
    value = local_loss.detach().float().clone()
    group = reduce_group(pg_collection)
    if group_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value.item()


def total_tokens(local_batch: dict, pg_collection) -> float:
    """Loss tokens (loss_mask) of the batch summed over the dp x cp ranks (reduce_group)."""
    count = local_batch["loss_mask"].float().sum()
    group = reduce_group(pg_collection)
    if group_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count.item()


def require_single_stage(pg_collection, what: str) -> None:
    """CPConfigError naming `what` when pg_collection has pp > 1 (it runs the whole model)."""
    pp = group_size(get_pg(pg_collection, "pp"))
    if pp > 1:
        raise CPConfigError.single("pp", pp, f"{what} runs the whole model on one pipeline stage",
                                   "use pp=1, or MCore's pipeline schedule (see cpkit.eval_cp.context.evaluate)")


def attach_grad_sync(model, pg_collection, *, calculate_per_token_loss: bool) -> None:
    """Give `model` (a module without MCore's DDP wrapper) the `finish_grad_sync` and
    `scale_gradients` methods and the `ddp_config` (defaults) that MCore's
    `finalize_model_grads` uses, with DDP's scaling.

    finish_grad_sync sums `.grad` over the dp x cp group (reduce_group) and, unless
    `calculate_per_token_loss`, divides by its size: MCore's DDP averages over dp x cp, and
    its schedule multiplies a CP-sharded loss by the CP size to undo the CP part
    (forward_step_calc_loss). With calculate_per_token_loss the sum stays a sum and
    finalize_model_grads divides by the token count summed over dp x cp. Collective over
    reduce_group(pg_collection) when finish_grad_sync runs.
    """
    group = reduce_group(pg_collection)
    average = 1.0 if calculate_per_token_loss else 1.0 / group_size(group)

    def scale_gradients(factor) -> None:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def finish_grad_sync(force_all_reduce: bool = False) -> None:
        all_reduce_gradients(model, group)
        if average != 1.0:
            scale_gradients(average)

    from megatron.core.distributed import DistributedDataParallelConfig

    model.finish_grad_sync = finish_grad_sync
    model.scale_gradients = scale_gradients
    model.ddp_config = DistributedDataParallelConfig()  # finalize_model_grads reads it at pp > 1


def reduce_reported_losses(stored: list, pg_collection) -> dict[str, float]:
    """The logged losses of one step, as Megatron-LM's train_step reduces what loss_func returned.

    `stored` is what MCore's forward_backward_func returned on this rank: one dict per
    micro-batch (on the last pipeline stage; empty elsewhere) of name -> tensor [loss sum,
    token count]. Each name's pairs are summed over micro-batches, over pp (only the last stage
    has them) and over dp x cp (reduce_group); the value is sum / count. The same dict on every
    rank. Collective over pp and reduce_group.
    """
    names = sorted({name for entry in stored for name in entry})
    names_list = [names]
    pp_group = get_pg(pg_collection, "pp")
    if group_size(pp_group) > 1:  # stages other than the last learn the names from it
        dist.broadcast_object_list(names_list, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    names = names_list[0]
    group = reduce_group(pg_collection)
    # the device of the groups, not of `stored`: it is empty on every stage but the last
    device = group_device(pp_group if pp_group is not None else group)
    sums = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for entry in stored:
        for i, name in enumerate(names):
            sums[i] += entry[name].detach().double().reshape(2).to(device)
    if group_size(pp_group) > 1:
        dist.all_reduce(sums, group=pp_group)
    if group_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return {name: (sums[i, 0] / sums[i, 1]).item() for i, name in enumerate(names)}
