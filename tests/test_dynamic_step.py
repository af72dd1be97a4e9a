"""The real-step bench's pure parts (cpkit.bench.dynamic.dynamic_step, dynamic_step_rank, link): how a
plan is run (MCore's one sample at a time, lockstep), which plans the registry can run, the
summary's ratios and targets, the link table's fit, and every bad option reported at once."""

from __future__ import annotations

import json

import pytest

from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.errors import CPConfigError


def _plan(mbs, packed=True, n=4):
    lens = tuple(range(10, 10 + 1 + max(s for mb in mbs for g in mb for s in g[1])))
    return Plan(microbatches=tuple(Microbatch(tuple(CPGroupAssignment(tuple(r), tuple(s), len(r))
                                                    for r, s in mb)) for mb in mbs),
                seq_lens=lens, dp_cp_size=n, max_seq_len_per_rank=64,
                workloads=tuple(float(L) for L in lens), needed_cp_sizes=(1,) * len(lens), packed=packed)


def test_a_packed_plan_runs_as_it_is_free():
    from cpkit.bench.dynamic.dynamic_step_rank import run_order

    plan = _plan([[((0, 1), (0, 1)), ((2,), (2,)), ((3,), (3,))], [((0, 1, 2, 3), (4,))]])
    ran, segments, lockstep = run_order(plan)
    assert ran is plan and segments == [[0, 1]] and not lockstep


def test_an_unpacked_plan_runs_one_sample_at_a_time_in_lockstep():
    from cpkit.bench.dynamic.dynamic_step_rank import run_order

    plan = _plan([[((0, 1), (0, 1, 5)), ((2,), (2,)), ((3,), ())], [((0, 1, 2, 3), (4,))]], packed=False)
    ran, segments, lockstep = run_order(plan)
    assert lockstep and ran.packed and segments == [[0, 1, 2], [3]]
    got = [[(g.ranks, g.samples) for g in mb.groups] for mb in ran.microbatches]
    assert got == [[((0, 1), (0,)), ((2,), (2,))], [((0, 1), (1,))], [((0, 1), (5,))],
                   [((0, 1, 2, 3), (4,))]]
    # every sample of every group still runs exactly once, on its group
    assert sorted(s for mb in ran.microbatches for s in mb.samples) == [0, 1, 2, 4, 5]


def test_only_aligned_registry_blocks_are_runnable():
    from cpkit.bench.dynamic.dynamic_step_rank import unrunnable

    assert unrunnable(_plan([[((0, 1), (0,)), ((2, 3), (1,))]]), (1, 2, 4)) is None
    assert "aligned block" in unrunnable(_plan([[((1, 2), (0,))]]), (1, 2, 4))
    assert "aligned block" in unrunnable(_plan([[((0, 1, 2), (0,))]]), (1, 2, 4))
    assert "aligned block" in unrunnable(_plan([[((0, 1, 2, 3), (0,))]]), (1, 2))


def _result(label, impl, tokens=1000):
    return {"label": label, "tokens": tokens, "impl": impl}


def _impl(step, fb, pred_step, pred_fb, loss=2.0, **extra):
    return {"step_s": [step, step * 1.1, step * 0.9], "fwd_bwd_s": [fb] * 3, "prep_s": [0.0] * 3,
            "reduce_opt_s": [0.0] * 3, "predicted_step_s": pred_step, "predicted_fwd_bwd_s": pred_fb,
            "kernels_only_s": pred_fb / 2, "loss": loss, "cp_sizes": [1], "microbatches": 1,
            "plan": {"mean_token_fill": 0.8}, "per_rank": {"fwd_bwd_s": [fb, fb * 0.9]}, **extra}


