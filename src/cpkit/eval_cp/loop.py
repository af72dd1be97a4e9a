"""The evaluation loop of eval-time CP: whose samples, the loss, and the forward.

`eval_shard` gives each eval dp rank a disjoint block of the validation set, so every sample is
evaluated once; `reduce_eval_loss` sums the loss and token count over the eval dp x cp group;
`evaluate` runs a GPT-style model over a validation set with both (MCore's pipeline schedule
when pp > 1). Run it inside `cpkit.eval_cp.context.eval_cp_context` with the eval collection, or
outside with the training one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.errors import CPConfigError
from cpkit.parallel.group_info import group_device, group_size
from cpkit.loss import gather_vocab, reduce_group
from cpkit.eval_cp.rebind import ModelOrChunks, model_roots
from cpkit.sharding import shard_batch

__all__ = [
    "eval_shard",
    "eval_shard_for",
    "reduce_eval_loss",
    "EvalResult",
    "evaluate",
]


def eval_shard(num_samples: int, dp_rank: int, dp_size: int) -> range:
    """The sample indices eval dp rank `dp_rank` of `dp_size` evaluates: a contiguous block.

    Blocks are disjoint, cover range(num_samples) and differ in length by at most one (ranks
    past num_samples get an empty range). Raises CPConfigError for negative counts or a
    dp_rank outside [0, dp_size).
    """
    if not (isinstance(num_samples, int) and num_samples >= 0):
        raise CPConfigError.single("num_samples", num_samples, "must be an integer >= 0", "pass the validation set size")
    if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
        raise CPConfigError.single("dp_rank", dp_rank, f"must be in [0, dp_size={dp_size}) with dp_size >= 1",
                                   "pass the rank and size of the eval data-parallel group")
    base, extra = divmod(num_samples, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (1 if dp_rank < extra else 0))


def eval_shard_for(num_samples: int, pg_collection: Any) -> range:
    """eval_shard for this rank's eval dp group (`pg_collection.dp`; the whole set without one)."""
    dp = get_pg(pg_collection, "dp")
    if dp is None:
        return range(num_samples)
    return eval_shard(num_samples, dp.rank(), dp.size())


def reduce_eval_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor, pg_collection: Any) -> tuple[float, float]:
    """(global mean loss, global token count): sums over the eval dp x cp group (`dp_cp`).

    Each rank passes the sum of its per-token losses and its token count (its dp shard, its
    CP slice); every rank of the group gets the same result. A collective over `dp_cp`.
    """
    group = reduce_group(pg_collection)
    device = group_device(group)  # the group's, whatever device the caller's sums are on
    buf = torch.stack([t.detach().double().reshape(()).to(device) for t in (loss_sum, num_tokens)])
    if group_size(group) > 1:
        dist.all_reduce(buf, group=group)
    total, count = buf.tolist()
    return (total / count if count > 0 else float("nan")), count


@dataclass
class EvalResult:
    """The outcome of evaluate() on this rank."""

    loss: float
    """Mean per-token loss over every sample of the validation set (same on every rank)."""
    num_tokens: float
    """Tokens counted over the whole eval layout (each sample once)."""
    samples: range
    """The sample indices this rank's eval dp replica evaluated."""
    micro_batches: int
    """Micro-batches this rank ran."""


def _micro_batches(dataset: Mapping[str, torch.Tensor], indices: range, mbs: int, *, pad: bool,
                   at_least: int = 0) -> list[dict]:
    """Full-sequence micro-batches of `indices`. With `pad`, the last one is filled up to `mbs`
    with loss-masked copies (fixed shapes for the pipeline schedule); loss-masked filler
    micro-batches are added up to `at_least` (a full pipeline, as the planner counts it).
    `indices` is a contiguous range (evaluate passes the rows of its replica's copied and
    sharded shard), so every micro-batch is a view: no gather or copy per micro-batch."""
    spare = indices.start if len(indices) else 0

    def masked(rows: int) -> dict:
        filler = {k: v[spare:spare + 1].expand(rows, *v.shape[1:]) for k, v in dataset.items()}
        filler["loss_mask"] = torch.zeros_like(filler["loss_mask"])
        return filler

    out = []
    for start in range(0, len(indices), mbs):
        chunk = indices[start:start + mbs]
        mb = {k: v[chunk.start:chunk.stop] for k, v in dataset.items()}
        if pad and len(chunk) < mbs:
            filler = masked(mbs - len(chunk))
            mb = {k: torch.cat([mb[k], filler[k]]) for k in mb}
        out.append(mb)
    while len(out) < at_least:
        out.append(masked(mbs))
    return out


