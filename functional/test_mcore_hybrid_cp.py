"""MCore's own hybrid (dynamic) CP path, end to end, against the cp=1 reference (4 GPUs).

The path under test is MCore's, unchanged: `parallel_state.initialize_model_parallel(...,
hybrid_context_parallel=True)` (the hybrid DPxCP groups), `config.hybrid_context_parallel` with
`max_seqlen_per_dp_cp_rank`, `HybridCPDataLoaderWrapper` (all-gathers the lengths, schedules with
`BalancedCPScheduler`, reroutes the sub-samples with all-to-all),
`get_forward_backward_func()` picking `hybrid_context_parallel_forward_backward`, and
`get_batch_on_this_hybrid_cp_rank` in the forward step. The model is the small GPT on cpkit's
attention, which honours `packed_seq_params.cp_group` per sub-sample. One training step; the
loss (per token over the global batch) and the gradients must equal a single-rank cp=1 run.

Why gpu4 only: the wrapper moves every tensor with `.cuda()` and `torch.cuda.current_device()`,
`get_batch_on_this_hybrid_cp_rank` pins memory, and the schedule allocates on "cuda"; covering
that on CPU would patch tensor methods process-wide, more than cpkit's CPU shim does.

Cases: "balanced" (4 DP ranks with 3 sub-samples each) and "few-sub-samples" (one each, so
ranks sit out groups). Both passed on 4 gloo ranks with MCore 0.16.1 and with MCore 0.19.2 under
process-wide CUDA patches outside this repository (not a CI configuration).

MCore 0.19 removed `get_batch_on_this_hybrid_cp_rank`; its consolidated
`get_batch_on_this_cp_rank(batch, is_hybrid_cp=True, ...)` takes the hybrid branch (shard over the
`local_cp_size` group) only when the batch carries `cu_seqlens`, which
`HybridCPDataLoaderWrapper.unpack_batch` strips (the schema bridge Megatron-LM PR #6816 / #6820
restores). The forward step therefore gives it the schema it documents: the sub-sample as a
batch of one, `cu_seqlens = [0, length]` and `local_cp_size`. The `cp_group` argument is passed
too: without `cu_seqlens`, the function shards over `cp_group`, and `None` there means the
default group, all 4 ranks (what made every rank fail with "size of tensor a (16) must match
the size of tensor b (64)" before). The forward step checks that each rank holds
length / local_cp_size tokens, so a wrong shard fails there, naming the function.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.loss import all_reduce_gradients
from cpkit.testing.models import GPTConfig, build_gpt, named_gradients
from cpkit.testing import device, grid_params, grid_result
from cpkit.testing.reference import per_sequence_reference, single_rank_pg_collection, token_sample

WORLD = 4
MAX_SEQLEN_PER_RANK = 32
# Sub-sample lengths per DP rank (each rank's packed samples); multiples of 8 (2 * the largest
# group), as get_batch_on_this_hybrid_cp_rank does not pad.
BALANCED = ((64, 16, 24), (48, 8, 16), (56, 32, 8), (40, 24, 16))
FEW_SUB_SAMPLES = ((64,), (8,), (16,), (8,))

def _has_hybrid_batch_function() -> bool:
    from megatron.core import utils

    return hasattr(utils, "get_batch_on_this_hybrid_cp_rank")


TOL = dict(loss=5e-3, rtol=2e-2, atol=2e-2)  # bf16 (as functional/test_dynamic_cp.py)


def _cases(backend: str, world_size: int):
    return [dict(id="balanced", lens=BALANCED), dict(id="few-sub-samples", lens=FEW_SUB_SAMPLES)]


def _samples(lens_per_rank, vocab: int, dev):
    """Every sub-sample of every DP rank (the same on every rank), in rank order."""
    flat = [n for lens in lens_per_rank for n in lens]
    return [token_sample(n, 2000 + i, vocab, dev) for i, n in enumerate(flat)]


def _packed_batch(samples, lens_per_rank, dp_rank: int, dev) -> list[dict]:
    """This DP rank's batch as HybridCPDataLoaderWrapper reads it: a list with one packed sample
    (1-D tensors of the concatenated sub-samples and their cu_seqlens)."""
    start = sum(len(lens) for lens in lens_per_rank[:dp_rank])
    mine = samples[start:start + len(lens_per_rank[dp_rank])]
    packed = {k: torch.cat([s[k] for s in mine]) for k in ("tokens", "labels", "loss_mask")}
    packed["position_ids"] = torch.cat([torch.arange(s["tokens"].numel(), device=dev) for s in mine])
    offsets = torch.tensor([0] + [s["tokens"].numel() for s in mine]).cumsum(0).to(torch.int32)
    packed["cu_seqlens"] = offsets.to(dev)
    return [packed]


def _hybrid_batch(sample: dict, local_cp_size: int):
    """This rank's shard of one wrapper sub-sample (1-D tensors) and its PackedSeqParams, through
    MCore's own entry point: get_batch_on_this_hybrid_cp_rank where it exists (0.16), else the
    consolidated get_batch_on_this_cp_rank(is_hybrid_cp=True) (0.19), given the cu_seqlens the
    wrapper strips (see the module docstring)."""
    from megatron.core import parallel_state, utils
    from megatron.core.packed_seq_params import PackedSeqParams

    if _has_hybrid_batch_function():
        return utils.get_batch_on_this_hybrid_cp_rank(sample, local_cp_size)
    batch = {k: v.unsqueeze(0) for k, v in sample.items()}
    length = batch["tokens"].shape[1]
    batch["cu_seqlens"] = torch.tensor([0, length], dtype=torch.int32, device=batch["tokens"].device)
    batch["local_cp_size"] = torch.tensor(local_cp_size, dtype=torch.int32)
    batch = utils.get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=True, cp_group=parallel_state.get_context_parallel_group(),
        hybrid_cp_group_func=parallel_state.get_hybrid_data_context_parallel_groups)
    if batch["tokens"].shape[1] * local_cp_size != length:
        raise AssertionError(f"get_batch_on_this_cp_rank(is_hybrid_cp=True) left {batch['tokens'].shape[1]} of "
                             f"{length} tokens on this rank, expected {length // local_cp_size} (local_cp_size "
                             f"{local_cp_size})")
    group = batch.pop("hybrid_cp_group", None)
    cu = torch.tensor([0, length], dtype=torch.int32, device=batch["tokens"].device)
    psp = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=length, max_seqlen_kv=length,
                          local_cp_size=local_cp_size, cp_group=group)
    return batch, psp


def hybrid_case(case):
    from megatron.core import parallel_state
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    dev = device()
    dtype = torch.bfloat16
    lens = case["lens"]
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                    seq_length=2 * max(max(r) for r in lens), dtype=dtype,
                    extra=dict(calculate_per_token_loss=True))
    samples = _samples(lens, cfg.vocab_size, dev)
    total = float(sum(s["loss_mask"].sum().item() for s in samples))

    ref_pgc = single_rank_pg_collection()
    ref = build_gpt(cfg, ref_pgc, attention="cpkit", device=dev)
    ref_loss = per_sequence_reference(ref, samples, ref_pgc, total_tokens=total)
    ref_grads = named_gradients(ref)

    parallel_state.initialize_model_parallel(hybrid_context_parallel=True)
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        hybrid_cfg = cfg.with_(extra={**cfg.extra, "hybrid_context_parallel": True,
                                      "max_seqlen_per_dp_cp_rank": MAX_SEQLEN_PER_RANK})
        model = build_gpt(hybrid_cfg, pgc, attention="cpkit", device=dev)
        model.zero_grad(set_to_none=True)
        dp_rank = parallel_state.get_data_parallel_rank()
        batches = iter([_packed_batch(samples, lens, dp_rank, dev)])
        wrapper = HybridCPDataLoaderWrapper(batches, model.config, pg_collection=pgc)
        local_sizes = []

        def forward_step(data_iterator, chunk):
            sample = dict(next(data_iterator))
            local_cp_size = int(sample.pop("local_cp_size"))
            local_sizes.append(local_cp_size)
            batch, packed_seq_params = _hybrid_batch(sample, local_cp_size)
            output = chunk(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed_seq_params)

            def loss_func(logits):
                losses = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none")
                mask = batch["loss_mask"].reshape(-1).float()
                share = (losses * mask).sum() / total
                return share, mask.sum().to(torch.int), {"loss_share": share.detach()}

            return output, loss_func

        stored = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=wrapper, model=[model], num_microbatches=1,
            seq_length=cfg.seq_length, micro_batch_size=1, forward_only=False)
        group = pgc.dp_cp
        all_reduce_gradients(model, group)
        loss = torch.stack([e["loss_share"].double() for e in stored]).sum() if stored else \
            torch.zeros((), dtype=torch.float64, device=dev)
        dist.all_reduce(loss, group=group)
        grads = named_gradients(model)
    finally:
        parallel_state.destroy_model_parallel()

    assert abs(loss.item() - ref_loss) <= TOL["loss"], f"loss {loss.item()} vs reference {ref_loss}"
    from cpkit.testing.compare import assert_grads_close

    assert_grads_close(grads, ref_grads, rtol=TOL["rtol"], atol=TOL["atol"], scaled=True)
    return loss.item(), ref_loss, local_sizes


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(_cases, scenario=hybrid_case, timeout=300.0, world_sizes=(WORLD,), backends=("nccl",)))
def test_mcore_hybrid_cp_matches_cp1(backend, world_size, case_id):
    """MCore's hybrid-CP path with cpkit's attention: one training step equals cp=1."""
    result = grid_result(hybrid_case, _cases, backend, world_size, case_id, timeout=300.0)
    result.check()
    sizes = [size for _, _, local in result.values.values() for size in local]
    assert max(sizes) > 1, f"every sub-sample ran at CP size 1 ({sizes}): no hybrid CP exercised"
