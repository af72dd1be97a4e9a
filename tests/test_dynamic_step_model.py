"""The real-step model (cpkit.dynamic.step_model), its fit from micro-benchmarks
(cpkit.dynamic.step_fit) and the reference plans the scheduler must beat (cpkit.dynamic.candidates):
pure Python, checked against hand-computed figures and synthetic measurements."""

from __future__ import annotations

import pytest

from cpkit.dynamic.cost import CostModel, ModelDims, load_calibration
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.errors import CPConfigError

DIMS = ModelDims(num_layers=4, ffn_hidden_size=14336, gated_linear_unit=True)


def _costs(**kw):
    from cpkit.dynamic.step_model import OpCounts, StepCosts

    base = dict(ops=OpCounts({1: (600.0, 300.0, 16.0, 0.0), 2: (1000.0, 300.0, 17.0, 0.0),
                              4: (1400.0, 300.0, 17.0, 0.0)}),
                host_op_s=20e-6, sync_s=30e-6, mem_s_per_token=2e-9, overlap_loss=0.3,
                residual_s={1: 1e-3, 2: 2e-3, 4: 3e-3}, idle_s=4e-3, prep_mb_s=1e-3,
                prep_sample_s=0.5e-3, reduce_opt_s=22e-3)
    base.update(kw)
    return StepCosts(**base)


def _model(**kw):
    from cpkit.dynamic.step_model import StepModel

    return StepModel(DIMS, load_calibration(), costs=_costs(**kw))


def _plan(mbs, packed=True, lens=None, n=4):
    count = 1 + max(s for mb in mbs for _, ss in mb for s in ss)
    lens = tuple(lens or [1000 + 100 * i for i in range(count)])
    return Plan(microbatches=tuple(Microbatch(tuple(CPGroupAssignment(tuple(r), tuple(s), len(r))
                                                    for r, s in mb)) for mb in mbs),
                seq_lens=lens, dp_cp_size=n, max_seq_len_per_rank=1 << 14,
                workloads=tuple(float(L) for L in lens), needed_cp_sizes=(1,) * len(lens),
                packed=packed)


def test_op_counts_interpolate_between_and_extend_beyond_counted_sizes():
    from cpkit.dynamic.step_model import OpCounts

    ops = OpCounts({1: (600.0, 300.0, 16.0, 1.0), 4: (1400.0, 600.0, 20.0, 1.0)})
    assert ops.ops(1, 2) == 1200.0 and ops.syncs(4, 3) == 23.0
    assert ops.ops(2, 1) == pytest.approx(600 + (1400 - 600) / 3 + 300 + 300 / 3)
    assert ops.ops(8, 0) == pytest.approx(1400 + (1400 - 600) * 4 / 3)  # linear beyond the last
    with pytest.raises(CPConfigError, match="ops.per_cp"):
        OpCounts({})
    assert OpCounts.from_dict(ops.to_dict()) == ops


