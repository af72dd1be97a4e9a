"""The eval-CP planner: work accounting, the calibrated speedup model and `cpkit plan eval-cp`."""

from __future__ import annotations

import json

import pytest

from cpkit.cli import main as cli_main
from cpkit.errors import CPConfigError
from cpkit.eval_cp.plan import REFERENCE_POINTS, micro_batches_per_rank, plan_eval_cp

CALIBRATION_BAND = 0.05
"""The estimate reproduces each reference measurement within 5% (the documented band)."""


def test_the_issue_example_8192_gpus():
    plan = plan_eval_cp(world_size=8192, tp=2, pp=4, cp_train=1, cp_eval=4, eval_samples=1024,
                        micro_batch_size=1, seq_length=8192)
    t, e = plan.train, plan.eval
    assert (t.dp, t.micro_batches_per_rank, t.sample_steps, t.redundancy) == (1024, 4, 4096, 4.0)
    assert (e.dp, e.micro_batches_per_rank, e.sample_steps, e.redundancy) == (256, 4, 1024, 1.0)
    assert e.activation_memory_ratio == 0.25 and t.activation_memory_ratio == 1.0
    assert plan.speedup_estimate > 1.5
    assert plan.warnings == []


@pytest.mark.parametrize("point", REFERENCE_POINTS, ids=lambda p: f"tp{p['tp']}-pp{p['pp']}-{p['seq_length']}")
def test_estimate_is_within_the_band_of_each_reference_measurement(point):
    """World 8, CP 1 -> 2, micro-batch 1, the eval pipeline filled once (samples = dp_eval * pp)."""
    dp_eval = 8 // (point["tp"] * point["pp"] * 2)
    plan = plan_eval_cp(world_size=8, tp=point["tp"], pp=point["pp"], cp_train=1, cp_eval=2,
                        eval_samples=dp_eval * point["pp"], micro_batch_size=1,
                        seq_length=point["seq_length"])
    assert plan.train.redundancy == 2.0 and plan.eval.redundancy == 1.0
    assert abs(plan.speedup_estimate / point["measured"] - 1) <= CALIBRATION_BAND, plan.speedup_estimate


def test_short_sequence_at_pp1_is_flagged_and_long_sequences_with_pp_are_not():
    short = plan_eval_cp(world_size=8, cp_eval=2, eval_samples=4, seq_length=1024)
    assert short.speedup_estimate < 1
    assert any(w.startswith("short-sequence-pp1") for w in short.warnings)
    long_pp = plan_eval_cp(world_size=8, pp=4, cp_eval=2, eval_samples=4, seq_length=16384)
    assert long_pp.speedup_estimate > 1.5
    assert not any(w.startswith(("short-sequence-pp1", "slower")) for w in long_pp.warnings)


def test_many_samples_at_pp1_leave_no_redundancy_to_remove():
    # 4096 samples on dp 8: nothing is redundant, eval CP only adds communication.
    plan = plan_eval_cp(world_size=8, cp_eval=2, eval_samples=4096, seq_length=8192)
    assert plan.train.redundancy == 1.0 and plan.eval.micro_batches_per_rank == 1024
    assert plan.speedup_estimate < 1


def test_lower_eval_cp_warns_about_activation_memory_and_uneven_shards():
    plan = plan_eval_cp(world_size=8, cp_train=4, cp_eval=2, eval_samples=7, seq_length=4096)
    assert plan.eval.activation_memory_ratio == 2.0
    assert any(w.startswith("activation-memory") for w in plan.warnings)
    assert any(w.startswith("uneven-shard") for w in plan.warnings)


def test_micro_batches_fill_the_pipeline():
    assert micro_batches_per_rank(1024, 1024, 1, 4) == 4
    assert micro_batches_per_rank(1024, 256, 1, 4) == 4
    assert micro_batches_per_rank(1024, 64, 2, 4) == 8
    assert micro_batches_per_rank(5, 2, 1, 1) == 3


def test_invalid_sizes_list_every_violation():
    with pytest.raises(CPConfigError) as info:
        plan_eval_cp(world_size=6, tp=4, pp=2, cp_eval=3, eval_samples=0, seq_length=1000, num_layers=3)
    fields = [v.field for v in info.value.violations]
    assert {"world_size", "eval_context_parallel_size", "eval_samples", "num_layers"} <= set(fields)


def test_cli_json_has_the_documented_keys(capsys):
    rc = cli_main(["plan", "eval-cp", "--world-size", "8192", "--tp", "2", "--pp", "4", "--cp-train", "1",
                   "--cp-eval", "4", "--eval-samples", "1024", "--micro-batch-size", "1",
                   "--seq-length", "8192", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for side in ("train", "eval"):
        assert {"dp", "micro_batches_per_rank", "sample_steps", "redundancy"} <= out[side].keys()
    assert out["train"]["sample_steps"] == 4096 and out["eval"]["sample_steps"] == 1024
    assert isinstance(out["speedup_estimate"], float) and out["warnings"] == []


def test_cli_text_and_the_pp1_flag(capsys):
    rc = cli_main(["plan", "eval-cp", "--world-size", "8", "--cp-eval", "2", "--eval-samples", "4",
                   "--seq-length", "1024"])
    out = capsys.readouterr().out
    assert rc == 0 and "estimated speedup" in out and "warning: short-sequence-pp1" in out


def test_cli_invalid_exits_2_with_one_line_per_violation(capsys):
    rc = cli_main(["plan", "eval-cp", "--world-size", "6", "--tp", "4", "--cp-eval", "3",
                   "--eval-samples", "0", "--seq-length", "1000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) >= 3 and all(line.startswith("error: ") for line in err)
    assert any("eval_samples=0" in line for line in err)


def test_bench_layout_spec_parses():
    from cpkit.bench.eval_cp.eval_cp import parse_layout

    assert parse_layout("tp2pp1") == (2, 1) and parse_layout(" tp1pp4 ") == (1, 4)
    with pytest.raises(ValueError, match="tp<N>pp<M>"):
        parse_layout("pp2")
