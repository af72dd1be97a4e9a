"""cpkit's plan against the other implementations' plans under cpkit's own cost model: never more
than 2% slower (modeled step time, cpkit.dynamic.cost.CostModel.step_time) than MCore's
BalancedCPScheduler plan (cpkit.dynamic.mcore, always) or Megatron-LM dev's
DefaultDynamicCPScheduler plan (cpkit.dynamic.mlm, with CPKIT_MLM_SRC; skipped with the reason
without it), over realistic batches: DPxCP 2-32, VPP off and 2 (microbatch_group_size),
long-tailed lengths up to N * M / 2.

The other plan is compared where cpkit's runtime could run it: every group an aligned
power-of-two block. Plans with a group across the roots of a DPxCP size that is not a power of
two (MCore's and Megatron-LM's whole-group fallback) are outside cpkit's search; the strict
xfail below records one such batch. Hypothesis runs derandomized (CI is deterministic) and
reports a shrunk counterexample with the `cpkit schedule` command that shows it.

Run against Megatron-LM: `CPKIT_MLM_SRC=/path/to/Megatron-LM python -m pytest
tests/test_dynamic_search.py`.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from cpkit.dynamic import schedule
from cpkit.dynamic.cost import default_cost_model
from cpkit.dynamic.mcore import SchedulerCrash, mcore_schedule
from cpkit.dynamic.mlm import mlm_schedule, skip_reason
from cpkit.testing.plans import largest_pow2_le

SLACK = 1.02
PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
# The issue-40 batch: cpkit fell back to static CP (656.8 ms) where Megatron-LM's plan with
# VPP 2 was modeled at 557.3 ms.
ISSUE_40 = ([7000, 12000, 3000, 3000, 500, 26000, 800, 4100, 9000, 1500, 2500, 600], 12, 8192)
# Found by the Megatron-LM property below: with a multiple of 2 micro-batches on 2 ranks, every
# sample at cp 2 (Megatron-LM's plan, 199.4 ms modeled) beats cpkit's cp 1 static plan (203.4 ms).
TWO_RANKS_GROUP_2 = ([1, 1435, 1867, 1867], 2, 4096, 2)


@st.composite
def _batches(draw):
    """(seq_lens, N, M, microbatch_group_size): 1-3 samples per rank, three in four short (at
    most M / 2), the rest long (up to N * M / 2, and what the largest aligned group holds)."""
    n = draw(st.integers(2, 32))
    M = draw(st.sampled_from([4096, 8192, 16384]))
    cap = min(n * M // 2, largest_pow2_le(n) * M)
    short, long = st.integers(1, M // 2), st.integers(M // 2, cap)
    lens = draw(st.lists(st.one_of(short, short, short, long), min_size=n, max_size=3 * n))
    return lens, n, M, draw(st.sampled_from([None, 2]))


def _aligned(plan) -> bool:
    """Every group an aligned power-of-two block: a plan cpkit's runtime could run."""
    for mb in plan.microbatches:
        for g in mb.groups:
            k, f = len(g.ranks), g.ranks[0]
            if k & (k - 1) or f % k or tuple(g.ranks) != tuple(range(f, f + k)):
                return False
    return True


def _check_against(other, batch, name: str) -> None:
    lens, n, M, group = batch
    model = default_cost_model()
    if not _aligned(other):
        event(f"{name}: a group across the roots of N={n}, not compared")
        return
    theirs = model.step_time(other)
    ours = model.step_time(schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M,
                                    microbatch_group_size=group))
    vpp = f" --microbatch-group-size {group}" if group else ""
    assert ours <= SLACK * theirs, (
        f"cpkit's plan is modeled {ours / theirs:.3f}x {name}'s ({1e3 * ours:.1f} ms vs "
        f"{1e3 * theirs:.1f} ms): cpkit schedule --dp-cp {n} --max-seq-len-per-rank {M} "
        f"--seq-lens {','.join(map(str, lens))}{vpp} --impl {name}")


@PROPERTY
@given(_batches())
@example((*ISSUE_40, 2))
def test_cpkit_is_never_more_than_2_percent_slower_than_mcore(batch):
    lens, n, M, _ = batch
    try:
        other = mcore_schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M, timeout_s=0.5)
    except SchedulerCrash as err:  # recorded in tests/test_dynamic_mcore.py
        event(f"mcore crashed: {err.detail[:40]}")
        return
    _check_against(other, batch, "mcore")


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
@PROPERTY
@given(_batches())
@example((*ISSUE_40, 2))
@example((*ISSUE_40, None))
@example(TWO_RANKS_GROUP_2)
def test_cpkit_is_never_more_than_2_percent_slower_than_megatron_lm(batch):
    lens, n, M, group = batch
    try:
        other = mlm_schedule(lens, n, M, microbatch_group_size=group, timeout_s=0.5)  # ~1 ms a call
    except SchedulerCrash as err:  # recorded in tests/test_dynamic_mlm.py
        event(f"mlm crashed: {err.detail[:40]}")
        return
    _check_against(other, batch, "mlm")


def test_static_cp_at_a_wider_size_is_a_candidate():
    """Static CP at twice the needed size (fewer, fuller micro-batches) is among the plans the
    scheduler models: on TWO_RANKS_GROUP_2 it beats the cp 1 static plan."""
    lens, n, M, group = TWO_RANKS_GROUP_2
    plan = schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M, microbatch_group_size=group)
    assert plan.candidate == "wider-static"
    assert {g.cp_size for mb in plan.microbatches for g in mb.groups} == {2}
    assert plan.step_time_s < plan.static_step_time_s / 1.01


@pytest.mark.parametrize("group", [None, 2])
def test_the_issue_40_batch_widens_its_longest_sample_instead_of_static_cp(group):
    # Megatron-LM's plan (557.3 ms at VPP 2) spreads the 26000-token sample over 8 ranks and
    # the mid-sized ones over 2-4; static CP keeps every sample at cp 4 (656.8 ms).
    lens, n, M = ISSUE_40
    plan = schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M, microbatch_group_size=group)
    assert plan.candidate == "earliest-finish"
    assert plan.step_time_s <= 0.557 and plan.step_time_s < plan.static_step_time_s / 1.15
    sizes = {g.cp_size for mb in plan.microbatches for g in mb.groups}
    assert 8 in sizes and 1 in sizes  # mixed CP sizes


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "cpkit's groups never cross the roots of a DPxCP size that is not a power of two (6 = 4 + "
    "2), so two 49152-token samples at M=16384 each need the 4-rank block; MCore's "
    "BalancedCPScheduler spreads one over all 6 ranks, a group cpkit's registry does not build. "
    "If this passes, cpkit's search covers whole-group plans: remove this xfail."))
def test_at_six_ranks_cpkit_matches_a_plan_with_a_whole_group():
    lens = [49152, 49152, 12581, 8502, 4998, 1854, 1471, 1312, 920, 513, 399]
    model = default_cost_model()
    other = mcore_schedule(lens, dp_cp_size=6, max_seq_len_per_rank=16384, timeout_s=0.5)
    assert not _aligned(other)
    ours = schedule(lens, dp_cp_size=6, max_seq_len_per_rank=16384)
    assert model.step_time(ours) <= SLACK * model.step_time(other)
