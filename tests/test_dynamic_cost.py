"""Unit tests of the step-time cost model (cpkit.dynamic.cost) and its calibration files; the
real-step model (cpkit.dynamic.step_model), its fit from micro-benchmarks (cpkit.dynamic.step_fit)
and the reference plans the scheduler must beat (cpkit.dynamic.candidates), against
hand-computed figures and synthetic measurements."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cpkit.dynamic.cost import (
    CALIBRATION_ENV,
    COMM_TYPES,
    Calibration,
    CostModel,
    ModelDims,
    load_calibration,
    shipped_calibration_path,
)
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.errors import CPConfigError

REPO = Path(__file__).resolve().parents[1]


def _shipped() -> dict:
    return json.loads(shipped_calibration_path().read_text())


def _calibration_dims(cal: Calibration) -> ModelDims:
    """A model with the calibration's own shapes: its attention heads and a 4096-wide layer."""
    return ModelDims(hidden_size=4096, num_heads=cal.attention_heads, num_kv_heads=8,
                     head_dim=cal.attention_head_dim, num_layers=1)


def test_the_shipped_calibration_is_package_data_and_says_where_numbers_come_from():
    data = _shipped()
    for key in ("attention", "gemm", "link"):
        assert data[key]["points"], key
        assert data[key]["source"], key  # every number has its origin
    assert '"cpkit.dynamic" = ["*.json"]' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("kind", ["attention", "gemm", "link"])
def test_the_model_reproduces_every_calibration_point_within_5_percent(kind):
    cal = load_calibration(shipped_calibration_path())
    model = CostModel(_calibration_dims(cal), cal)
    for size, measured in getattr(cal, kind):
        if kind == "attention":
            flops = 3.5 * 2 * cal.attention_heads * size * size * cal.attention_head_dim
            expected, got = flops / (measured * 1e12), model.attention_time(size)
        elif kind == "gemm":
            flops = size * model.dims.linear_flops_per_token
            expected, got = flops / (measured * 1e12), model.gemm_time(size)
        else:
            expected, got = measured, model.link_time(size)
        assert got == pytest.approx(expected, rel=0.05), (kind, size)


def test_a_packed_call_reproduces_the_packed_calibration_points_within_5_percent():
    cal = load_calibration(shipped_calibration_path())
    assert cal.attention_packed, "the shipped calibration measures packed calls"
    model = CostModel(_calibration_dims(cal), cal)
    per_call = cal.attention_tokens_per_call
    for size, measured in cal.attention_packed:
        n = per_call // int(size)
        flops = n * 3.5 * 2 * cal.attention_heads * size * size * cal.attention_head_dim
        got = model.call_time([int(size)] * n)
        assert got == pytest.approx(max(flops / (measured * 1e12), model.call_time([1])), rel=0.05), size


def test_short_samples_share_a_call_and_a_lone_sample_runs_at_the_single_rate():
    single = ((256, 8.0), (32768, 500.0))
    cal = Calibration(attention=single, gemm=((1024, 500.0),), link=((1 << 20, 1e-4),),
                      attention_packed=((256, 200.0),), attention_tokens_per_call=32768)
    model = CostModel(ModelDims(num_layers=1), cal)
    flops256 = 3.5 * 2 * 32 * 256 * 256 * 128
    assert model.call_time([256]) == pytest.approx(flops256 / 8e12)  # alone: launch-bound rate
    assert model.call_time([256] * 128) == pytest.approx(128 * flops256 / 200e12)  # packed rate
    # Packing more short sequences into a call never makes each of them slower.
    per_seq = [model.call_time([256] * n) / n for n in (1, 2, 8, 32, 128)]
    assert per_seq == sorted(per_seq, reverse=True)
    # Without packed points the model falls back to one call at single rates (no speed-up).
    plain = CostModel(ModelDims(num_layers=1), Calibration(attention=single, gemm=cal.gemm, link=cal.link))
    assert plain.call_time([256] * 128) == pytest.approx(128 * flops256 / 8e12)


