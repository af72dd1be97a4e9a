"""Dynamic CP on 4 ranks gives the loss and gradients of a cp=1 run of the same samples.

One global batch of 9 packed sequences of mixed lengths (8 to 54 tokens; x16 on GPU) is
scheduled over the DPxCP group of 4 ranks with max_seq_len_per_rank=24 (x16): the plan runs the
longest sample on all 4 ranks, others on pairs and on single ranks, so local CP sizes 1, 2 and 4
all occur in one global batch (asserted). The model is built for the static layout dp=4, cp=1;
cpkit.dynamic.runtime.dynamic_cp_step switches the CP group per micro-batch.

Reference: the same weights on one rank, every sequence on its own (sbhd, cp=1; MCore's local
attention in fp32, cpkit's at cp=1 in bf16), loss = sum of all token losses / all tokens,
gradients accumulated over the sequences. Cases: the scheduled plan with the p2p, all_gather and
a2a comm types, and a hand-built plan in which ranks sit idle in some micro-batches (they must
still join the reductions; a hang would end the launch at its timeout).

Tolerances: fp32 (gloo) 1e-5 absolute on the loss, gradients rtol=atol=1e-5; bf16 (NCCL)
5e-3 on the loss, gradients rtol=atol=2e-2 relative to each reference gradient's largest entry
(bf16 keeps 8 mantissa bits; the dynamic run sums the same terms in another order and over
several ranks, so errors of a few 1e-3 of the scale per element are expected).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.dynamic import CPGroupAssignment, Microbatch, Plan, build_group_registry, cp_size_for, schedule
from cpkit.dynamic.runtime import dynamic_cp_step
from cpkit.groups import build_pg_collection
from cpkit.layout import CPLayout
from cpkit.testing.models import GPTConfig, build_gpt, named_gradients
from cpkit.testing import device, grid_params, grid_result
from cpkit.testing.cpu_shim import install_mcore_cpu_shim
from cpkit.testing.compare import assert_grads_close
from cpkit.testing.reference import per_sequence_reference, single_rank_pg_collection, token_sample

LENS = (13, 54, 11, 29, 8, 26, 12, 10, 11)
MAX_SEQ_LEN_PER_RANK = 24
WORLD = 4

TOL = {
    torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(loss=5e-3, rtol=2e-2, atol=2e-2),
}


def _cases(backend: str, world_size: int):
    cases = [dict(id=f"scheduled-{comm}", comm=comm, plan="scheduled") for comm in ("p2p", "all_gather", "a2a")]
    cases.append(dict(id="idle-ranks-p2p", comm="p2p", plan="idle"))
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
    install_mcore_cpu_shim()
    dev = device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    scale = 1 if dev.type == "cpu" else 16  # real kernels on GPU: sequences of 128 to 864 tokens
    lens = [n * scale for n in LENS]
    max_len = MAX_SEQ_LEN_PER_RANK * scale
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                    seq_length=2 * max(lens), dtype=dtype)
    samples = _samples(lens, cfg.vocab_size, dev)
    total = float(sum(lens))

    # Reference: one rank, cp=1, one sequence at a time.
    ref_pgc = single_rank_pg_collection()
    ref = build_gpt(cfg, ref_pgc, attention="local" if dtype == torch.float32 else "cpkit", device=dev)
    ref_loss = per_sequence_reference(ref, samples, ref_pgc, total_tokens=total)
    ref_grads = named_gradients(ref)

    # Dynamic CP over the DPxCP group of a dp=4, cp=1 layout.
    layout = CPLayout(world_size=WORLD, tp=1, cp=1, cp_comm_type=case["comm"], num_attention_heads=8,
                      num_query_groups=4)
    pgc = build_pg_collection(layout)
    registry = build_group_registry([list(range(WORLD))], dist.get_rank())
    if case["plan"] == "scheduled":
        plan = schedule(lens, dp_cp_size=WORLD, max_seq_len_per_rank=max_len)
    else:
        plan = _idle_plan(lens, max_len)
    used = {g.cp_size for mb in plan.microbatches for g in mb.groups}
    assert used == {1, 2, 4}, f"the plan should use CP sizes 1, 2 and 4, used {sorted(used)}"

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


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(_cases, world_sizes=(WORLD,)))
def test_dynamic_cp_matches_cp1(backend, world_size, case_id):
    """Dynamic CP (local CP sizes 1, 2, 4 in one global batch): the cp=1 loss and gradients."""
    grid_result(dynamic_case, _cases, backend, world_size, case_id, timeout=240.0).check()