def test_summary_errors_ratios_order_and_targets():
    from cpkit.bench.dynamic.dynamic_step_report import summarize, table, targets

    results = [_result("lognormal a", {"cpkit": _impl(1.0, 0.9, 1.05, 0.95), "static": _impl(1.5, 1.4, 1.4, 1.3),
                                       "mcore": {"error": "crash: x"}, "mlm": _impl(1.02, 0.9, 1.2, 1.0)}),
               _result("b", {"cpkit": _impl(2.0, 1.8, 1.8, 1.5), "static": _impl(1.8, 1.7, 1.9, 1.7, 2.2)})]
    s = summarize(results)
    assert results[0]["impl"]["cpkit"]["tokens_per_s"] == pytest.approx(1000.0)
    assert results[0]["impl"]["cpkit"]["step_error"] == pytest.approx(0.05)
    assert results[1]["impl"]["cpkit"]["fwd_bwd_error"] == pytest.approx(1.5 / 1.8 - 1)
    assert s["ratios"]["static/cpkit"] == {"median": pytest.approx((1.5 + 0.9) / 2), "min": pytest.approx(0.9),
                                           "max": pytest.approx(1.5)}
    assert s["max_abs_error"]["fwd_bwd"] == pytest.approx(1 - 1.5 / 1.8)
    assert results[1]["loss_spread"] == pytest.approx(0.2 / 2.1)
    # b: static is 10% faster for real but predicted slower; a: cpkit vs mlm differ by 2% only
    assert len(s["order_problems"]) == 1 and s["order_problems"][0].startswith("b: real cpkit")
    ok = {k.split(" (")[0]: v for k, v in targets(results, s).items()}
    assert ok["lognormal a cpkit: predicted within 10%"] is True
    assert ok["b cpkit: predicted within 10%"] is False
    assert ok["lognormal a mlm: predicted within 10%"] is False
    assert ok["predicted order of plan families = real order where they differ by > 5%"] is False
    assert ok["lognormal a: real step cpkit <= best of MCore / Megatron-LM, a tie within 0.5% counts"] is True
    assert ok["lognormal a: real step static / cpkit >= 1.2"] is True
    assert "b: real step static / cpkit >= 1.2" not in ok  # lognormal batches only
    run = {"skipped": ["c"], "calibrated_here": True, "phases": {"calibration_s": 61.0}}
    ok = {k.split(" (")[0]: v for k, v in targets(results, s, run).items()}
    assert ok["every batch ran within --budget-s"] is False
    assert ok["calibration from micro-benchmarks within 60 s"] is False
    text = table(results)
    assert "lognormal a mcore: crash: x" in text and "pred step" in text and "900/810" in text


def test_a_batch_whose_plans_all_miss_alike_has_a_common_error_and_small_errors_within_it():
    """Every plan predicted 20% slow (the host ran faster than at calibration): common error
    +20%, within the batch 0; a family that runs another's plan does not count twice; a plan
    that misses on its own keeps its miss within the batch."""
    from cpkit.bench.dynamic.dynamic_step_report import summarize

    results = [_result("a", {"cpkit": _impl(1.0, 0.9, 1.2, 1.08), "static": _impl(1.5, 1.4, 1.8, 1.68),
                             "mlm": _impl(1.0, 0.9, 1.2, 1.08, same_plan_as="cpkit"),
                             "mcore": _impl(2.0, 1.8, 2.4, 2.16)}),
               _result("b", {"cpkit": _impl(1.0, 0.9, 1.0, 0.9), "static": _impl(1.0, 0.9, 1.0, 0.9),
                             "mcore": _impl(1.0, 0.9, 1.3, 1.17)})]
    s = summarize(results)
    assert results[0]["common_error"] == pytest.approx(0.2)
    assert set(results[0]["within_batch_errors"]) == {"cpkit", "static", "mcore"}
    assert all(e == pytest.approx(0.0) for e in results[0]["within_batch_errors"].values())
    assert results[1]["common_error"] == pytest.approx(0.0)
    assert results[1]["within_batch_errors"]["mcore"] == pytest.approx(0.3)
    assert s["max_abs_within_batch_error"] == pytest.approx(0.3)
    assert s["max_abs_error"]["step"] == pytest.approx(0.3)  # the target still reads the raw error


