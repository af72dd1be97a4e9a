"""Unit tests of the plan-to-schedule glue (cpkit.dynamic.pipeline) that need no process group:
padding a plan for the interleaved schedule and the config gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cpkit.dynamic import schedule
from cpkit.dynamic.pipeline import check_schedule_config, pad_plan
from cpkit.errors import CPConfigError


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