def test_a_link_fit_over_several_sizes_reproduces_them_within_5_percent():
    latency, bandwidth = 15e-6, 300e9
    points = [(b, latency + b / bandwidth) for b in (1 << 16, 1 << 20, 1 << 24, 1 << 27)]
    cal = Calibration(attention=((1024, 100.0),), gemm=((1024, 500.0),), link=tuple(points))
    model = CostModel(ModelDims(), cal)
    assert model.link_latency_s == pytest.approx(latency, rel=1e-6)
    for b, s in points:
        assert model.link_time(b) == pytest.approx(s, rel=0.05)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_time_per_rank_is_monotone_in_the_sample_length(comm_type):
    model = CostModel(comm_type=comm_type)
    lengths = sorted({int(1.07 ** k) for k in range(0, 190)} | {128, 255, 256, 257, 131072})
    for cp in (1, 2, 4, 8, 16, 64):
        times = [model.sample_time(L, cp) for L in lengths]
        assert all(b >= a for a, b in zip(times, times[1:])), (comm_type, cp)


def test_a_short_sample_is_fastest_on_one_rank_and_a_long_one_on_many():
    model = CostModel()
    assert model.sample_time(512, 1) < model.sample_time(512, 8)  # 8 tiny kernels + 7 ring steps
    assert model.sample_time(131072, 8) < model.sample_time(131072, 1) / 4


def test_ring_communication_hides_behind_long_attention_only():
    model = CostModel()
    # A long sample's ring steps hide behind its attention: cp 2 costs about half of cp 1.
    long_ratio = model.sample_time(65536, 2) / model.sample_time(65536, 1)
    short_ratio = model.sample_time(2048, 2) / model.sample_time(2048, 1)
    assert long_ratio < 0.55 and short_ratio > long_ratio