def test_the_error_target_reads_the_model_at_the_batchs_host_pace_and_shows_the_raw_error():
    """Predicted 20% slow at the calibration's pace, right at the pace the probe measured in the
    batch (0.8: the host ran faster): the target passes on the paced error and names both."""
    from cpkit.bench.dynamic.dynamic_step_report import summarize, table, targets

    paced = _impl(1.0, 0.9, 1.2, 1.08, predicted_step_at_pace_s=1.0, predicted_fwd_bwd_at_pace_s=0.92)
    results = [{**_result("a", {"cpkit": paced, "static": _impl(1.5, 1.4, 1.8, 1.68)}), "host_pace": {"pace": 0.8}}]
    s = summarize(results)
    assert paced["step_error"] == pytest.approx(0.2) and paced["step_error_at_pace"] == pytest.approx(0.0)
    assert s["max_abs_error"]["step"] == pytest.approx(0.2)
    assert s["max_abs_error"]["step_at_pace"] == pytest.approx(0.0)
    assert s["max_abs_error"]["fwd_bwd_at_pace"] == pytest.approx(0.92 / 0.9 - 1)
    checks = targets(results, s)
    (cpkit,) = [k for k in checks if k.startswith("a cpkit")]
    assert checks[cpkit] and "host pace 0.800" in cpkit and "at the calibration's pace +20.0%" in cpkit
    (static,) = [k for k in checks if k.startswith("a static")]  # no paced prediction: the raw error
    assert not checks[static] and "pace" not in static
    assert "err@pace" in table(results) and "0.800" in table(results)


def test_the_host_pace_is_the_batchs_probe_over_the_calibrations():
    from cpkit.bench.dynamic.dynamic_step_rank import host_pace

    cal = {"step": {"source": {"pace_s": 0.2}}}
    assert host_pace([0.22, 0.3, 0.24], cal)["pace"] == pytest.approx(1.2)
    assert host_pace([0.22], {"step": {"source": {}}})["pace"] is None  # a calibration from before the probe
    assert host_pace([], cal)["pace"] is None


def test_costs_at_a_pace_scale_the_hosts_terms_only():
    from cpkit.dynamic.step_model import OpCounts, StepCosts

    costs = StepCosts(ops=OpCounts({1: (100.0, 10.0, 1.0, 0.0)}), host_op_s=1e-5, sync_s=2e-5, mem_s_per_token=3e-7,
                      sample_op_s=4e-6, residual_s={1: 1e-3, 2: 2e-3}, idle_s=5e-3, prep_mb_s=1e-4,
                      prep_sample_s=2e-5, reduce_opt_s=1e-2, call_gap_s=2e-3, overlap_loss=0.3)
    slow = costs.at_pace(1.5)
    for name in ("host_op_s", "sample_op_s", "idle_s", "prep_mb_s", "prep_sample_s", "call_gap_s"):
        assert getattr(slow, name) == pytest.approx(1.5 * getattr(costs, name)), name
    assert slow.residual_s == pytest.approx({1: 1.5e-3, 2: 3e-3})
    for name in ("sync_s", "mem_s_per_token", "reduce_opt_s", "overlap_loss", "ops"):
        assert getattr(slow, name) == getattr(costs, name), name
    assert costs.at_pace(1.0) == costs
    with pytest.raises(ValueError, match="pace=0"):
        costs.at_pace(0)


def test_cpkit_within_half_a_percent_of_the_best_other_plan_is_a_tie_and_beyond_it_is_slower():
    from cpkit.bench.dynamic.dynamic_step_report import summarize, targets

    def met(mlm_step):
        results = [_result("x", {"cpkit": _impl(1.0, 0.9, 1.0, 0.9), "mlm": _impl(mlm_step, 0.9, mlm_step, 0.9)})]
        (check,) = [v for k, v in targets(results, summarize(results)).items() if "best of MCore" in k]
        return check

    assert met(0.996) and met(1.0) and not met(0.99)


def test_a_family_running_anothers_plan_is_not_an_order_problem():
    from cpkit.bench.dynamic.dynamic_step_report import order_problems, summarize

    r = _result("x", {"cpkit": _impl(1.0, 0.9, 1.0, 0.9), "mlm": _impl(1.2, 0.9, 0.9, 0.9, same_plan_as="cpkit")})
    summarize([r])
    assert order_problems(r) == []


