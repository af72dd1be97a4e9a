"""cpkit.bench.dynamic.dynamic_step_order: the step model's ordering of close plans against real steps,
counted from bench JSONs (here written by hand, with plans the tests know)."""

from __future__ import annotations

import gzip
import json

import pytest

from cpkit.bench.dynamic.dynamic_step_order import main, order_stats
from cpkit.bench.dynamic.dynamic_step_predict import plan_from_record, plan_record
from cpkit.dynamic.candidates import robustness
from cpkit.testing.plans import hand_plan

LENS = [8, 8, 8, 8]
ROBUST = hand_plan([[((0,), (0, 1)), ((1,), (2,))], [((0,), (3,))]], LENS, 2)  # 2 micro-batches, no switch
SWITCHY = hand_plan([[((0,), (0,)), ((1,), (1,))], [((0, 1), (2,))], [((0,), (3,))]], LENS, 2)


def _batch(label, steps: dict, modeled: dict, plans: dict, chosen: str) -> dict:
    impl = {f: {"step_median_s": steps[f], "predicted_step_s": modeled[f], "plan": plan_record(plans[f])}
            for f in steps}
    impl["cpkit"] = {**impl[chosen], "same_plan_as": chosen}
    return {"label": label, "seq_lens": LENS, "dp_cp_size": 2, "max_seq_len_per_rank": 64, "impl": impl}


def _run():
    plans = {"static": ROBUST, "mlm": SWITCHY}
    return {"results": [
        # modeled 3% apart, really 6%: the model right, the robust plan (chosen) lost
        _batch("a", {"static": 1.06, "mlm": 1.0}, {"static": 1.03, "mlm": 1.0}, plans, "static"),
        # modeled 5% apart the wrong way: the model wrong, the robust plan won
        _batch("b", {"static": 1.0, "mlm": 1.04}, {"static": 1.05, "mlm": 1.0}, plans, "mlm"),
        # really within the resolution: not counted as an order either way
        _batch("c", {"static": 1.0, "mlm": 1.005}, {"static": 1.02, "mlm": 1.0}, plans, "mlm"),
        # modeled 20% apart: outside the band
        _batch("d", {"static": 1.3, "mlm": 1.0}, {"static": 1.2, "mlm": 1.0}, plans, "mlm"),
    ]}


def test_a_plan_record_reads_back_as_the_plan():
    back = plan_from_record(plan_record(SWITCHY), {"seq_lens": LENS, "dp_cp_size": 2, "max_seq_len_per_rank": 64})
    assert back.microbatches == SWITCHY.microbatches and back.packed == SWITCHY.packed
    assert back.needed_cp_sizes == SWITCHY.needed_cp_sizes  # per sample, from its length
    assert robustness(back) == robustness(SWITCHY) == (3, 2) and robustness(ROBUST) == (2, 0)


def test_close_pairs_count_the_models_order_and_robustness_separately():
    s = order_stats([_run()])
    assert s["pairs"] == 4  # one distinct pair per batch: cpkit reuses a family's plan
    assert (s["close"], s["model_right"], s["differ_in_robustness"], s["robust_won"]) == (2, 1, 2, 1)
    chosen = {b["batch"]: (b["chosen"], b["fastest_modeled"]) for b in s["batches"]}
    assert chosen["a"] == pytest.approx((1.06, 1.0)) and chosen["b"] == pytest.approx((1.04, 1.04))
    assert order_stats([_run()], band=0.04)["close"] == 1  # only batch a's 3%


def test_the_command_reads_gzipped_runs_and_names_a_missing_one(tmp_path, capsys):
    path = tmp_path / "run.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(_run(), fh)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 runs, 4 batches, 4 plan pairs" in out and "the model ordered 1 right" in out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope.json")])
    assert "no such run file" in capsys.readouterr().err