def _loss_sum(logits: torch.Tensor, mb: Mapping[str, torch.Tensor], tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of masked per-token losses, token count) of a [b, s, vocab/tp] logits shard."""
    logits = gather_vocab(logits, tp_group)
    losses = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1), reduction="none")
    mask = mb["loss_mask"].reshape(-1).float()
    return (losses * mask).sum(), mask.sum()


@torch.no_grad()
def evaluate(model: ModelOrChunks, dataset: Mapping[str, torch.Tensor], pg_collection: Any, *,
             micro_batch_size: int = 1, min_micro_batches: int = 0) -> EvalResult:
    """Evaluate a GPT-style model over a validation set, each sample once, under `pg_collection`.

    `dataset` holds full-sequence tensors [S, L]: tokens, labels, position_ids, loss_mask (the
    form of cpkit.testing.models.make_batch). This rank's eval dp replica takes eval_shard_for(S) in
    micro-batches of `micro_batch_size`, each CP-sharded for `pg_collection.cp`
    (cpkit.sharding's 2*cp chunk layout); logits are gathered over tp for the loss. With pp > 1
    the forward runs through MCore's forward-only pipeline schedule (get_forward_backward_func
    with an explicit P2PCommunicator and pg_collection, without MCore's device sync after each
    transfer: _no_p2p_sync; GPU only, as MCore's p2p buffers are CUDA tensors) and the last
    stage's sums are shared over pp. The loss is reduced over
    dp x cp (reduce_eval_loss). `min_micro_batches` adds loss-masked filler micro-batches up to
    that count (pass pp to run a full pipeline, as Megatron's eval and cpkit.eval_cp.plan count
    it); they change the time, not the loss. Call it inside eval_cp_context with the eval
    collection, or outside with the training one. Virtual pipeline chunks are not supported.
    """
    chunks = model_roots(model)
    if len(chunks) > 1:
        raise CPConfigError.single("model", f"{len(chunks)} chunks",
                                   "evaluate() runs the non-interleaved schedule",
                                   "call MCore's interleaved schedule yourself inside eval_cp_context")
    module = chunks[0]
    num = int(next(iter(dataset.values())).shape[0])
    shard = eval_shard_for(num, pg_collection)
    pp_group = get_pg(pg_collection, "pp")
    pp = group_size(pp_group)
    cp_group, tp_group = get_pg(pg_collection, "cp"), get_pg(pg_collection, "tp")
    device = next(module.parameters()).device
    # This replica's rows copied and CP-sharded once per key, then cut into micro-batches (views):
    # no per-micro-batch copies before the first kernel. With no rows of its own a replica
    # still takes one, the source of its loss-masked filler.
    rows = shard if len(shard) else range(0, min(1, num))
    mine = shard_batch({k: v[rows.start:rows.stop].to(device) for k, v in dataset.items()}, cp_group)
    local = _micro_batches(mine, range(len(shard)), micro_batch_size, pad=pp > 1, at_least=min_micro_batches)
    was_training = module.training
    module.eval()
    try:
        if pp == 1:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            count = torch.zeros((), dtype=torch.float64, device=device)
            for mb in local:
                logits = module(mb["tokens"], mb["position_ids"], None)
                s, n = _loss_sum(logits, mb, tp_group)
                loss_sum += s.double()
                count += n.double()
        else:
            loss_sum, count = _pipeline_sums(module, local, pg_collection, micro_batch_size, device)
    finally:
        module.train(was_training)
    loss, tokens = reduce_eval_loss(loss_sum, count, pg_collection)
    return EvalResult(loss=loss, num_tokens=tokens, samples=shard, micro_batches=len(local))


def _no_p2p_sync(config: Any) -> Any:
    """A shallow copy of the model config with batch_p2p_sync off, for evaluate()'s own
    P2PCommunicator. MCore synchronizes the whole device after every batched pipeline transfer
    "to protect against race condition when using batch_isend_irecv()", adding "User should
    assert that we have a modern enough PyTorch to not need this"; cpkit needs torch >= 2.6.
    The sync drained the GPU at every micro-batch, and the eval layout, with half the work per
    micro-batch, waited for the host after each. The model's config is left as it is."""
    if not getattr(config, "batch_p2p_sync", False):
        return config
    quiet = copy.copy(config)
    quiet.batch_p2p_sync = False
    return quiet


def _pipeline_sums(module, local: list[dict], pg_collection, mbs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum and token count of `local` through MCore's forward-only pipeline schedule,
    summed over pp (only the last stage has them) so every stage returns the same."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.utils import get_model_config

    pp_group, tp_group, cp_group = (get_pg(pg_collection, k) for k in ("pp", "tp", "cp"))
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    if local:
        config = get_model_config(module)
        seq_length = int(local[0]["tokens"].shape[1]) * group_size(cp_group)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb["tokens"], mb["position_ids"], None)

            def loss_func(logits):
                s, n = _loss_sum(logits, mb, tp_group)
                return s.clone(), n.to(torch.int), {"loss_sum": s.detach(), "num_tokens": n.detach()}

            return output, loss_func

        schedule = get_forward_backward_func(pp_size=group_size(pp_group), vp_size=None)
        stored = schedule(
            forward_step_func=forward_step, data_iterator=iter(local), model=[module],
            num_microbatches=len(local), seq_length=seq_length, micro_batch_size=mbs,
            forward_only=True, p2p_communicator=P2PCommunicator(pp_group=pp_group, config=_no_p2p_sync(config)),
            pg_collection=pg_collection)
        for entry in stored or []:
            sums[0] += entry["loss_sum"].double()
            sums[1] += entry["num_tokens"].double()
    dist.all_reduce(sums, group=pp_group)
    return sums[0], sums[1]
