"""Megatron-LM's dynamic-CP data path on gloo ranks, from the checkout named by CPKIT_MLM_SRC:
get_batch_and_global_seqlens -> DefaultDynamicCPScheduler.get_groups_and_subsamples ->
reroute_samples_to_dcp_ranks -> build_packed_microbatches (megatron/core/datasets/
data_schedule_utils.py), as DpBalancedScheduler.run calls them.

Every rank loads the checkout's files (cpkit.dynamic.mlm_worker.install_checkout; this module
imports no megatron). Upstream calls `.cuda()` and `torch.cuda.current_device()` on its way;
on CPU ranks `_cuda_calls_stay_on_cpu` makes both mean the CPU, nothing else. DPxCP = 4 ranks
as DP 2 x CP 2 (CP siblings load the same samples, as upstream's samplers do). Each sample's
tokens encode (DP rank that loaded it, its index there), so the check does not depend on
upstream's global ids: every sample must arrive, whole, on exactly the ranks of its CP group
(local_cp_size of them), once.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from cpkit.dynamic.mlm import checkout_commit, mlm_src, skip_reason
from cpkit.testing import launch

DP, CP = 2, 2
MAX_SEQ_LEN_PER_RANK = 16
PAD = 2 * DP * CP  # upstream's THD pad granularity at TP=1
SAMPLES_PER_DP_RANK = 5


def _lengths(dp_rank: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + dp_rank)
    return [PAD * int(k) for k in torch.randint(1, 9, (SAMPLES_PER_DP_RANK,), generator=gen)]


def _tokens(dp_rank: int, index: int, length: int) -> torch.Tensor:
    return dp_rank * 100_000 + index * 1_000 + torch.arange(length, dtype=torch.int64)


@contextlib.contextmanager
def _cuda_calls_stay_on_cpu():
    """`.cuda()` returns the tensor, `torch.cuda.current_device()` names the CPU."""
    saved = torch.Tensor.cuda, torch.cuda.current_device
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device = saved


def data_path_case(root: str):
    from cpkit.dynamic.mlm_worker import install_checkout

    modules = install_checkout(root)
    utils, data_schedule = modules["data_schedule_utils"], modules["data_schedule"]
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, cp_rank = divmod(rank, CP)  # CP innermost, as MCore orders ranks
    dp_groups = [dist.new_group([d * CP + c for d in range(DP)]) for c in range(CP)]
    dp_group, dp_cp_group = dp_groups[cp_rank], dist.group.WORLD

    lens = _lengths(dp_rank)
    samples = [{"tokens": _tokens(dp_rank, i, L),
                "labels": _tokens(dp_rank, i, L) + 1,
                "loss_mask": torch.ones(L),
                "position_ids": torch.arange(L),
                "original_seq_len": torch.tensor([L], dtype=torch.int32),
                "padded_seq_len": torch.tensor([L], dtype=torch.int32)} for i, L in enumerate(lens)]
    with _cuda_calls_stay_on_cpu():
        batch, global_id_seqlens, global_ids_this_rank, offsets, _ = \
            utils.get_batch_and_global_seqlens(iter(samples), len(samples), dp_group)
        scheduler = data_schedule.DefaultDynamicCPScheduler(
            max_seqlen_per_dp_cp_rank=MAX_SEQ_LEN_PER_RANK, cp_size=CP, dp_size=DP,
            microbatch_group_size_per_vp_stage=None)
        sample_id_groups = scheduler.get_groups_and_subsamples(global_id_seqlens)
        received = utils.reroute_samples_to_dcp_ranks(
            batch, global_ids_this_rank, global_id_seqlens, sample_id_groups, offsets,
            dp_group, dp_cp_group)
        packed = utils.build_packed_microbatches(received, sample_id_groups, rank,
                                                 torch.device("cpu"), is_dynamic_cp=True)
    # Per micro-batch: the packed tokens, split at cu_seqlens, and the local CP size.
    out = []
    for mb in packed:
        cu = mb["cu_seqlens_padded"].tolist()
        pieces = [mb["tokens"][a:b].tolist() for a, b in zip(cu, cu[1:])]
        labels_ok = torch.equal(mb["labels"], mb["tokens"] + 1)
        out.append({"pieces": pieces, "local_cp_size": int(mb["local_cp_size"]),
                    "labels_ok": labels_ok})
    return {"rank": rank, "world": world, "microbatches": out}


needs_checkout = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.mark.dist
@needs_checkout
def test_every_sample_arrives_whole_on_exactly_the_ranks_of_its_group():
    results = launch(data_path_case, DP * CP, args=(str(mlm_src()),), timeout=240)
    expected = {(d, i): _tokens(d, i, L).tolist()
                for d in range(DP) for i, L in enumerate(_lengths(d))}
    holders: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    num_mbs = {len(r["microbatches"]) for r in results}
    assert len(num_mbs) == 1, f"ranks disagree on the micro-batch count: {num_mbs}"
    for r in results:
        for m, mb in enumerate(r["microbatches"]):
            assert mb["labels_ok"], (r["rank"], m)
            for piece in mb["pieces"]:
                key = (piece[0] // 100_000, piece[0] % 100_000 // 1_000)
                assert piece == expected[key], (r["rank"], m, key)  # whole, in order
                holders.setdefault(key, []).append((m, r["rank"], mb["local_cp_size"]))
    assert sorted(holders) == sorted(expected), "a sample never arrived"
    for key, where in holders.items():
        mbs = {m for m, _, _ in where}
        sizes = {size for _, _, size in where}
        ranks = sorted(rank for _, rank, _ in where)
        assert len(mbs) == 1 and len(sizes) == 1, (key, where)  # one micro-batch, one group
        assert len(ranks) == sizes.pop() == len(set(ranks)), (key, where)  # once per rank
    print(f"Megatron-LM data path at {checkout_commit()}: {len(expected)} samples, "
          f"{num_mbs.pop()} micro-batches over {DP * CP} ranks")
