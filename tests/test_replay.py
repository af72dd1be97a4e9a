"""The replay's plan-to-work translation and step-time semantics, on CPU with an analytic timer.

The expected values are written out from the runtime's layout (cpkit.dynamic.runtime.pack_thd
pads every sample to a multiple of 2c; rank r keeps chunks r and 2c-1-r; the p2p ring's forward
step s uses the KV of rank (r - s) mod c), not computed with the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpkit.bench.dynamic.replay_timing import AnalyticTimer, LinkTable, pass_time
from cpkit.bench.dynamic.replay_work import AttnCall, padded, plan_work, rank_work
from cpkit.dynamic.cost import CostModel, load_calibration
from cpkit.dynamic.step_rules import step_end
from cpkit.errors import CPConfigError
from cpkit.testing.plans import hand_plan

NO_LINK = LinkTable("none", 0.0, float("inf"), "test")


def test_padding_matches_the_runtime():
    assert [padded(L, 1) for L in (1, 2, 3)] == [2, 2, 4]
    assert [padded(L, 4) for L in (1, 8, 9, 17)] == [8, 8, 16, 24]


def test_rank_work_of_a_ring_of_four():
    # samples 10 and 17 at cp 4: padded to 16 and 24, chunks of 2 and 3 tokens; 10 local tokens
    w = rank_work((10, 17), 4, 2)
    assert w.tokens == 10
    assert [c.kind for c in w.forward] == ["diag", "kv_first", "kv_first", "q_second"]
    assert [c.kind for c in w.backward] == ["q_second", "kv_first", "kv_first", "diag"]  # ends on its own
    assert all(c.chunks == (2, 3) for c in w.forward + w.backward)
    assert AttnCall("kv_first", (2, 3)).q_lens == (4, 6)
    assert AttnCall("kv_first", (2, 3)).k_lens == (2, 3)
    assert AttnCall("q_second", (2, 3)).q_lens == (2, 3)
    assert AttnCall("q_second", (2, 3)).k_lens == (4, 6)
    first = rank_work((10, 17), 4, 0)
    assert [c.kind for c in first.forward] == ["diag", "q_second", "q_second", "q_second"]


def test_cp1_is_one_causal_call_over_whole_samples():
    w = rank_work((5, 8), 1, 0)
    assert w.tokens == 14
    assert w.forward == (AttnCall("diag", (3, 4)),)
    assert AttnCall("diag", (3, 4)).q_lens == (6, 8)


def test_plan_work_packed_and_unpacked():
    plan = hand_plan([[((0, 1), (0, 1)), ((2,), (2,))]], (8, 4, 6), dp_cp_size=4,
                     max_seq_len_per_rank=16)
    (groups,) = plan_work(plan)
    assert [len(g) for g in groups] == [1, 1]
    assert groups[0][0].ranks == (0, 1) and groups[0][0].tokens == 6  # (8 + 4) / 2
    assert groups[1][0].tokens == 6
    import dataclasses

    (groups,) = plan_work(dataclasses.replace(plan, packed=False))
    assert [p.samples for p in groups[0]] == [(0,), (1,)]
    assert [p.tokens for p in groups[0]] == [4, 2]


def test_free_rule_waits_for_the_last_member():
    # rank 0 busy 3 s, rank 1 busy 1 s; then a group of both takes 2 s: it starts at 3
    times = [[((0,), 3.0), ((1,), 1.0)], [((0, 1), 2.0)], [((1,), 1.0)]]
    assert step_end(times, 2, "free") == pytest.approx(6.0)
    assert step_end(times, 2, "lockstep") == pytest.approx(3.0 + 2.0 + 1.0)


def test_free_rule_lets_independent_ranks_run_ahead():
    times = [[((0,), 3.0), ((1,), 1.0)], [((0,), 1.0), ((1,), 3.0)]]
    assert step_end(times, 2, "free") == pytest.approx(4.0)
    assert step_end(times, 2, "lockstep") == pytest.approx(6.0)


def test_pipeline_rule_fills_and_drains_once():
    times = [[((0,), 4.0)], [((0,), 2.0)], [((0,), 2.0)]]
    # 4 stages of a quarter of the layers: (4 + 2 + 2 + 3 * 4) / 4
    assert step_end(times, 1, "free", pp_size=4) == pytest.approx(5.0)


def test_step_rule_errors_name_the_field():
    with pytest.raises(CPConfigError, match="rule"):
        step_end([], 1, "eager")
    with pytest.raises(CPConfigError, match="pp_size"):
        step_end([], 1, "free", pp_size=0)


def test_pass_time_exposes_only_the_unhidden_transfer():
    timer = AnalyticTimer(launch_s=0.0)
    plan = hand_plan([[((0, 1), (0,))]], (4096,), dp_cp_size=2,
                     max_seq_len_per_rank=4096)
    ((p,),), = plan_work(plan)
    hidden = pass_time(p, timer, NO_LINK, num_layers=2, kv_bytes_per_token=4096)
    assert hidden.comm_s == 0.0
    # the rank's steps: a causal 2048 x 2048 diagonal and a 2048 x 1024 (or 1024 x 2048) block
    fwd = timer.call(AttnCall("diag", (1024,)))[0] + timer.call(AttnCall("kv_first", (1024,)))[0]
    bwd = timer.call(AttnCall("diag", (1024,)))[1] + timer.call(AttnCall("kv_first", (1024,)))[1]
    assert hidden.compute_s == pytest.approx(2 * (timer.layers(2048) + fwd + bwd))
    slow = LinkTable("slow", 1.0, float("inf"), "test")  # 1 s per transfer: nothing hides it
    exposed = pass_time(p, timer, slow, num_layers=2, kv_bytes_per_token=4096)
    off_f, off_b = timer.call(AttnCall("kv_first", (1024,)))
    diag_f, diag_b = timer.call(AttnCall("diag", (1024,)))
    # forward: one exchange behind the diagonal; backward: two (KV at step 0, dKV at step 1)
    expected = (1.0 - diag_f) + (1.0 - off_b) + (1.0 - diag_b)
    assert exposed.comm_s == pytest.approx(2 * expected)


def test_replay_of_a_plan_under_both_rules():
    from cpkit.bench.dynamic.replay import TINY_DIMS, replay_plan

    timer = AnalyticTimer(linear_flops_per_token=TINY_DIMS.linear_flops_per_token, heads=4,
                          head_dim=16, launch_s=0.0)
    plan = hand_plan([[((0,), (0,)), ((1,), (1,))], [((0, 1), (2,))]],
                     (64, 16, 64), dp_cp_size=2, max_seq_len_per_rank=64)
    free = replay_plan(plan, timer, NO_LINK, TINY_DIMS, "free", 1)
    lock = replay_plan(plan, timer, NO_LINK, TINY_DIMS, "lockstep", 1)
    assert free["comm_s"] == 0.0 and free["step_s"] == pytest.approx(lock["step_s"])
    assert free["busy_s"] > free["step_s"]  # two ranks busy at once


def test_schedule_rejects_an_unknown_step_rule():
    from cpkit.dynamic import schedule

    with pytest.raises(CPConfigError, match="rule"):
        schedule([100, 200], dp_cp_size=2, max_seq_len_per_rank=256, step_rule="eager")


def test_model_step_time_uses_the_shared_rule():
    model = CostModel(calibration=load_calibration())
    plan = hand_plan([[((0,), (0,)), ((1,), (1,))], [((0,), (2,))]],
                     (4000, 100, 100), dp_cp_size=2, max_seq_len_per_rank=4096)
    t = [model.group_time([L], 1) for L in (4000, 100, 100)]
    assert model.step_time(plan) == pytest.approx(t[0] + t[2])
    assert model.step_time(plan, "lockstep") == pytest.approx(max(t[0], t[1]) + t[2])


def test_a_model_calibrated_from_the_replay_predicts_it():
    """The calibration the replay writes (cpkit.bench.dynamic.replay_calibration) makes the cost model
    predict the replay of the same timer: here an analytic one, so the check runs on CPU."""
    from cpkit.bench.dynamic.replay import REPLAY_DIMS, replay_plan
    from cpkit.bench.dynamic.replay_calibration import calibration_from_timer
    from cpkit.bench.dynamic.replay_timing import LINKS
    from cpkit.dynamic import schedule
    from cpkit.dynamic.cost import Calibration

    timer = AnalyticTimer(linear_flops_per_token=REPLAY_DIMS.linear_flops_per_token)
    data = calibration_from_timer(timer, REPLAY_DIMS, LINKS["nvlink"], device="analytic",
                                  origin="test")
    model = CostModel(dims=REPLAY_DIMS, calibration=Calibration.from_dict(data))
    lens = [300, 900, 2048, 5000, 7000, 12000, 30000, 1500, 800, 4096, 64, 9000]
    for rule in ("free", "lockstep"):
        plan = schedule(lens, dp_cp_size=8, max_seq_len_per_rank=8192, cost_model=model,
                        step_rule=rule)
        replayed = replay_plan(plan, timer, LINKS["nvlink"], REPLAY_DIMS, rule, 1)["step_s"]
        assert model.step_time(plan, rule) == pytest.approx(replayed, rel=0.05)


def test_replay_check_line_says_whether_the_model_was_held_to_a_replay():
    from cpkit.dynamic.cost import replay_check_line

    assert replay_check_line(load_calibration()).startswith("modeled only")
    replayed = load_calibration(str(Path(__file__).resolve().parents[1]
                                    / "src/cpkit/dynamic/calibration_h100_replay.json"))
    line = replay_check_line(replayed)
    assert "H100" in line and "2.8% median" in line and "9.3% at most" in line


def test_replay_cli_runs_a_file_of_batches_on_cpu(tmp_path, capsys):
    """The whole command on CPU at tiny shapes (a smoke run: CPU kernels, not a measurement)."""
    import json

    from cpkit.bench.dynamic import replay
    from cpkit.dynamic.cost import shipped_calibration_path

    lens = tmp_path / "batches.txt"
    lens.write_text("# two global batches\n100, 20, 7, 64\n30 30 30 5\n")
    out = tmp_path / "replay.json"
    assert replay.main(["--device", "cpu", "--tiny", "--seq-lens-file", str(lens),
                        "--dp-cp-size", "2", "--max-seq-len-per-rank", "64", "--iters", "1",
                        "--calibration", str(shipped_calibration_path()), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["results"]] == ["batches.txt #0", "batches.txt #1"]
    for r in data["results"]:
        assert {"cpkit", "static"} <= set(r["impl"])
        assert r["ratios"]["static/cpkit"] > 0 and r["area_bound_s"] > 0
    assert "static/cpkit" in capsys.readouterr().out


@pytest.mark.parametrize("text, says", [(None, "cannot be read"), ("1 2 x\n", "non-integer"),
                                        ("\n# nothing\n", "no batch")])
def test_a_bad_seq_lens_file_is_a_clear_error(tmp_path, text, says):
    from cpkit.bench.dynamic.replay_plans import read_seq_lens_file

    path = tmp_path / "lens.txt"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CPConfigError, match=says):
        read_seq_lens_file(str(path), 2, 64)


def test_replay_reports_every_bad_option_at_once():
    from cpkit.bench.dynamic import replay

    with pytest.raises(CPConfigError) as err:
        replay.main(["--device", "cpu", "--pp", "0", "--iters", "0", "--sets", "mix,short"])
    assert {v.field for v in err.value.violations} == {"--pp", "--iters", "--sets"}
