"""Megatron-LM's dynamic-CP data path on gloo ranks, from the checkout named by CPKIT_MLM_SRC, and
one training step on what it delivers:
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

The training step is a second launch (MCore's GPT comes from the installed megatron-core, which
cannot share a process with the checkout's files): Megatron-LM's plan (its per-rank sample lists,
as cpkit CP groups) runs through cpkit.dynamic.runtime.dynamic_cp_step with cpkit's attention,
each rank reading only the samples Megatron-LM's path delivered to it, against a cp=1 reference
built from the original samples (fp32; loss 1e-5, gradients rtol=atol=1e-5). At PP 2 with VPP 2,
Megatron-LM's VPP-aligned plan (align_sample_id_groups) of a batch runs through MCore's
interleaved schedule (functional/test_dynamic_pipeline.py::pipeline_case, its reference and
tolerances). Megatron-LM's own model-side slicing (get_cp_slice_for_thd) needs Transformer
Engine and is not run.
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


def _key(piece: list[int]) -> tuple[int, int]:
    """(DP rank that loaded it, its index there), decoded from a sample's first token."""
    return piece[0] // 100_000, piece[0] % 100_000 // 1_000


def _all_samples() -> dict[tuple[int, int], int]:
    """Every sample's key -> its length, in a numbering of cpkit's own (not upstream's ids)."""
    return {(d, i): L for d in range(DP) for i, L in enumerate(_lengths(d))}


def training_step_case(delivered: list[dict]):
    """Megatron-LM's plan and delivered samples through cpkit's runtime (see the module
    docstring); returns (loss, reference loss)."""
    from cpkit.dynamic import Microbatch, Plan, build_group_registry
    from cpkit.dynamic.invariants import plan_violations
    from cpkit.dynamic.mcore import groups_from_rank_lists
    from cpkit.dynamic.runtime import dynamic_cp_step
    from cpkit.parallel.groups import build_pg_collection
    from cpkit.parallel.layout import CPLayout
    from cpkit.testing.compare import assert_grads_close
    from cpkit.mcore_cpu import install_mcore_cpu_shim
    from cpkit.testing.models import GPTConfig, build_gpt, named_gradients
    from cpkit.testing.reference import per_sequence_reference, single_rank_pg_collection

    install_mcore_cpu_shim()
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = sorted(_all_samples())
    ids = {key: k for k, key in enumerate(keys)}
    lens = [_all_samples()[key] for key in keys]
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                    seq_length=2 * max(lens))

    def sample(tokens: torch.Tensor) -> dict:
        return {"tokens": tokens % cfg.vocab_size, "labels": (tokens + 1) % cfg.vocab_size,
                "loss_mask": torch.ones(tokens.numel())}

    by_rank = sorted(delivered, key=lambda r: r["rank"])
    microbatches = []
    for m in range(len(by_rank[0]["microbatches"])):
        per_rank = [[ids[_key(p)] for p in r["microbatches"][m]["pieces"]] for r in by_rank]
        microbatches.append(Microbatch(groups=groups_from_rank_lists(per_rank)))
    plan = Plan(microbatches=tuple(microbatches), seq_lens=tuple(lens), dp_cp_size=world,
                max_seq_len_per_rank=MAX_SEQ_LEN_PER_RANK, workloads=tuple(float(L * L) for L in lens),
                needed_cp_sizes=tuple(1 for _ in lens))
    assert plan_violations(plan) == [], plan_violations(plan)
    mine = {ids[_key(p)]: torch.tensor(p) for mb in by_rank[rank]["microbatches"]
            for p in mb["pieces"]}

    # Reference: one rank, cp=1, each original sample on its own.
    ref_pgc = single_rank_pg_collection()
    ref = build_gpt(cfg, ref_pgc, attention="local")
    total = float(sum(lens))
    originals = [sample(_tokens(d, i, _all_samples()[(d, i)])) for d, i in keys]
    ref_loss = per_sequence_reference(ref, originals, ref_pgc, total_tokens=total)
    ref_grads = named_gradients(ref)

    pgc = build_pg_collection(CPLayout(world_size=world, tp=1, cp=1, cp_comm_type="p2p",
                                       num_attention_heads=8, num_query_groups=4))
    registry = build_group_registry([list(range(world))], rank)
    model = build_gpt(cfg, pgc, attention="cpkit", cp_comm_type="p2p")
    model.zero_grad(set_to_none=True)
    result = dynamic_cp_step(model, plan, registry, lambda i: sample(mine[i]), pg_collection=pgc)
    assert abs(result.loss - ref_loss) <= 1e-5, f"loss {result.loss} vs reference {ref_loss}"
    assert_grads_close(named_gradients(model), ref_grads, rtol=1e-5, atol=1e-5, scaled=False)
    return result.loss, ref_loss, sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})


needs_checkout = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def delivered():
    """Each rank's packed micro-batches from Megatron-LM's data path (one launch per module)."""
    return launch(data_path_case, DP * CP, args=(str(mlm_src()),), timeout=240)


@pytest.mark.dist
@needs_checkout
def test_every_sample_arrives_whole_on_exactly_the_ranks_of_its_group(delivered):
    results = delivered
    expected = {(d, i): _tokens(d, i, L).tolist()
                for d in range(DP) for i, L in enumerate(_lengths(d))}
    holders: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    num_mbs = {len(r["microbatches"]) for r in results}
    assert len(num_mbs) == 1, f"ranks disagree on the micro-batch count: {num_mbs}"
    for r in results:
        for m, mb in enumerate(r["microbatches"]):
            assert mb["labels_ok"], (r["rank"], m)
            for piece in mb["pieces"]:
                key = _key(piece)
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


@pytest.mark.dist
@needs_checkout
def test_one_training_step_on_megatron_lm_delivered_microbatches_matches_cp1(delivered):
    results = launch(training_step_case, DP * CP, args=(delivered,), timeout=300)
    loss, ref_loss, cp_sizes = results[0]
    assert all(r[0] == loss for r in results)  # every rank returns the global loss
    assert len(cp_sizes) > 1, f"the plan should mix CP sizes, used {cp_sizes}"


# PP 2 with VPP 2 over a DPxCP group of 2: a batch on which Megatron-LM's VPP alignment returns
# (lengths a multiple of 2 x DPxCP; CP sizes 1 and 2; no idle rank), with the lengths and
# max_seq_len_per_rank (16) of functional/test_dynamic_pipeline.py's scale.
PIPELINE_LENS = (12, 12, 28, 8, 8)


@pytest.mark.dist
@needs_checkout
def test_megatron_lm_vpp_plan_through_the_interleaved_pipeline_schedule_matches_cp1():
    from cpkit.dynamic.mlm import mlm_schedule
    from functional.test_dynamic_pipeline import MAX_SEQ_LEN_PER_RANK as PIPELINE_M
    from functional.test_dynamic_pipeline import pipeline_case

    plan = mlm_schedule(PIPELINE_LENS, 2, PIPELINE_M, microbatch_group_size=2)
    assert len(plan.microbatches) % 2 == 0
    spec = [[(list(g.ranks), list(g.samples)) for g in mb.groups] for mb in plan.microbatches]
    case = dict(id="mlm-pp2-vpp2", tp=1, pp=2, vpp=2, plan=spec, lens=PIPELINE_LENS,
                expect_idle=False)
    results = launch(pipeline_case, 4, args=(case,), timeout=300)
    assert all(abs(loss - ref) <= 1e-5 for loss, ref, _, _ in results)