def test_group_time_adds_host_sync_memory_and_residual_to_the_kernels():
    model = _model()
    kernels = CostModel(DIMS, load_calibration())
    lens, c = (4000, 3000), 2
    gpu = kernels.group_time(lens, c) + 4 * 2e-9 * sum(-(-L // (2 * c)) * 2 for L in lens)
    host = 20e-6 * 1600.0  # 1000 + 2 x 300 ops at cp 2
    want = max(gpu, host) + 0.3 * min(gpu, host) + 30e-6 * 17 + 2e-3
    assert model.group_time(lens, c) == pytest.approx(want)


def test_per_sample_ops_have_their_own_cost():
    cheap, dear = _model(sample_op_s=1e-6), _model()  # dear: host_op_s for every op
    # eight tiny samples: the host's time is the longer, so it shows whole
    assert dear.group_time((16,) * 8, 1) - cheap.group_time((16,) * 8, 1) == pytest.approx(
        (20e-6 - 1e-6) * 300 * 8)


def test_predict_runs_the_runtime_order_with_prep_idle_slots_and_reduce():
    model = _model()
    plan = _plan([[((0, 1), (0,)), ((2,), (1,))], [((0, 1, 2, 3), (2,))]])
    p = model.predict(plan)
    t0, t1, t2 = (model.group_time([plan.seq_lens[s]], c) for s, c in ((0, 2), (1, 1), (2, 4)))
    # rank 3 idles in micro-batch 0, rank 2 waits for nobody; micro-batch 1 starts when all are free
    assert p["per_rank_fwd_bwd_s"] == pytest.approx([max(t0, t1, 4e-3) + t2] * 4)
    prep = [2 * (1e-3 + 0.5e-3)] * 3 + [1.5e-3]
    assert p["prep_s"] == pytest.approx(max(prep) + 30e-6)
    assert p["step_s"] == pytest.approx(p["prep_s"] + p["fwd_bwd_s"] + 22e-3)
    assert model.step_time(plan) == p["step_s"]


def test_an_unpacked_plan_runs_one_sample_at_a_time_and_waits_after_each_microbatch():
    from cpkit.dynamic.step_model import runtime_segments

    model = _model()
    plan = _plan([[((0, 1), (0, 1)), ((2,), (2,)), ((3,), (3,))]], packed=False)
    segments, lockstep = runtime_segments(plan)
    assert lockstep and [[[(g.ranks, g.samples) for g in mb.groups] for mb in seg] for seg in segments] == [
        [[((0, 1), (0,)), ((2,), (2,)), ((3,), (3,))], [((0, 1), (1,))]]]
    t = [model.group_time([plan.seq_lens[s]], c) for s, c in ((0, 2), (1, 2), (2, 1), (3, 1))]
    first = max(t[0], t[2], t[3])
    assert model.predict(plan)["fwd_bwd_s"] == pytest.approx(first + max(t[1], 4e-3) + 30e-6)


def test_the_step_model_needs_its_costs():
    from cpkit.dynamic.step_model import StepModel

    with pytest.raises(CPConfigError, match="calibration.step"):
        StepModel(DIMS, load_calibration())


def test_costs_round_trip_through_the_calibration_file_form():
    from cpkit.dynamic.cost import Calibration
    from cpkit.dynamic.step_model import StepCosts, StepModel, with_costs

    costs = _costs(sample_op_s=3e-6)
    assert StepCosts.from_dict(costs.to_dict()) == costs
    cal = with_costs(load_calibration(), costs)
    assert StepModel(DIMS, cal).costs == costs
    with pytest.raises(CPConfigError, match="step"):
        StepCosts.from_dict({**costs.to_dict(), "host_op_s": -1.0})
    assert isinstance(cal, Calibration)


def test_the_fit_recovers_the_constants_of_synthetic_measurements():
    from cpkit.dynamic.step_fit import MicrobatchPoint, fit_costs

    kernels = CostModel(DIMS, load_calibration())
    true = dict(host_op_s=15e-6, sample_op_s=5e-6, mem_s_per_token=3e-9, overlap_loss=0.2)
    resid = {1: 0.5e-3, 2: 1.5e-3, 4: 2.5e-3}
    base, per = {1: 600.0, 2: 1000.0, 4: 1400.0}, {1: 300.0, 2: 500.0, 4: 900.0}

    def point(c, lens):
        gpu = kernels.group_time(lens, c) + 4 * true["mem_s_per_token"] * sum(-(-L // (2 * c)) * 2 for L in lens)
        host = true["host_op_s"] * base[c] + true["sample_op_s"] * per[c] * len(lens)
        t = max(gpu, host) + true["overlap_loss"] * min(gpu, host) + 20e-6 * 16 + resid[c]
        return MicrobatchPoint(c, tuple(lens), base[c], per[c] * len(lens), 16.0, t)

    pts = [point(1, [64]), point(1, [1024]), point(1, [4096]), point(1, [8192]), point(1, [2048] * 4),
           point(1, [32] * 4), point(1, [16] * 8)]
    pts += [point(c, lens) for c in (2, 4) for lens in ([64 * c], [8192 * c], [2048 * c] * 4)]
    got = fit_costs(pts, lambda p: kernels.group_time(p.seq_lens, p.cp), 4, 20e-6)
    for c, errs in got["errors"].items():
        assert max(abs(e) for e in errs) < 0.03, (c, errs)
    assert got["host_op_s"] == pytest.approx(true["host_op_s"], rel=0.25)
    assert got["residual_s"][4] == pytest.approx(resid[4], rel=0.5, abs=3e-4)
    with pytest.raises(CPConfigError, match="cp 1"):
        fit_costs(pts[7:], lambda p: 0.0, 4, 0.0)


# ----------------------------------------------------------------------- reference plans


def _check(plan: Plan, lens, needs, M):
    from cpkit.dynamic.invariants import plan_violations

    assert plan_violations(plan) == []
    assert sorted(s for mb in plan.microbatches for s in mb.samples) == list(range(len(lens)))
    for m in range(len(plan.microbatches)):
        for g in plan.microbatches[m].groups:
            assert all(g.cp_size == needs[s] for s in g.samples)
            assert sum(-(-lens[s] // g.cp_size) for s in g.samples) <= M


def test_fill_to_capacity_packs_fewer_fuller_microbatches():
    from cpkit.dynamic.candidates import fill_to_capacity_plan
    from cpkit.dynamic.scheduler import needed_cp_sizes

    lens = [12000, 9000, 3000, 2500, 2000, 1500, 1200, 1000, 800, 700, 600, 500, 400, 300]
    M = 4096
    needs = needed_cp_sizes(lens, dp_cp_size=4, max_seq_len_per_rank=M)
    plan = fill_to_capacity_plan(lens, needs, dp_cp_size=4, max_seq_len_per_rank=M)
    _check(plan, lens, needs, M)
    # 40.6K tokens over 4 x 4K per micro-batch: at least 3; first fit needs no more than 4
    assert 3 <= len(plan.microbatches) <= 4 and plan.candidate == "fill"


def test_choose_keeps_cpkits_plan_only_where_it_wins_by_more_than_the_band():
    from cpkit.dynamic.candidates import MODEL_ERROR_BAND, MODEL_ERROR_SOURCE, choose_plan

    own, a, b = object(), object(), object()
    times = {a: 1.05, b: 1.2}
    pick = choose_plan((1.0, "earliest-finish", own), {"mlm": a, "mcore": b}, times.__getitem__, 2.0)
    assert pick == (1.05, "mlm", a)  # cpkit's 5% lead is inside the model's 10% error
    pick = choose_plan((1.0, "earliest-finish", own), {"mcore": b}, times.__getitem__, 2.0)
    assert pick[1] == "earliest-finish"  # a 20% lead is outside it
    pick = choose_plan((1.0, "static", own), {"mlm": a}, times.__getitem__, 1.02)
    assert pick[1] == "static"  # a reference modeled slower than static CP is never taken
    assert MODEL_ERROR_BAND == 0.10 and "not validated" in MODEL_ERROR_SOURCE


def test_schedule_takes_a_reference_plan_the_model_cannot_tell_apart():
    from cpkit.dynamic import schedule
    from cpkit.dynamic.scheduler import needed_cp_sizes

    lens = [7000, 5000, 3000, 2000, 1500, 900, 800, 700, 600, 500, 400, 300, 200, 100]
    M = 4096
    own = schedule(lens, dp_cp_size=4, max_seq_len_per_rank=M, model_error_band=0.0)
    # the plan chosen without a band, offered as a reference: cpkit's own candidates cannot beat
    # it by 10%, so a reference is taken, and none is slower than it
    ref = schedule(lens, dp_cp_size=4, max_seq_len_per_rank=M, reference_plans={"mlm": own})
    assert ref.candidate in ("mlm", "fill")
    assert ref.step_time_s == pytest.approx(own.step_time_s) and ref.step_time_s <= ref.static_step_time_s
    _check(ref, lens, needed_cp_sizes(lens, dp_cp_size=4, max_seq_len_per_rank=M), M)
