"""Megatron-LM's dynamic-CP scheduler (DefaultDynamicCPScheduler, run from the checkout named by
CPKIT_MLM_SRC through cpkit.dynamic.mlm) under the invariants cpkit's scheduler keeps
(cpkit.dynamic.invariants), and the dynamic-CP review's four findings checked on the checkout.

Batches are drawn as upstream's varlen dataset makes them: every length a multiple of
2 * dp_cp_size (its THD pad granularity at TP=1), every sample fitting the largest power-of-two
group. Groups may be aligned power-of-two blocks or the whole DPxCP group (the fallback
next_hdp_group_packing_aware documents). Each upstream defect is a strict xfail carrying the
smallest counterexample hypothesis found (an @example) and the upstream symbol, next to a
passing test of cpkit's scheduler on the same input. When an upstream fix makes one pass, the
strict xfail fails the run: update the record (drop the xfail, keep the test).

Run: `CPKIT_MLM_SRC=/path/to/Megatron-LM python -m pytest tests/test_dynamic_mlm.py`; without
the variable the upstream tests skip with the reason.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cpkit.dynamic import schedule
from cpkit.dynamic.invariants import plan_violations
from cpkit.dynamic.mcore import SchedulerCrash
from cpkit.dynamic.mlm import (
    MLM_SCHEDULER,
    MLM_SRC_ENV,
    MLMCheckoutError,
    checkout_commit,
    mlm_call,
    mlm_schedule,
    skip_reason,
)
from cpkit.testing.plans import largest_pow2_le

needs_checkout = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

PROPERTY = settings(max_examples=50, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TIMEOUT_S = 0.5  # a call takes about a millisecond; upstream's endless loops end here
UTILS = "megatron/core/datasets/data_schedule_utils.py"
BALANCED = "megatron/core/pipeline_parallel/hybrid_cp_schedule.py::BalancedCPScheduler"
PROBES = "cpkit.testing.mlm_probes:"


@st.composite
def _batches(draw, vpp: bool):
    """(seq_lens, dp_cp_size, max_seq_len_per_rank, microbatch_group_size or None)."""
    n = draw(st.integers(1, 16))
    pad, largest = 2 * n, largest_pow2_le(n)
    M = draw(st.integers(-(-pad // largest), 4 * pad))
    most = max(1, largest * M // pad)
    lens = [pad * k for k in draw(st.lists(st.integers(1, most), min_size=1, max_size=12))]
    return lens, n, M, draw(st.integers(2, 4)) if vpp else None


def _is_pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _violations(impl: str, batch) -> dict[str, str]:
    lens, n, M, group = batch
    if impl == "mlm":
        def run():
            return mlm_schedule(lens, n, M, microbatch_group_size=group, timeout_s=TIMEOUT_S)
    else:
        def run():
            return schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M,
                            microbatch_group_size=group)
    try:
        plan = run()
    except SchedulerCrash as err:
        return {"no-crash": err.detail}
    found = {v.property: v.detail
             for v in plan_violations(plan, group, full_group_fallback=impl == "mlm")}
    if run().to_dict() != plan.to_dict():
        found["deterministic"] = "two runs gave different plans"
    return found


def _returned(found: dict) -> dict:
    """The violations of a plan that came back; examples where upstream crashed are left to
    the no-crash tests."""
    assume("no-crash" not in found)
    return found


# ---------------------------------------------------------------- the adapter (no checkout)

def _fake_git(tmp_path, head: str, refs: dict[str, str] | None = None, packed: str = ""):
    git = tmp_path / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text(head + "\n")
    for ref, sha in (refs or {}).items():
        (git / ref).parent.mkdir(parents=True, exist_ok=True)
        (git / ref).write_text(sha + "\n")
    if packed:
        (git / "packed-refs").write_text(packed)
    return tmp_path


def test_the_commit_is_read_from_dot_git_without_git(tmp_path):
    sha = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
    assert checkout_commit(_fake_git(tmp_path / "a", "ref: refs/heads/dev",
                                     {"refs/heads/dev": sha})) == sha
    assert checkout_commit(_fake_git(tmp_path / "b", "ref: refs/heads/dev",
                                     packed=f"# pack-refs\n{sha} refs/heads/dev\n")) == sha
    assert checkout_commit(_fake_git(tmp_path / "c", sha)) == sha  # detached HEAD
    (tmp_path / "d").mkdir()
    assert checkout_commit(tmp_path / "d") == "unknown"  # a copied tree without .git


def test_without_the_variable_upstream_tests_skip_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.delenv(MLM_SRC_ENV, raising=False)
    assert MLM_SRC_ENV in skip_reason()
    with pytest.raises(MLMCheckoutError, match=MLM_SRC_ENV):
        mlm_schedule([4], 1, 4)
    monkeypatch.setenv(MLM_SRC_ENV, str(tmp_path))
    assert "data_schedule.py" in skip_reason()


# ---------------------------------------------------------------- invariants that hold

@needs_checkout
@PROPERTY
@given(_batches(vpp=False))
def test_mlm_places_each_sample_once_in_disjoint_groups_deterministically(batch):
    found = _returned(_violations("mlm", batch))
    assert not {"each-sample-once", "disjoint-groups", "deterministic"} & set(found), found


@needs_checkout
@PROPERTY
@given(_batches(vpp=True))
def test_mlm_with_vpp_keeps_each_sample_once_and_the_microbatch_multiple(batch):
    found = _returned(_violations("mlm", batch))
    assert not {"each-sample-once", "disjoint-groups", "deterministic",
                "microbatch-multiple"} & set(found), found


@needs_checkout
@PROPERTY
@given(st.one_of(_batches(vpp=False), _batches(vpp=True)))
def test_mlm_groups_are_aligned_blocks_or_the_whole_dp_cp_group(batch):
    found = _returned(_violations("mlm", batch))
    assert "aligned-groups" not in found, found["aligned-groups"]


@needs_checkout
@PROPERTY
@given(_batches(vpp=False).filter(lambda b: _is_pow2(b[1])))
def test_mlm_keeps_every_invariant_at_power_of_two_dp_cp_without_vpp(batch):
    assert _violations("mlm", batch) == {}


# ---------------------------------------------------------------- recorded upstream defects

@needs_checkout
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    f"{UTILS}::next_hdp_group_packing_aware (fill_empty_gpus_once) raises IndexError when it "
    "widens a group at a DPxCP size that is not a power of two (5, 10, 14, 15 ranks). If this "
    "passes, upstream fixed it: remove this xfail."))
@PROPERTY
@given(_batches(vpp=False))
@example(([10, 10], 5, 5, None))  # smallest found by hypothesis
@example(([20, 20], 10, 5, None))  # smallest at an even size, which parallel_state accepts
def test_mlm_does_not_crash(batch):
    found = _violations("mlm", batch)
    assert "no-crash" not in found, found["no-crash"]


@needs_checkout
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    f"{UTILS}::align_sample_id_groups (fill_empty_by_expanding_cp) loops forever when the "
    "micro-batch it splits has a group larger than its empty tail (DPxCP 3, 6, 12 with VPP): "
    "fill_empty makes no progress. If this passes, upstream fixed it: remove this xfail."))
@PROPERTY
@given(_batches(vpp=True).filter(lambda b: not _is_pow2(b[1])))
@example(([6, 6], 3, 6, 2))  # smallest found by hypothesis
@example(([12, 12], 6, 6, 2))  # smallest at an even size
def test_mlm_with_vpp_returns_at_non_power_of_two_dp_cp(batch):
    found = _violations("mlm", batch)
    assert "did not return" not in found.get("no-crash", ""), found["no-crash"]


@needs_checkout
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    f"{UTILS}::align_sample_id_groups: a batch with too few samples to make a multiple of the "
    "VPP micro-batch group raises a bare AssertionError ('no tail microbatch has enough ids "
    "to split': no field, value or fix), at power-of-two DPxCP sizes too. If this passes, "
    "upstream fixed it: remove this xfail."))
@PROPERTY
@given(_batches(vpp=True).filter(lambda b: _is_pow2(b[1])))
@example(([2], 1, 2, 2))  # smallest found by hypothesis
@example(([4], 2, 2, 2))  # smallest at an even size
def test_mlm_with_vpp_gives_a_clear_error_or_a_plan_for_small_batches(batch):
    found = _violations("mlm", batch)
    assert not found.get("no-crash", "").startswith("AssertionError"), found["no-crash"]


@needs_checkout
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    f"{UTILS}::next_hdp_group_packing_aware budgets a packed group by sum(L / cp) as a float; "
    "a rank holds ceil(L / cp) tokens of each sample, so a packed group can exceed "
    "max_seq_len_per_rank where cp does not divide L (2*DPxCP padding, DPxCP 5 or 10). If "
    "this passes, upstream fixed it: remove this xfail."))
@PROPERTY
@given(_batches(vpp=False))
@example(([10, 10, 50], 5, 15, None))  # found by hypothesis (400 examples)
def test_mlm_fits_memory(batch):
    found = _returned(_violations("mlm", batch))
    assert "fits-memory" not in found, found["fits-memory"]


# (batch, how it fails: the start of each violation), batch = (seq_lens, dp_cp_size,
# max_seq_len_per_rank, VPP micro-batch group size)
RECORDED = [
    (([10, 10], 5, 5, None), {"no-crash": "IndexError: list assignment index out of range in "
                                         f"{UTILS}::fill_empty_gpus_once"}),
    (([20, 20], 10, 5, None), {"no-crash": "IndexError: list assignment index out of range in "
                                          f"{UTILS}::fill_empty_gpus_once"}),
    (([6, 6], 3, 6, 2), {"no-crash": f"did not return within {TIMEOUT_S:g} s (looping in "
                                    f"{UTILS}::fill_empty"}),
    (([12, 12], 6, 6, 2), {"no-crash": f"did not return within {TIMEOUT_S:g} s (looping in "
                                      f"{UTILS}::fill_empty"}),
    (([2], 1, 2, 2), {"no-crash": "AssertionError: align_sample_id_groups: no tail microbatch "
                                 f"has enough ids to split in {UTILS}::align_sample_id_groups"}),
    (([4], 2, 2, 2), {"no-crash": "AssertionError: align_sample_id_groups: no tail microbatch "
                                 f"has enough ids to split in {UTILS}::align_sample_id_groups"}),
    (([10, 10, 50], 5, 15, None), {"fits-memory": "micro-batch 0: group [0..3] holds 16 tokens "
                                                 "per rank > max_seq_len_per_rank=15"}),
]


@needs_checkout
@pytest.mark.parametrize("batch, failure", RECORDED, ids=[str(b) for b, _ in RECORDED])
def test_the_recorded_counterexamples_still_fail_as_recorded(batch, failure):
    # The strict xfails above hold for the reason given, not for another failure. A hang is
    # stopped wherever the loop is (fill_empty or fill_empty_by_expanding_cp): a prefix.
    found = _violations("mlm", batch)
    assert set(found) == set(failure) and all(found[k].startswith(failure[k]) for k in found), \
        found


@pytest.mark.parametrize("batch", [b for b, _ in RECORDED], ids=[str(b) for b, _ in RECORDED])
def test_cpkit_keeps_every_invariant_on_the_recorded_counterexamples(batch):
    assert _violations("cpkit", batch) == {}


# ---------------------------------------------------------------- the review's four findings

@needs_checkout
def test_fill_empty_reads_index_minus_one_but_the_read_cannot_change_its_result():
    """Finding 1: `while sid0 in sample_id_group[i] and i >= 0` reads sample_id_group[-1] (the
    last rank) before it tests i. The read happens, but `and i >= 0` is False there whatever
    the list holds, so answering it with every sample id changes nothing: the wrap-around is
    harmless on this commit (and align_sample_id_groups calls fill_empty only while the last
    rank is empty). Its real defect is the hang recorded above: with a head group larger than
    the empty tail, fill_empty returns its input unchanged and its caller loops."""
    head_group_of_two = mlm_call(PROBES + "fill_empty_reads_index_minus_one", [[0], [0], []])
    assert head_group_of_two["negative_reads"] == [-1]
    assert head_group_of_two["poisoned"] == head_group_of_two["plain"]
    assert head_group_of_two["plain"] == [[0], [0], []]  # no progress: the caller's endless loop
    two_groups = mlm_call(PROBES + "fill_empty_reads_index_minus_one", [[0], [1], []])
    assert two_groups["poisoned"] == two_groups["plain"] == [[0], [0], [1]]


@needs_checkout
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    f"{BALANCED}.next_hdp_group (fill_empty_gpus): `assert not all(work for work in "
    "micro_batches[empty_gpu : empty_gpu + needed_count])` is inverted: the slice starts at an "
    "empty rank, so it never fires, and too few empty ranks end in an IndexError instead of "
    "its message. dev's next_hdp_group_packing_aware (fill_empty_gpus_once) dropped the "
    "check and raises the same IndexError (test_mlm_does_not_crash). If this passes, "
    "upstream fixed it: remove this xfail."))
def test_too_few_empty_ranks_to_widen_a_group_are_reported_by_the_assertion():
    with pytest.raises(SchedulerCrash) as err:
        mlm_call(PROBES + "balanced_cp_rank_lists", [1, 1], 5, 1)  # smallest, as MCore's
    assert "not enough to expand" in err.value.detail, err.value.detail


@needs_checkout
def test_too_few_empty_ranks_end_in_an_index_error_past_the_inverted_assertion():
    # What the strict xfail above sees instead of the assertion's message.
    with pytest.raises(SchedulerCrash) as err:
        mlm_call(PROBES + "balanced_cp_rank_lists", [1, 1], 5, 1)
    assert err.value.detail == ("IndexError: list assignment index out of range in "
                                "megatron/core/pipeline_parallel/hybrid_cp_schedule.py::"
                                "fill_empty_gpus")


@needs_checkout
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    f"{BALANCED}.next_hdp_group (fill_empty_gpus) builds `[[]] * len(micro_batches)` and "
    "gives every rank of a widened group the same list object, so the per-rank sample lists "
    "it returns alias each other. If this passes, upstream fixed it: remove this xfail."))
@needs_checkout
def test_balanced_cp_scheduler_returns_one_list_per_rank():
    assert mlm_call(PROBES + "balanced_cp_rank_lists_alias", [4], 2, 4) == [False]


@needs_checkout
def test_dev_packing_aware_scheduler_returns_one_list_per_rank():
    # Finding 3 is fixed in dev's scheduler: the same widened group, independent lists.
    assert mlm_call(PROBES + "packing_aware_rank_lists_alias", [4], 2, 4) is False


@needs_checkout
def test_no_assertion_message_is_cut_short():
    """Finding 4: in `assert cond, "a, "` + newline + `"b"` the second string is a statement
    of its own, so the message loses it. dev's data_schedule(_utils) has none; MCore's
    BalancedCPScheduler (still on dev, imported by data_schedule) keeps one."""
    for module in ("data_schedule", "data_schedule_utils"):
        assert mlm_call(PROBES + "truncated_assert_messages", module) == []
    assert mlm_call(PROBES + "truncated_assert_messages", "hybrid_cp_schedule") == [[
        "fill_empty_gpus", "There should be at least one group existing, cannot reditribute, ",
        "try to increase 'max-seqlen-per-cp-rank'."]]


# ---------------------------------------------------------------- hangs and crashes

@needs_checkout
def test_an_endless_loop_upstream_is_a_hang_with_its_input_and_the_worker_survives():
    start = time.monotonic()
    with pytest.raises(SchedulerCrash) as err:
        mlm_schedule([12, 12], 6, 6, microbatch_group_size=2, timeout_s=0.3)
    assert err.value.hang and err.value.inputs["seq_lens"] == [12, 12]
    assert "[12, 12]" in str(err.value) and "fill_empty" in err.value.detail
    assert time.monotonic() - start < 10
    start = time.monotonic()
    mlm_schedule([12, 12], 6, 6, timeout_s=5)  # the same worker answers at once
    assert time.monotonic() - start < 2


@needs_checkout
def test_an_exception_upstream_is_reported_with_its_type_and_input():
    with pytest.raises(SchedulerCrash) as err:
        mlm_schedule([10, 10], 5, 5)
    assert err.value.error_type == "IndexError" and not err.value.hang
    assert err.value.inputs == {"seq_lens": [10, 10], "dp_cp_size": 5,
                                "max_seq_len_per_rank": 5, "microbatch_group_size": None}


@needs_checkout
def test_a_loop_the_alarm_cannot_end_is_killed_after_the_grace_time(monkeypatch):
    from cpkit.dynamic import mlm

    monkeypatch.setattr(mlm, "_GRACE_S", 0.5)
    mlm_schedule([4], 2, 4)  # the worker is up: time the call only
    start = time.monotonic()
    with pytest.raises(SchedulerCrash, match="did not return within 0.2 s") as err:
        mlm_call(PROBES + "sleep_with_the_alarm_blocked", 60, timeout_s=0.2)
    assert err.value.hang and time.monotonic() - start < 5
    assert mlm_schedule([4], 2, 4).microbatches  # a fresh worker answers


@needs_checkout
def test_a_worker_that_dies_is_reported_and_replaced():
    with pytest.raises(SchedulerCrash, match="the worker died") as err:
        mlm_call(PROBES + "exit_worker", 3)
    assert not err.value.hang
    assert mlm_schedule([4], 2, 4).microbatches


@needs_checkout
def test_the_checkout_commit_is_reported():
    commit = checkout_commit()
    assert commit == "unknown" or len(commit) == 40, commit
    assert MLM_SCHEDULER.startswith("megatron/core/datasets/data_schedule.py::")


# ---------------------------------------------------------------- cpkit schedule --impl mlm

MLM_ARGV = ["schedule", "--impl", "mlm", "--dp-cp", "8", "--max-seq-len-per-rank", "2048",
            "--seq-lens", "4096,1024,512,2048,8192"]


def test_impl_mlm_without_the_checkout_exits_2_naming_the_variable(monkeypatch, capsys):
    from cpkit.cli import main

    monkeypatch.delenv(MLM_SRC_ENV, raising=False)
    assert main(MLM_ARGV) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --impl mlm:") and MLM_SRC_ENV in err[0]


@needs_checkout
def test_impl_mlm_prints_its_plan_beside_cpkit_mcore_and_static(capsys):
    from cpkit.cli import main

    assert main(MLM_ARGV) == 0
    out = capsys.readouterr().out
    assert out.startswith("dynamic CP plan (mlm): 5 samples over dp_cp_size=8")
    for name in ("static CP", "MCore", "cpkit", "Megatron-LM"):
        assert f"{name} " in out and " ms" in out, name
    assert main(MLM_ARGV + ["--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["mlm_step_time_s"] == stats["modeled_step_time_s"] > 0
    assert stats["cpkit_step_time_s"] > 0 and stats["static_step_time_s"] > 0


@needs_checkout
def test_impl_mlm_reports_an_endless_loop_upstream_within_30_s(capsys):
    from cpkit.cli import main

    start = time.monotonic()
    code = main(["schedule", "--impl", "mlm", "--dp-cp", "6", "--max-seq-len-per-rank", "6",
                 "--microbatch-group-size", "2", "--seq-lens", "12,12"])
    assert time.monotonic() - start < 30
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[:2] == ["mlm: no plan", out.splitlines()[1]]
    assert out.splitlines()[1].startswith("  no-crash: did not return within 5 s (looping in "
                                          f"{UTILS}::fill_empty")


@needs_checkout
def test_the_scheduler_benchmark_times_megatron_lm_beside_the_others():
    from cpkit.bench.dynamic.scheduler import _one_batch
    from cpkit.dynamic.cost import default_cost_model

    row = _one_batch([4096, 1024, 512, 2048, 8192, 300], 8, 2048, default_cost_model(), 1)
    assert row["mlm_s"] > 0 and row["mcore_s"] > 0 and row["static_s"] > 0
    assert row["mlm_violations"] == []
