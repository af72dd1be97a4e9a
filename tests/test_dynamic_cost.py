"""Unit tests of the step-time cost model (cpkit.dynamic.cost) and its calibration files."""

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
    from cpkit.bench.calibrate import main

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