def test_the_recorded_commit_is_cpkits_not_the_current_directorys(tmp_path, monkeypatch):
    import subprocess

    from cpkit.bench.dynamic.dynamic_step_report import cpkit_commit, cpkit_source

    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    monkeypatch.chdir(other)
    theirs = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("CPKIT_COMMIT", raising=False)
    got = cpkit_source()
    assert got["commit"] != theirs and len(got["fingerprint"]) == 12
    assert cpkit_commit().startswith(got["commit"] or "content-")
    monkeypatch.setenv("CPKIT_COMMIT", "abc1234")  # a copy on a GPU host: the sender names it
    named = cpkit_source()
    assert named["commit"] == "abc1234" and named["fingerprint"] == got["fingerprint"]


def test_the_plan_record_names_every_group_with_its_lengths():
    from cpkit.bench.dynamic.dynamic_step_predict import plan_key, plan_record

    plan = _plan([[((0, 1), (0, 1)), ((2,), (2,))]])
    rec = plan_record(plan)
    assert rec["microbatches"] == [[{"ranks": [0, 1], "cp": 2, "samples": [0, 1], "lengths": [10, 11]},
                                    {"ranks": [2], "cp": 1, "samples": [2], "lengths": [12]}]]
    assert rec["packed"] is True and 0 < rec["mean_token_fill"] <= 1
    assert plan_key(plan) == plan_key(_plan([[((0, 1), (0, 1)), ((2,), (2,))]]))
    assert plan_key(plan) != plan_key(_plan([[((0, 1), (0, 1)), ((2,), (2,))]], packed=False))


def test_link_table_fits_the_rings_default_modes(tmp_path):
    from cpkit.bench.dynamic.link import format_link, link_table_data, update_calibration
    from cpkit.bench.dynamic.replay_timing import link_table
    from cpkit.dynamic.cost import load_calibration, shipped_calibration_path

    def line(lat, bw):
        return [[b, lat + b / bw] for b in (1 << 16, 1 << 20, 1 << 24)]

    meas = {"cp2_batched": line(10e-6, 100e9), "cp2_unbatched": line(50e-6, 1e9),
            "cp4_batched": line(50e-6, 1e9), "cp4_unbatched": line(10e-6, 100e9)}
    table = link_table_data(meas, device="test", origin="unit test")
    assert table["latency_s"] == pytest.approx(10e-6) and table["bandwidth_GBps"] == pytest.approx(100.0)
    assert table["fits"]["cp2_unbatched"]["bandwidth_GBps"] == pytest.approx(1.0)
    assert "cp2_batched and cp4_unbatched" in table["what"] and "10.0 us" in format_link(table)
    path = tmp_path / "link.json"
    path.write_text(json.dumps(table))
    read = link_table(str(path))  # what the replay reads
    assert read.latency_s == pytest.approx(10e-6) and read.bandwidth == pytest.approx(100e9)
    cal = tmp_path / "cal.json"
    cal.write_text(shipped_calibration_path().read_text())
    update_calibration(str(cal), table)  # what the cost model reads
    assert load_calibration(str(cal)).link_fit() == (pytest.approx(10e-6), pytest.approx(100e9))


def test_dynamic_step_reports_every_bad_option_at_once():
    from cpkit.bench.dynamic import dynamic_step

    with pytest.raises(CPConfigError) as err:
        dynamic_step.main(["--device", "cpu", "--ranks", "3", "--iters", "0", "--sets", "mix,short",
                           "--families", "cpkit,te", "--link", "/nonexistent.json", "--budget-s", "0"])
    assert {v.field for v in err.value.violations} == {"--ranks", "--iters", "--sets", "--families",
                                                       "--link", "--budget-s"}


def test_link_reports_every_bad_option_at_once():
    from cpkit.bench.dynamic import link

    with pytest.raises(CPConfigError) as err:
        link.main(["--device", "cpu", "--ranks", "1", "--iters", "0", "--calibration", "/nonexistent"])
    assert {v.field for v in err.value.violations} == {"--ranks", "--iters", "--calibration"}


