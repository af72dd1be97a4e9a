"""`python -m cpkit.bench dynamic_step --device cpu --quick` end to end on 4 gloo ranks (a smoke
run of the real-step bench, about 20 s on 2 cores): every plan family that can run here trains
the same batch through cpkit's runtime, with the same loss (the weights stay put: AdamW at lr
0), and gets a replayed and a modeled prediction; the link table is written where the replay
reads it. Its GPU numbers come from the 4-GPU run, not from this test."""

from __future__ import annotations

import json

import pytest



@pytest.mark.dist
def test_dynamic_step_smoke_run(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from cpkit.bench import dynamic_step
    from cpkit.bench.replay_timing import link_table

    out, link = tmp_path / "ds.json", tmp_path / "link.json"
    assert dynamic_step.main(["--device", "cpu", "--quick", "--families", "cpkit,static,mcore,mlm",
                              "--out", str(out), "--link-out", str(link)]) == 0
    data = json.loads(out.read_text())
    (batch,) = data["results"]
    ran = {k: v for k, v in batch["impl"].items() if "step_median_s" in v}
    assert set(ran) >= {"cpkit", "static", "mcore"}, batch["impl"]
    for fam, i in ran.items():
        assert len(i["step_s"]) == data["iters"] == 2
        assert 0 < i["fwd_bwd_median_s"] <= i["step_median_s"]
        assert i["replayed_s"] > 0 and i["modeled_s"] > 0 and i["tokens_per_s"] > 0
    assert ran["mcore"]["lockstep"] and not ran["cpkit"]["lockstep"]
    # fp32 on CPU: every plan computes the loss of the same batch with the same weights
    assert batch["loss_spread"] < 1e-5, {k: v["loss"] for k, v in ran.items()}
    assert "mlm" in batch["impl"] and ("error" in batch["impl"]["mlm"] or "mlm" in ran)
    assert set(data["link_table"]["measurements"]) == {"cp2_batched", "cp2_unbatched", "cp4_batched",
                                                       "cp4_unbatched"}
    assert link_table(str(link)).name == str(link)
    text = capsys.readouterr().out
    assert "replay/real" in text and "target cpkit: replay within 10%" in text


@pytest.mark.gpu4
def test_dynamic_step_quick_on_four_gpus(tmp_path):
    """The same smoke run on 4 GPUs over NCCL (bf16, tiny model, about 40 s): every family's
    step runs on the NCCL path and all give the batch's loss."""
    from cpkit.bench import dynamic_step

    out = tmp_path / "ds.json"
    assert dynamic_step.main(["--device", "cuda", "--quick", "--out", str(out),
                              "--link-out", str(tmp_path / "link.json"), "--timeout-s", "300"]) == 0
    (batch,) = json.loads(out.read_text())["results"]
    ran = {k for k, v in batch["impl"].items() if "step_median_s" in v}
    assert ran >= {"cpkit", "static", "mcore"}, batch["impl"]
    assert batch["loss_spread"] < 1e-2, {k: v.get("loss") for k, v in batch["impl"].items()}
