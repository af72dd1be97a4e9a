"""Unit tests of the plan-to-schedule glue (cpkit.dynamic.pipeline): padding a plan for the
interleaved schedule and the config gate (no process group), and whole steps through MCore's
schedule at world size 1 (an idle micro-batch under a2a+p2p, a registry or plan of another
DPxCP group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cpkit.dynamic import build_group_registry, schedule
from cpkit.testing.plans import hand_plan
from cpkit.dynamic.pipeline import check_schedule_config, dynamic_cp_forward_backward, pad_plan
from cpkit.errors import CPConfigError
from cpkit.testing.fakes import fake_group
from cpkit.testing.models import GPTConfig, build_gpt, named_gradients
from cpkit.testing.reference import per_sequence_reference, single_rank_pg_collection, token_sample


def _config(**changes):
    base = dict(calculate_per_token_loss=True, variable_seq_lengths=True, overlap_p2p_comm=False,
                microbatch_group_size_per_vp_stage=None)
    return SimpleNamespace(**{**base, **changes})


def test_pad_plan_appends_empty_microbatches_up_to_the_multiple():
    plan = schedule([30, 12, 9, 40, 7], dp_cp_size=2, max_seq_len_per_rank=24)
    n = len(plan.microbatches)
    padded = pad_plan(plan, n + 1)
    assert len(padded.microbatches) == n + 1
    assert padded.microbatches[:n] == plan.microbatches
    assert padded.microbatches[n].groups == ()
    assert [padded.assignment_for_rank(r, n) for r in range(2)] == [None, None]
    assert pad_plan(plan, 1) is plan
    with pytest.raises(CPConfigError) as info:
        pad_plan(plan, 0)
    assert info.value.field == "multiple"


def test_config_gate_lists_every_violation_with_its_fix():
    config = _config(calculate_per_token_loss=False, variable_seq_lengths=False, overlap_p2p_comm=True)
    with pytest.raises(CPConfigError) as info:
        check_schedule_config(config, pp_size=2, vp_size=2, num_microbatches=3)
    fields = [v.field for v in info.value.violations]
    assert fields == ["config.calculate_per_token_loss", "config.variable_seq_lengths",
                      "config.overlap_p2p_comm", "len(plan.microbatches)"]
    assert "pad_plan(plan, 2)" in str(info.value)


def test_config_gate_accepts_what_the_schedule_can_run():
    check_schedule_config(_config(), pp_size=2, vp_size=2, num_microbatches=4)
    check_schedule_config(_config(variable_seq_lengths=False), pp_size=1, vp_size=None, num_microbatches=3)
    check_schedule_config(_config(overlap_p2p_comm=True), pp_size=4, vp_size=2, num_microbatches=8)


def test_config_gate_uses_the_vp_group_size():
    with pytest.raises(CPConfigError) as info:
        check_schedule_config(_config(microbatch_group_size_per_vp_stage=4), pp_size=2, vp_size=2,
                              num_microbatches=6)
    assert info.value.value == 6
    assert "microbatch_group_size_per_vp_stage=4" in str(info.value)


# ------------------------------------------------- a whole step through MCore's schedule, world size 1

STEP_CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=64,
                     extra=dict(calculate_per_token_loss=True))


@pytest.fixture(scope="module")
def pgc(mcore_cpu):
    return single_rank_pg_collection()


def test_an_idle_micro_batch_under_a2a_p2p_runs_the_filler_with_the_models_comm_type(pgc):
    """World size 1, pp = 1, cp_comm_type "a2a+p2p": two busy micro-batches at cp 1 (no [a2a, p2p]
    pair: the flat ring's comm type) and an empty one appended by pad_plan, where the rank runs
    the masked filler on its size-1 group with the model's own comm type (a size-1 group is no
    [a2a, p2p] pair). Loss and gradients: those of every sequence forwarded on its own with
    MCore's attention; the filler adds nothing."""
    lens = [7, 12, 3, 9]
    samples = [token_sample(n, 10 + i, STEP_CFG.vocab_size) for i, n in enumerate(lens)]
    ref = build_gpt(STEP_CFG, pgc, attention="local")
    ref_loss = per_sequence_reference(ref, samples, pgc, total_tokens=float(sum(lens)))

    model = build_gpt(STEP_CFG, pgc, attention="cpkit")
    attention = next(m for m in model.modules() if hasattr(m, "set_context_parallel_group"))
    own_comm = attention.cp_comm_type
    seen = []
    attention.register_forward_pre_hook(lambda m, *_: seen.append(m.cp_comm_type))
    plan = pad_plan(hand_plan([[((0,), (0, 2))], [((0,), (1, 3))]], lens, dp_cp_size=1), 3)
    result = dynamic_cp_forward_backward(model, plan, build_group_registry([[0]], 0), lambda i: samples[i],
                                         pg_collection=pgc, cp_comm_type="a2a+p2p")
    assert result.cp_sizes == (1, 1, None) and result.num_tokens == sum(lens)
    assert seen == ["p2p", "p2p", own_comm]
    assert attention.cp_comm_type == own_comm  # restored after the step
    assert abs(result.loss - ref_loss) <= 1e-5
    ref_grads = named_gradients(ref)
    for name, grad in named_gradients(model).items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("registry_ranks,plan_size", [([0, 1], 2), ([0], 2)],
                         ids=["registry-of-other-ranks", "plan-of-another-size"])
def test_a_registry_or_plan_of_another_dp_cp_group_is_refused(pgc, registry_ranks, plan_size):
    """pg_collection.dp_cp is [0]: a registry built for [0, 1] (with a plan that fits it), or a
    plan for two positions with the right registry, is refused before anything runs."""
    model = build_gpt(STEP_CFG, pgc, attention="cpkit")
    registry = build_group_registry([registry_ranks], 0, new_group=lambda ranks: fake_group(ranks))
    plan = hand_plan([[((0,), (0,))]], [4], dp_cp_size=plan_size)
    with pytest.raises(CPConfigError, match=r"must be built for pg_collection.dp_cp \[0\]") as info:
        dynamic_cp_forward_backward(model, plan, registry, lambda i: token_sample(4, i, STEP_CFG.vocab_size),
                                    pg_collection=pgc)
    assert info.value.field == "registry"