def test_link_from_a_measured_table_updates_a_calibration(tmp_path):
    from cpkit.bench.dynamic import link
    from cpkit.dynamic.cost import load_calibration, shipped_calibration_path

    table = link.link_table_data({"cp2_batched": [[1 << 20, 30e-6], [1 << 24, 130e-6]]}, device="t",
                                 origin="unit test")
    src, cal = tmp_path / "link.json", tmp_path / "cal.json"
    src.write_text(json.dumps(table))
    cal.write_text(shipped_calibration_path().read_text())
    assert link.main(["--from", str(src), "--calibration", str(cal)]) == 0
    assert load_calibration(str(cal)).link == tuple(map(tuple, table["points"]))
    with pytest.raises(CPConfigError, match="--from"):
        link.main(["--from", str(src)])


def test_rope_fusion_needs_transformer_engine():
    """Why the bench model keeps MCore's per-sequence THD RoPE loop (its host ops per packed sample
    are counted instead): MCore's fused RoPE is Transformer Engine's, and without TE MCore refuses
    apply_rope_fusion=True when the config is built."""
    pytest.importorskip("megatron.core")
    from cpkit.attention.te import te_version

    if te_version() is not None:
        pytest.skip("Transformer Engine is installed: the fused path exists here")
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True,
                          use_cpu_initialization=True)


def test_the_calibration_cache_is_per_gpu_ranks_versions_and_model(tmp_path):
    import re

    from cpkit.bench.dynamic.dynamic_step_calibrate import cache_path
    from cpkit.bench.dynamic.replay import REPLAY_DIMS, TINY_DIMS

    a = cache_path(str(tmp_path), "NVIDIA H100 80GB HBM3", 4, REPLAY_DIMS, 1024)
    assert a.parent == tmp_path and a.suffix == ".json" and re.fullmatch(r"[A-Za-z0-9.+_-]+", a.stem)
    assert "H100" in a.name and "4r" in a.name and "torch" in a.name and "mcore" in a.name
    others = {cache_path(str(tmp_path), "NVIDIA H200", 4, REPLAY_DIMS, 1024),
              cache_path(str(tmp_path), "NVIDIA H100 80GB HBM3", 2, REPLAY_DIMS, 1024),
              cache_path(str(tmp_path), "NVIDIA H100 80GB HBM3", 4, TINY_DIMS, 1024),
              cache_path(str(tmp_path), "NVIDIA H100 80GB HBM3", 4, REPLAY_DIMS, 128)}
    assert a not in others and len(others) == 4
    assert cache_path(str(tmp_path), "NVIDIA H100 80GB HBM3", 4, REPLAY_DIMS, 1024) == a


