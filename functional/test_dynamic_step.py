"""`python -m cpkit.bench dynamic_step --device cpu --quick` end to end on 4 gloo ranks (a smoke
run of the real-step bench, about 20 s on 2 cores): the calibration is measured on the ranks
from micro-benchmarks and written where it was asked; every plan family that can run here
trains the same batch through cpkit's runtime, with the same loss (the weights stay put: AdamW
at lr 0), and gets the step model's prediction, per rank too; one extra step per plan marks
every micro-batch on every rank, beside the model's time for each; the JSON keeps full plans,
per-rank times and cpkit's own commit. Its GPU numbers come from the 4-GPU run, not from this test."""

from __future__ import annotations

import json

import pytest



@pytest.mark.dist
def test_dynamic_step_smoke_run(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from cpkit.bench.dynamic import dynamic_step
    from cpkit.bench.dynamic.dynamic_step_report import cpkit_source
    from cpkit.dynamic.cost import Calibration, ModelDims
    from cpkit.dynamic.step_model import StepModel

    out, link, cal = tmp_path / "ds.json", tmp_path / "link.json", tmp_path / "cal.json"
    assert dynamic_step.main(["--device", "cpu", "--quick", "--families", "cpkit,static,mcore,mlm",
                              "--out", str(out), "--link-out", str(link), "--calibration", str(cal)]) == 0
    data = json.loads(out.read_text())
    assert data["cpkit"]["fingerprint"] == cpkit_source()["fingerprint"]
    assert data["calibrated_here"] and data["calibration_path"] == str(cal)
    saved = json.loads(cal.read_text())
    costs = StepModel(ModelDims(**data["dims"]), Calibration.from_dict(saved)).costs
    assert set(costs.ops.per_cp) == {1, 2, 4} and costs.ops.ops(4, 2) > costs.ops.ops(1, 2) > 0
    assert costs.host_op_s > 0 and costs.reduce_opt_s > 0
    # points timed back to back; the cp-1 points on a shallower model too (the residual's own term)
    source = saved["step"]["source"]
    assert source["back_to_back"] >= 2 and len(source["call_gaps_s"]) > 0
    assert {p[6] for p in source["points"] if p[0] == 1} == {data["dims"]["num_layers"], source["shallow_layers"]}
    assert source["residual_identified"]
    # the host pace probe: beside every calibration point, and in every timed round of the batch
    assert len(source["pace_samples_s"]) == len(source["call_gaps_s"]) and source["pace_s"] > 0
    # each point read at the pace timed beside it (its probe over the median), the shallow model's too
    assert sorted({round(p[7] * source["pace_s"], 12) for p in source["points"]}) == sorted(
        {round(t, 12) for t in source["pace_samples_s"]})
    (batch,) = data["results"]
    assert len(batch["host_pace"]["probe_samples_s"]) == data["iters"]
    assert batch["host_pace"]["pace"] == pytest.approx(batch["host_pace"]["probe_s"] / source["pace_s"])
    ran = {k: v for k, v in batch["impl"].items() if "step_median_s" in v}
    assert set(ran) >= {"cpkit", "static", "mcore"}, batch["impl"]
    for fam, i in ran.items():
        assert len(i["step_s"]) == data["iters"] == 2
        assert 0 < i["fwd_bwd_median_s"] <= i["step_median_s"]
        assert i["predicted_step_s"] > i["predicted_fwd_bwd_s"] > 0 and i["tokens_per_s"] > 0
        assert i["step_error_at_pace"] == pytest.approx(i["predicted_step_at_pace_s"] / i["step_median_s"] - 1)
        assert len(i["per_rank"]["fwd_bwd_s"]) == len(i["predicted_per_rank_fwd_bwd_s"]) == 4
        assert sorted(s for mb in i["plan"]["microbatches"] for g in mb for s in g["samples"]) \
            == list(range(batch["sequences"]))
    assert ran["mcore"]["lockstep"] and not ran["cpkit"]["lockstep"]
    for fam, i in ran.items():  # the marked extra step: every micro-batch the runtime ran, per rank
        ranks = i["timeline"]["per_rank"]
        assert len(ranks) == len(i["predicted_per_rank_microbatch_s"]) == 4
        for r, mine in enumerate(ranks):
            assert len(mine["microbatches"]) == len(i["predicted_per_rank_microbatch_s"][r]) \
                == i["runtime_microbatches"]
            assert all(m["gpu_s"] is None and m["host_s"] > 0 for m in mine["microbatches"])  # CPU
        # each sample in one group, marked by each of its cp ranks
        assert sum(m["tokens"] / m["cp"] for mine in ranks for m in mine["microbatches"] if m["cp"]) \
            == pytest.approx(batch["tokens"])
        assert set(i["timeline_breakdown"]["misses"]) == {"mb", "between", "other", "prep", "r+o"}
    # fp32 on CPU: every plan computes the loss of the same batch with the same weights
    assert batch["loss_spread"] < 1e-5, {k: v["loss"] for k, v in ran.items()}
    assert "mlm" in batch["impl"] and ("error" in batch["impl"]["mlm"] or "mlm" in ran)
    assert set(data["link_table"]["measurements"]) == {"cp2_batched", "cp2_unbatched", "cp4_batched",
                                                       "cp4_unbatched"}
    text = capsys.readouterr().out
    assert "pred step" in text and "counted per micro-batch" in text and "call gap" in text
    assert "predicted within 10% at the batch's host pace" in text and "err@pace" in text
    assert "where the step's time goes" in text and "largest miss" in text


@pytest.mark.gpu4
def test_dynamic_step_quick_on_four_gpus(tmp_path):
    """The same smoke run on 4 GPUs over NCCL (bf16, tiny model, about 40 s): every family's
    step runs on the NCCL path and all give the batch's loss."""
    from cpkit.bench.dynamic import dynamic_step

    out = tmp_path / "ds.json"
    assert dynamic_step.main(["--device", "cuda", "--quick", "--out", str(out),
                              "--link-out", str(tmp_path / "link.json"), "--timeout-s", "300"]) == 0
    (batch,) = json.loads(out.read_text())["results"]
    ran = {k for k, v in batch["impl"].items() if "step_median_s" in v}
    assert ran >= {"cpkit", "static", "mcore"}, batch["impl"]
    assert batch["loss_spread"] < 1e-2, {k: v.get("loss") for k, v in batch["impl"].items()}