def test_calibration_file_comes_from_the_argument_then_the_environment(tmp_path, monkeypatch):
    data = _shipped()
    data["attention"]["points"] = [[1024, 1.0]]  # a very slow GPU
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    assert load_calibration().attention == ((1024, 1.0),)
    assert load_calibration(shipped_calibration_path()).attention != ((1024, 1.0),)
    monkeypatch.delenv(CALIBRATION_ENV)
    assert load_calibration() == load_calibration(shipped_calibration_path())


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"),
    ('{"attention": {"points": []}}', "attention.points"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_a_bad_calibration_file_is_named_in_the_error(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(CPConfigError, match=message):
        load_calibration(path)
    with pytest.raises(CPConfigError, match="cannot be read"):
        load_calibration(tmp_path / "missing.json")


def test_bad_model_dims_and_comm_type_name_the_field():
    with pytest.raises(CPConfigError) as info:
        ModelDims(hidden_size=0)
    assert info.value.field == "hidden_size"
    with pytest.raises(CPConfigError) as info:
        CostModel(comm_type="ring")
    assert info.value.field == "comm_type"


def test_step_time_waits_for_group_members_only_without_mcore_barrier():
    from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan

    model = CostModel()
    # Rank 0 runs a long sample then a short one; rank 1 two short ones. No barrier: the step
    # takes the longer rank's sum. MCore's schedule (packed=False) waits after each micro-batch.
    mbs = (Microbatch((CPGroupAssignment((0,), (0,), 1), CPGroupAssignment((1,), (1,), 1))),
           Microbatch((CPGroupAssignment((0,), (2,), 1), CPGroupAssignment((1,), (3,), 1))))
    lens = (8192, 512, 512, 8192)
    plan = Plan(mbs, lens, 2, 8192, (1.0,) * 4, (1,) * 4)
    t = {L: model.sample_time(L, 1) for L in set(lens)}
    assert model.step_time(plan) == pytest.approx(t[8192] + t[512])
    barrier = Plan(mbs, lens, 2, 8192, (1.0,) * 4, (1,) * 4, packed=False)
    assert model.step_time(barrier) == pytest.approx(2 * t[8192])
    assert math.isclose(sum(model.microbatch_times(plan)), 2 * t[8192])


def test_calibrate_writes_a_file_the_model_reads(tmp_path, capsys):
    from cpkit.bench.dynamic.calibrate import main

    out = tmp_path / "cal.json"
    assert main(["--device", "cpu", "--quick", "--ring-ranks", "1", "--warmup", "0", "--hidden",
                 "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                 "--iters", "1", "--out", str(out)]) == 0
    cal = load_calibration(out)
    assert [L for L, _ in cal.attention] == [128, 256, 512]
    assert [L for L, _ in cal.attention_packed] == [128, 256, 512] and cal.attention_tokens_per_call == 1024
    assert cal.link == load_calibration(shipped_calibration_path()).link  # kept: no ring
    data = json.loads(out.read_text())
    assert "calibrate" in data["attention"]["source"] and "kept from" in data["link"]["source"]
    assert CostModel(calibration=cal).sample_time(1000, 2) > 0
    assert f"calibration: {out}" in capsys.readouterr().out


SMALL = ModelDims(hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=4, num_layers=3, ffn_hidden_size=16,
                  bytes_per_element=2)


def test_linear_flops_count_every_projection_and_the_mlp():
    # q (8 x 4*4), k and v (8 x 2*4 each), o (4*4 x 8), MLP up and down (8 x 16 and 16 x 8)
    params = 8 * 16 + 2 * (8 * 8) + 16 * 8 + 2 * 8 * 16
    assert SMALL.linear_flops_per_token == 6.0 * params
    assert ModelDims(hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=4).linear_flops_per_token \
        == 6.0 * (128 + 128 + 128 + 2 * 8 * 32)  # the MLP defaults to 4 x hidden


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_a_group_time_is_its_layers_compute_plus_the_bytes_its_ranks_move(comm_type, cp):
    model = CostModel(SMALL, comm_type=comm_type)
    lens = (4096, 1000)
    chunks = [4096 // cp, 1000 // cp]
    tokens = sum(chunks)
    kv_bytes = 2 * 2 * 4 * 2  # K and V, two KV heads of 4, bf16
    qkvo_bytes = (2 * 4 + 2 * 2) * 4 * 2  # Q, O of 4 heads and K, V of 2, bf16
    step = model.call_time(chunks)  # one ring step: one call over both chunks
    fwd, bwd = model.link_time(tokens * kv_bytes), model.link_time(2 * tokens * kv_bytes)
    if comm_type == "p2p":  # the forward transfer hides behind 1/3.5 of a step, the backward's behind the rest
        hidden = max(0.0, fwd - step / 3.5) + max(0.0, bwd - step * 2.5 / 3.5)
        assert hidden > 0, "the test needs transfers that show"
        per_layer = model.gemm_time(tokens) + cp * step + (cp - 1) * hidden
    elif comm_type == "all_gather":
        per_layer = model.gemm_time(tokens) + cp * step + (cp - 1) * (fwd + bwd)
    else:
        per_layer = (model.gemm_time(tokens) + model.call_time(list(lens), heads_share=1 / cp)
                     + 2 * model.link_time((cp - 1) / cp * tokens * qkvo_bytes))
    assert model.group_time(lens, cp) == pytest.approx(3 * per_layer, rel=1e-12)


def test_step_time_waits_for_a_group_over_ranks_that_are_not_adjacent():
    from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan

    model = CostModel()
    # ranks 0 and 2 share a group, then rank 0 runs a sample alone: it starts when the group ends
    mbs = (Microbatch((CPGroupAssignment((0, 2), (0,), 2), CPGroupAssignment((1,), (1,), 1))),
           Microbatch((CPGroupAssignment((0,), (2,), 1),)))
    lens = (8192, 512, 4096)
    plan = Plan(mbs, lens, 3, 8192, (1.0,) * 3, (1,) * 3)
    assert model.step_time(plan) == pytest.approx(model.sample_time(8192, 2) + model.sample_time(4096, 1))


# ----------------------------------------------------------------------- the real-step model

STEP_DIMS = ModelDims(num_layers=4, ffn_hidden_size=14336, gated_linear_unit=True)


def _step_costs(**kw):
    from cpkit.dynamic.step_model import OpCounts, StepCosts

    base = dict(ops=OpCounts({1: (600.0, 300.0, 16.0, 0.0), 2: (1000.0, 300.0, 17.0, 0.0),
                              4: (1400.0, 300.0, 17.0, 0.0)}),
                host_op_s=20e-6, sync_s=30e-6, mem_s_per_token=2e-9, overlap_loss=0.3,
                residual_s={1: 1e-3, 2: 2e-3, 4: 3e-3}, idle_s=4e-3, prep_mb_s=1e-3,
                prep_sample_s=0.5e-3, reduce_opt_s=22e-3)
    base.update(kw)
    return StepCosts(**base)


def _step_model(**kw):
    from cpkit.dynamic.step_model import StepModel

    return StepModel(STEP_DIMS, load_calibration(), costs=_step_costs(**kw))


def _step_plan(mbs, packed=True, lens=None, n=4):
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
    model = _step_model()
    kernels = CostModel(STEP_DIMS, load_calibration())
    lens, c = (4000, 3000), 2
    gpu = kernels.group_time(lens, c) + 4 * 2e-9 * sum(-(-L // (2 * c)) * 2 for L in lens)
    host = 20e-6 * 1600.0  # 1000 + 2 x 300 ops at cp 2
    want = max(gpu, host) + 0.3 * min(gpu, host) + 30e-6 * 17 + 2e-3
    assert model.group_time(lens, c) == pytest.approx(want)


def test_per_sample_ops_have_their_own_cost():
    cheap, dear = _step_model(sample_op_s=1e-6), _step_model()  # dear: host_op_s for every op
    # eight tiny samples: the host's time is the longer, so it shows whole
    assert dear.group_time((16,) * 8, 1) - cheap.group_time((16,) * 8, 1) == pytest.approx(
        (20e-6 - 1e-6) * 300 * 8)


def test_predict_runs_the_runtime_order_with_prep_idle_slots_and_reduce():
    model = _step_model()
    plan = _step_plan([[((0, 1), (0,)), ((2,), (1,))], [((0, 1, 2, 3), (2,))]])
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

    model = _step_model()
    plan = _step_plan([[((0, 1), (0, 1)), ((2,), (2,)), ((3,), (3,))]], packed=False)
    segments, lockstep = runtime_segments(plan)
    assert lockstep and [[[(g.ranks, g.samples) for g in mb.groups] for mb in seg] for seg in segments] == [
        [[((0, 1), (0,)), ((2,), (2,)), ((3,), (3,))], [((0, 1), (1,))]]]
    t = [model.group_time([plan.seq_lens[s]], c) for s, c in ((0, 2), (1, 2), (2, 1), (3, 1))]
    first = max(t[0], t[2], t[3])
    assert model.predict(plan)["fwd_bwd_s"] == pytest.approx(first + max(t[1], 4e-3) + 30e-6)


def test_predict_gives_each_ranks_time_per_runtime_microbatch():
    # what the bench's marked step is held to, micro-batch by micro-batch: the group's time, or
    # idle_s where the rank is idle; the rest of the rank's forward + backward is waiting
    model = _step_model()
    packed = _step_plan([[((0, 1), (0,)), ((2,), (1,))], [((0, 1, 2, 3), (2,))]])
    p = model.predict(packed)
    t0, t1, t2 = (model.group_time([packed.seq_lens[s]], c) for s, c in ((0, 2), (1, 1), (2, 4)))
    assert p["per_rank_microbatch_s"] == [pytest.approx(x) for x in
                                          ([t0, t2], [t0, t2], [t1, t2], [4e-3, t2])]
    for r in range(4):
        assert sum(p["per_rank_microbatch_s"][r]) <= p["per_rank_fwd_bwd_s"][r] + 1e-12
    unpacked = _step_plan([[((0, 1), (0, 1)), ((2,), (2,)), ((3,), (3,))]], packed=False)
    q = model.predict(unpacked)  # two runtime micro-batches: sample j of every group in the j-th
    t = [model.group_time([unpacked.seq_lens[s]], c) for s, c in ((0, 2), (1, 2), (2, 1), (3, 1))]
    assert q["per_rank_microbatch_s"] == [pytest.approx(x) for x in
                                          ([t[0], t[1]], [t[0], t[1]], [t[2], 4e-3], [t[3], 4e-3])]


def test_the_step_model_needs_its_costs():
    from cpkit.dynamic.step_model import StepModel

    with pytest.raises(CPConfigError, match="calibration.step"):
        StepModel(STEP_DIMS, load_calibration())


def test_costs_round_trip_through_the_calibration_file_form():
    from cpkit.dynamic.cost import Calibration
    from cpkit.dynamic.step_model import StepCosts, StepModel, with_costs

    costs = _step_costs(sample_op_s=3e-6, call_gap_s=5e-3)
    assert StepCosts.from_dict(costs.to_dict()) == costs
    cal = with_costs(load_calibration(), costs)
    assert StepModel(STEP_DIMS, cal).costs == costs
    with pytest.raises(CPConfigError, match="step"):
        StepCosts.from_dict({**costs.to_dict(), "host_op_s": -1.0})
    assert isinstance(cal, Calibration)


def test_the_fit_recovers_the_constants_of_synthetic_measurements():
    from cpkit.dynamic.step_fit import MicrobatchPoint, fit_costs

    kernels = CostModel(STEP_DIMS, load_calibration())
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


def _synthetic_points(layer_counts, resid1=3e-3, host_op_s=15e-6):
    """cp-1 micro-batch points of models with `layer_counts` layers, timed exactly by the
    step model's formula with a per-micro-batch residual `resid1`; ops per layer 150."""
    from cpkit.dynamic.step_fit import MicrobatchPoint

    kernels = CostModel(STEP_DIMS, load_calibration())
    pts = []
    for layers in layer_counts:
        base, per = 150.0 * layers, 75.0 * layers
        for lens in ([64], [1024], [4096], [8192], [2048] * 4, [32] * 4, [16] * 8):
            gpu = (kernels.group_time(lens, 1) * layers / 4
                   + layers * 3e-9 * sum(-(-L // 2) * 2 for L in lens))
            host = host_op_s * base + 5e-6 * per * len(lens)
            t = max(gpu, host) + 0.2 * min(gpu, host) + 20e-6 * 16 + resid1
            pts.append(MicrobatchPoint(1, tuple(lens), base, per * len(lens), 16.0, t, layers))
    return pts, kernels


def test_a_second_model_size_tells_the_per_op_host_cost_from_the_residual():
    from cpkit.dynamic.step_fit import fit_costs

    def fit(layer_counts):
        pts, kernels = _synthetic_points(layer_counts)
        return fit_costs(pts, lambda p: kernels.group_time(p.seq_lens, p.cp) * p.layers / 4, 4, 20e-6)

    both = fit([4, 1])  # the bench's model and the calibration's shallow one
    assert both["residual_identified"]
    assert both["host_op_s"] == pytest.approx(15e-6, rel=0.1)
    assert both["residual_s"][1] == pytest.approx(3e-3, rel=0.25)
    one = fit([4])  # one size: the residual cannot be told apart, so it is held at 0, and said so
    assert not one["residual_identified"] and one["residual_s"][1] == 0.0


def test_each_point_is_read_at_the_hosts_pace_it_was_timed_at():
    """A host that runs slower for some points (a pace probe beside each point says by how
    much) would raise the fitted host costs, and every prediction with them; read at their
    paces, the points give the constants of the median pace. Synthetic points of two model
    sizes whose host terms are timed at paces 0.8 to 1.3: with the paces the fit recovers the
    per-op cost within 10% and every point within 3%; without them it misses."""
    import random
    from dataclasses import replace

    from cpkit.dynamic.step_fit import fit_costs

    pts, kernels = _synthetic_points([4, 1])
    rng = random.Random(3)
    paced = [(p, rng.choice((0.8, 0.9, 1.0, 1.0, 1.1, 1.3))) for p in pts]

    def timed(p, pace):  # the step model's formula with the host terms at `pace`
        gpu = kernels.group_time(p.seq_lens, 1) * p.layers / 4 + p.layers * 3e-9 * p.local_tokens
        host = pace * (15e-6 * p.ops + 5e-6 * p.sample_ops)
        return max(gpu, host) + 0.2 * min(gpu, host) + 20e-6 * 16 + pace * 3e-3

    def fit(points):
        return fit_costs(points, lambda p: kernels.group_time(p.seq_lens, p.cp) * p.layers / 4, 4, 20e-6)

    read = fit([replace(p, seconds=timed(p, pace), pace=pace) for p, pace in paced])
    assert read["host_op_s"] == pytest.approx(15e-6, rel=0.1)
    assert max(abs(e) for e in read["errors"][1]) < 0.03, read["errors"]
    unread = fit([replace(p, seconds=timed(p, pace)) for p, pace in paced])  # every pace taken as 1
    assert max(abs(e) for e in unread["errors"][1]) > 0.05, unread["errors"]


def test_calibration_points_are_timed_back_to_back_and_the_call_gap_kept_apart():
    # a call costs its gap once plus each micro-batch: timing one micro-batch alone between
    # syncs (the old calibration) took the gap for a per-micro-batch cost
    from cpkit.bench.dynamic.dynamic_step_calibrate import BACK_TO_BACK, _Runner

    class Timed(_Runner):
        def __init__(self, gap, per):
            self.gap, self.per, self.calls = gap, per, []

        def fwd_bwd(self, local, total, times=1):
            self.calls.append(times)

        def _once(self, fn):
            fn()
            return self.gap + self.per * self.calls[-1]

    run = Timed(gap=12e-3, per=30e-3)
    assert run.per_microbatch("mb", 1.0, 1, 3) == pytest.approx((30e-3, 12e-3))
    assert run.calls == [1, BACK_TO_BACK] * 4  # alternating rounds: 1 warm-up + 3
    assert Timed(gap=0.0, per=1e-6).per_microbatch(None, 1.0, 1, 3)[1] == pytest.approx(0.0, abs=1e-12)


def test_the_call_gap_is_paid_once_per_forward_backward_call():
    gap = 7e-3
    packed = _step_plan([[((0, 1), (0,)), ((2,), (1,))], [((0, 1, 2, 3), (2,))]])
    assert (_step_model(call_gap_s=gap).predict(packed)["fwd_bwd_s"]
            - _step_model().predict(packed)["fwd_bwd_s"]) == pytest.approx(gap)  # one call
    unpacked = _step_plan([[((0, 1), (0, 1)), ((2,), (2,)), ((3,), (3,))],
                           [((0, 1, 2, 3), (4,))]], packed=False)
    assert (_step_model(call_gap_s=gap).predict(unpacked)["fwd_bwd_s"]
            - _step_model().predict(unpacked)["fwd_bwd_s"]) == pytest.approx(2 * gap)  # a call per segment


# ----------------------------------------------------------------------- reference plans


def _check_reference(plan: Plan, lens, needs, M):
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
    _check_reference(plan, lens, needs, M)
    # 40.6K tokens over 4 x 4K per micro-batch: at least 3; first fit needs no more than 4
    assert 3 <= len(plan.microbatches) <= 4 and plan.candidate == "fill"


def test_choose_takes_the_modeled_fastest_and_breaks_ties_by_robustness():
    """The modeled fastest plan, never a reference modeled slower than static CP; plans tied
    within the band: fewest runtime micro-batches, then fewest CP switches, then a reference
    before cpkit's own. TIE_BAND is 0: in real steps the model ordered plans within 10% of each
    other better than robustness did (candidates.TIE_BAND's measurement)."""
    from cpkit.dynamic.candidates import TIE_BAND, choose_plan, robustness
    from cpkit.testing.plans import hand_plan

    lens = [8, 8, 8, 8]
    three = hand_plan([[((0,), (0,)), ((1,), (1,))], [((0, 1), (2,))], [((0,), (3,))]], lens, 2)
    two = hand_plan([[((0,), (0, 1)), ((1,), (2,))], [((0, 1), (3,))]], lens, 2)
    two_flat = hand_plan([[((0,), (0, 1)), ((1,), (2,))], [((0,), (3,))]], lens, 2)
    assert robustness(three) == (3, 2) and robustness(two) == (2, 1) and robustness(two_flat) == (2, 0)
    assert TIE_BAND == 0.0
    times = {id(two): 1.05, id(two_flat): 1.08, id(three): 1.0}
    step_time = lambda p: times[id(p)]  # noqa: E731
    own = (1.0, "earliest-finish", three)
    assert choose_plan(own, {"mlm": two}, step_time, 2.0)[1] == "earliest-finish"  # 5% faster: it wins
    assert choose_plan((1.1, "earliest-finish", three), {"mlm": two}, step_time, 2.0)[1] == "mlm"
    # a band (a caller's hedge): within it, the most robust
    assert choose_plan(own, {"mlm": two}, step_time, 2.0, band=0.1)[1] == "mlm"  # one micro-batch fewer
    assert choose_plan(own, {"mlm": two, "fill": two_flat}, step_time, 2.0, band=0.1)[1] == "fill"  # no switch
    assert choose_plan(own, {"mlm": two}, step_time, 2.0, band=0.01)[1] == "earliest-finish"  # outside it
    # an exact tie: the reference; a reference modeled faster: taken at its time
    assert choose_plan((1.0, "earliest-finish", two), {"mlm": two}, lambda p: 1.0, 2.0)[1] == "mlm"
    assert choose_plan((1.0, "earliest-finish", two), {"mlm": two}, lambda p: 0.9, 2.0)[0] == 0.9
    # never a reference modeled slower than static CP
    assert choose_plan((1.0, "static", three), {"mlm": two}, step_time, 1.02, band=0.1)[1] == "static"


def test_the_validated_band_names_evidence_that_shows_it():
    """The band `cpkit schedule` prints is a claim: its evidence folder exists and its README
    shows the largest error."""
    import re
    from pathlib import Path

    from cpkit.dynamic import candidates

    error, where = candidates.validated_band()
    if error is None:
        pytest.skip("no GPU run of the step model recorded")
    folder = re.search(r"evidence/[^/\s]+/", where)
    assert folder, f"validated_band names no evidence folder: {where!r}"
    readme = Path(__file__).resolve().parents[1] / folder[0] / "README.md"
    assert readme.is_file(), f"{folder[0]} has no README"
    assert f"{error * 100:.1f}%" in readme.read_text()


def test_the_error_band_says_whether_gpus_validated_it(monkeypatch):
    from cpkit.dynamic import candidates

    monkeypatch.setattr(candidates, "validated_band", lambda: (None, "not validated on GPUs yet"))
    assert candidates.error_band_text() == "error band: not validated on GPUs yet"
    monkeypatch.setattr(candidates, "validated_band", lambda: (0.083, "4x H100, evidence/x"))
    assert candidates.error_band_text() == "error band +-8%, 4x H100, evidence/x"


def test_schedule_takes_a_reference_plan_that_ties_with_its_own():
    from cpkit.dynamic import schedule
    from cpkit.dynamic.scheduler import needed_cp_sizes

    lens = [7000, 5000, 3000, 2000, 1500, 900, 800, 700, 600, 500, 400, 300, 200, 100]
    M = 4096
    own = schedule(lens, dp_cp_size=4, max_seq_len_per_rank=M, tie_band=0.0)
    # the plan chosen without references, offered as one: cpkit's own candidates tie with it at
    # best, so the reference (or fill) is taken, and none is modeled slower than it
    ref = schedule(lens, dp_cp_size=4, max_seq_len_per_rank=M, reference_plans={"mlm": own})
    assert ref.candidate in ("mlm", "fill")
    assert ref.step_time_s == pytest.approx(own.step_time_s) and ref.step_time_s <= ref.static_step_time_s
    _check_reference(ref, lens, needed_cp_sizes(lens, dp_cp_size=4, max_seq_len_per_rank=M), M)


def test_a_reference_plan_that_breaks_an_invariant_is_never_taken():
    import dataclasses

    from cpkit.dynamic import schedule
    from cpkit.dynamic.scheduler import needed_cp_sizes

    lens = [7000, 5000, 3000, 2000, 1500, 900, 800, 700, 600, 500, 400, 300, 200, 100]
    at = dict(dp_cp_size=4, max_seq_len_per_rank=4096)
    own = schedule(lens, **at, tie_band=0.0)

    def relabel(plan, rank):  # the same plan on other ranks: the same modeled time
        return dataclasses.replace(plan, candidate=None, microbatches=tuple(
            Microbatch(tuple(CPGroupAssignment(tuple(rank(r) for r in g.ranks), g.samples, g.cp_size)
                             for g in mb.groups)) for mb in plan.microbatches))

    swapped, shifted = relabel(own, lambda r: r ^ 2), relabel(own, lambda r: (r + 1) % 4)  # shifted: unaligned
    assert CostModel().step_time(swapped) == CostModel().step_time(shifted) == pytest.approx(own.step_time_s)
    assert schedule(lens, **at, reference_plans={"mcore": swapped}).candidate == "mcore"
    taken = schedule(lens, **at, reference_plans={"mcore": shifted})
    assert taken.candidate != "mcore"
    _check_reference(taken, lens, needed_cp_sizes(lens, **at), 4096)
    # groups as large as their samples' needs but below min_cp_size break the plan too
    assert any(g.cp_size == 1 for mb in own.microbatches for g in mb.groups)
    at_min = schedule(lens, **at, min_cp_size=2, reference_plans={"mlm": own})
    assert at_min.candidate != "mlm" and all(g.cp_size >= 2 for mb in at_min.microbatches for g in mb.groups)


def test_a_reference_plan_of_another_batch_is_a_config_error():
    from cpkit.dynamic import schedule

    other = schedule([3000, 100], dp_cp_size=2, max_seq_len_per_rank=4096)
    with pytest.raises(CPConfigError, match=r"reference_plans\['mlm'\].*same seq_lens"):
        schedule([3000, 200], dp_cp_size=2, max_seq_len_per_rank=4096, reference_plans={"mlm": other})