def test_the_micro_benchmarks_span_host_bound_to_gpu_bound_at_every_cp_size():
    from cpkit.bench.dynamic.dynamic_step_calibrate import _grid

    grid = _grid([1, 2, 4], longest=20000, quick=False)
    assert {cp for cp, _ in grid} == {1, 2, 4}
    for cp in (1, 2, 4):
        local = sorted(sum(-(-L // cp) for L in lens) for c, lens in grid if c == cp)
        assert local[0] <= 64 * 4 and local[-1] >= 4096  # tiny (host-bound) to the batches' scale
        assert any(len(lens) >= 4 for c, lens in grid if c == cp)  # the per-sample host cost
    assert max(L for _, lens in grid for L in lens) <= 20000  # never longer than the model takes


def test_the_model_shape_options_report_every_broken_constraint_with_a_fix_that_passes():
    from cpkit.bench.dynamic import dynamic_step

    def shape_problems(argv):
        return dynamic_step._shape_violations(dynamic_step._shape(dynamic_step._parser().parse_args(argv)))

    with pytest.raises(CPConfigError) as err:
        dynamic_step.main(["--device", "cpu", "--ffn", "0", "--layers", "0", "--iters", "0"])
    assert {v.field for v in err.value.violations} == {"--ffn", "--layers", "--iters"}
    for argv, fields in ((["--hidden", "2050", "--heads", "16", "--kv-heads", "3"], {"--hidden", "--kv-heads"}),
                         (["--hidden", "2040", "--heads", "8"], {"--heads"}),  # head dim 255: odd
                         (["--heads", "32", "--kv-heads", "64"], {"--kv-heads"}),
                         (["--quick", "--heads", "3"], {"--hidden", "--kv-heads"})):  # tiny: 64 wide, 2 KV
        bad = shape_problems(argv)
        assert {v.field for v in bad} == fields, (argv, bad)
        assert all(str(v.value) in v.message and v.fix.startswith("pass --hidden") for v in bad)
        for v in bad:  # each fix passes every check
            assert shape_problems(argv + v.fix.split()[1:]) == [], v.fix
    assert shape_problems(["--hidden", "2048", "--ffn", "7168", "--heads", "16", "--kv-heads", "4",
                           "--layers", "8"]) == []


def test_a_second_model_shape_reaches_the_ranks_and_its_own_calibration():
    import dataclasses

    from cpkit.bench.dynamic import dynamic_step
    from cpkit.bench.dynamic.dynamic_step_calibrate import cache_path
    from cpkit.bench.dynamic.replay import REPLAY_DIMS, TINY_DIMS

    def dims(argv):
        return dynamic_step._spec(dynamic_step._parser().parse_args(argv))[0].dims

    small = dims(["--hidden", "2048", "--ffn", "7168", "--heads", "16", "--kv-heads", "4", "--layers", "8"])
    assert (small.hidden_size, small.ffn_hidden_size, small.num_heads, small.num_kv_heads, small.head_dim,
            small.num_layers, small.gated_linear_unit) == (2048, 7168, 16, 4, 128, 8, True)
    assert dims([]) == dataclasses.replace(REPLAY_DIMS, num_layers=4)  # the defaults as before
    assert dims(["--quick"]) == TINY_DIMS and dims(["--quick", "--layers", "3"]).num_layers == 3
    # the calibration cache is per shape: the smaller model never reads the default's
    assert cache_path("c", "H100", 4, small, 1024) != cache_path("c", "H100", 4, dims([]), 1024)


def test_the_plans_of_a_batch_are_timed_in_interleaved_rounds(world1, monkeypatch):
    """Each round steps every plan once, so slow drift of the host lands on every plan alike;
    warm-up rounds are not timed, and each plan keeps its own times, loss and order."""
    import types

    import torch

    from cpkit.bench.dynamic import dynamic_step_rank

    calls = []

    def fake_step(model, opt, order, registry, pgc, group, samples, device, recorder=None):
        calls.append(order[0].fam)
        return [float(len(calls))] * 4, {"a": 1.0, "b": 2.0}[order[0].fam]

    orders = {fam: (types.SimpleNamespace(fam=fam, microbatches=[0] * n), [[0]], fam == "b")
              for fam, n in (("a", 2), ("b", 3))}
    monkeypatch.setattr(dynamic_step_rank, "run_order", orders.__getitem__)
    monkeypatch.setattr(dynamic_step_rank, "_timeline_step", lambda *a: {"per_rank": []})
    spec = types.SimpleNamespace(warmup=1, iters=2)
    def pace():
        calls.append("pace")
        return 0.1 * len(calls)

    out, paces = dynamic_step_rank._time_plans(None, None, {"a": "a", "b": "b"}, spec, None, None, None,
                                               None, torch.device("cpu"), step=fake_step, pace=pace)
    # a warm-up round, then two timed rounds, each opened by the pace probe (kept for timed rounds)
    assert calls == ["pace", "a", "b"] * 3 and paces == pytest.approx([0.4, 0.7])
    assert out["a"]["step_s"] == [5.0, 8.0] and out["b"]["step_s"] == [6.0, 9.0]
    assert out["a"]["per_rank"]["step_s"] == [6.5] and out["b"]["per_rank"]["step_s"] == [7.5]
    assert (out["a"]["loss"], out["b"]["loss"]) == (1.0, 2.0)
    assert (out["a"]["runtime_microbatches"], out["b"]["runtime_microbatches"]) == (2, 3)
    assert not out["a"]["lockstep"] and out["b"]["lockstep"]
