"""Scenario of functional/test_dynamic_cp.py and `python -m cpkit.cluster dynamic-cp`: dynamic CP
over the DPxCP group of all ranks gives the loss and gradients of a cp=1 run of the same
samples. Plan, reference and tolerances: functional/test_dynamic_cp.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpkit.dynamic import CPGroupAssignment, Microbatch, Plan, build_group_registry, cp_size_for, schedule
from cpkit.dynamic.cost import CostModel, ModelDims
from cpkit.dynamic.runtime import dynamic_cp_step
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.process_device import device
from cpkit.testing.compare import assert_grads_close
from cpkit.testing.models import GPTConfig, build_gpt, named_gradients
from cpkit.testing.reference import per_sequence_reference, single_rank_pg_collection, token_sample

__all__ = ["LENS", "WORLD", "cases", "cluster_cases", "dynamic_case"]

LENS = (13, 54, 11, 29, 8, 26, 12, 10, 11)
# The scheduler times plans for the model that runs them: the default cost model is a 4096-wide
# model, for which static CP wins on these short samples; for this 64-wide one the plan mixes CP
# sizes 1, 2 and 4. The same plan runs with every comm type.
MODEL_DIMS = ModelDims(hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=8, num_layers=2)
MAX_SEQ_LEN_PER_RANK = 24
WORLD = 4

TOL = {
    torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(loss=5e-3, rtol=2e-2, atol=2e-2),
}


def cases(backend: str, world_size: int):
    """The scheduled plan with p2p, all_gather and a2a, the hand-built plan with idle ranks, and
    the scheduled plan on a GPT with learned absolute position embeddings (the one kind that
    reads the runtime's per-sequence position_ids: MCore derives RoPE positions itself)."""
    cases = [dict(id=f"scheduled-{comm}", comm=comm, plan="scheduled") for comm in ("p2p", "all_gather", "a2a")]
    cases.append(dict(id="idle-ranks-p2p", comm="p2p", plan="idle"))
    cases.append(dict(id="scheduled-p2p-learned-positions", comm="p2p", plan="scheduled",
                      positions="learned_absolute"))
    return cases


def _samples(lens, vocab: int, dev) -> list[dict]:
    """Sample i: tokens / labels (next token) / loss_mask, each [L_i], from seed 1000 + i."""
    return [token_sample(length, 1000 + i, vocab, dev) for i, length in enumerate(lens)]


def _idle_plan(lens, max_len: int) -> Plan:
    """A hand-built plan (4 ranks) with idle ranks: 2, 3 in micro-batch 1 and 0, 1 in micro-batch 2."""
    mbs = (
        Microbatch((CPGroupAssignment((0, 1, 2, 3), (1,), 4),)),
        Microbatch((CPGroupAssignment((0, 1), (3, 4), 2),)),
        Microbatch((CPGroupAssignment((2,), (0, 2), 1), CPGroupAssignment((3,), (6, 7), 1))),
        Microbatch((CPGroupAssignment((0, 1), (5,), 2), CPGroupAssignment((2, 3), (8,), 2))),
    )
    return Plan(microbatches=mbs, seq_lens=tuple(lens), dp_cp_size=WORLD, max_seq_len_per_rank=max_len,
                workloads=tuple(float(n * n) for n in lens),
                needed_cp_sizes=tuple(cp_size_for(n, max_len) for n in lens))


def _attention_groups(model) -> dict[str, object]:
    return {name: m.cp_group for name, m in model.named_modules() if hasattr(m, "set_context_parallel_group")}


def dynamic_case(case):
    """One case on every rank (see functional/test_dynamic_cp.py); returns (loss, reference loss,
    this rank's CP size per micro-batch)."""
    install_mcore_cpu_shim()
    dev = device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    scale = 1 if dev.type == "cpu" else 16  # real kernels on GPU: sequences of 128 to 864 tokens
    lens = [n * scale for n in LENS]
    max_len = case.get("max_len", MAX_SEQ_LEN_PER_RANK) * scale
    world = dist.get_world_size()
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                    seq_length=2 * max(lens), dtype=dtype, position_embedding_type=case.get("positions", "rope"))
    samples = _samples(lens, cfg.vocab_size, dev)
    total = float(sum(lens))

    # Reference: one rank, cp=1, one sequence at a time, positions arange(len) of each sequence
    # (per_sequence_reference), nothing from cpkit.sharding.
    ref_pgc = single_rank_pg_collection()
    ref = build_gpt(cfg, ref_pgc, attention="local" if dtype == torch.float32 else "cpkit", device=dev)
    ref_loss = per_sequence_reference(ref, samples, ref_pgc, total_tokens=total)
    ref_grads = named_gradients(ref)

    # Dynamic CP over the DPxCP group of a dp=4, cp=1 layout.
    layout = CPLayout(world_size=world, tp=1, cp=1, cp_comm_type=case["comm"], num_attention_heads=8,
                      num_query_groups=4)
    pgc = build_pg_collection(layout)
    registry = build_group_registry([list(range(world))], dist.get_rank())
    if case["plan"] == "scheduled":
        plan = schedule(lens, dp_cp_size=world, max_seq_len_per_rank=max_len, cost_model=CostModel(MODEL_DIMS))
    else:
        plan = _idle_plan(lens, max_len)
    used = {g.cp_size for mb in plan.microbatches for g in mb.groups}
    want = set(case.get("cp_sizes", (1, 2, 4)))
    assert used == want, f"the plan should use CP sizes {sorted(want)}, used {sorted(used)}"

    model = build_gpt(cfg, pgc, attention="cpkit", cp_comm_type=case["comm"], device=dev)
    static_groups = _attention_groups(model)
    model.zero_grad(set_to_none=True)
    result = dynamic_cp_step(model, plan, registry, lambda i: samples[i], pg_collection=pgc)
    grads = named_gradients(model)

    # The static binding is back, object for object.
    assert _attention_groups(model) == static_groups
    assert all(m.pg_collection is pgc for m in model.modules() if "pg_collection" in vars(m))
    assert result.num_tokens == total
    position = registry.dp_cp_ranks.index(dist.get_rank())
    expected = tuple(a.cp_size if a else None
                     for a in (plan.assignment_for_rank(position, m) for m in range(len(plan.microbatches))))
    assert result.cp_sizes == expected
    if case["plan"] == "idle":
        assert None in result.cp_sizes, "this rank should sit idle in one micro-batch"

    tol = TOL[dtype]
    assert abs(result.loss - ref_loss) <= tol["loss"], f"loss {result.loss} vs reference {ref_loss}"
    assert_grads_close(grads, ref_grads, rtol=tol["rtol"], atol=tol["atol"], scaled=dtype != torch.float32)
    return result.loss, ref_loss, result.cp_sizes


def cluster_cases(backend: str, world_size: int, a2a_sizes) -> list[dict]:
    """Cases for `python -m cpkit.cluster dynamic-cp` on any world size: on 4 ranks the functional
    grid, else the scheduled plan with max_seq_len_per_rank chosen (pure scheduler arithmetic)
    so that the most distinct CP sizes occur; a2a only where every CP size it uses is in
    `a2a_sizes` (fits the nodes)."""
    if world_size == WORLD:
        grid = cases(backend, world_size)
        sizes = (1, 2, 4)
    else:
        best = None
        for max_len in range(max(LENS) // world_size + 1, max(LENS) + 1):
            try:
                plan = schedule(LENS, dp_cp_size=world_size, max_seq_len_per_rank=max_len,
                                cost_model=CostModel(MODEL_DIMS))
            except ValueError:
                continue
            used = sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})
            if best is None or len(used) > len(best[1]):
                best = (max_len, used)
        if best is None:
            return []
        sizes = tuple(best[1])
        grid = [dict(c, max_len=best[0], cp_sizes=sizes) for c in cases(backend, world_size) if c["plan"] == "scheduled"]
    return [c for c in grid if c["comm"] != "a2a" or all(s in a2a_sizes for s in sizes)]
