"""The cost model held to the replay on one GPU (marker gpu1; skipped where no CUDA device is
visible): `python -m cpkit.bench replay --quick` calibrates the model from the replay's kernels
on this machine, then replays the plans of every implementation on the bench's quick batches
(N = 8, 4K-32K tokens per rank). The model's step time of cpkit's plans must be within 10% of
the replayed one in the median over batches and within 20% on every batch."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from cpkit.bench.dynamic import replay

pytestmark = pytest.mark.gpu1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cost_model_within_10_percent_of_the_replay(tmp_path):
    out = tmp_path / "replay.json"
    assert replay.main(["--quick", "--sets", "mix,long", "--out", str(out), "--plot", str(tmp_path / "r.png")]) == 0
    data = json.loads(out.read_text())
    errors = {r["label"]: r["impl"]["cpkit"]["model_error"] for r in data["results"]}
    assert errors, "no batch was replayed"
    assert statistics.median(abs(e) for e in errors.values()) <= replay.MODEL_MEDIAN, errors
    assert max(abs(e) for e in errors.values()) <= replay.MODEL_MAX, errors
    for r in data["results"]:
        assert "step_s" in r["impl"]["static"], r["impl"]["static"]
