"""The benchmarks end to end on gloo (CPU, tiny sizes): `python -m cpkit.bench attention` and
`eval_cp` with `--quick --profile` exit 0, write JSON with a number in every cell, and append
one profile block per cell (their GPU figures live in the cards and evidence/, not in tests)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.dist


def test_attention_bench_runs_and_profiles(tmp_path):
    from cpkit.bench.attention.attention import main

    out, prof = tmp_path / "attention.json", tmp_path / "profile.txt"
    assert main(["--device", "cpu", "--quick", "--comm", "p2p,a2a", "--out", str(out), "--profile", str(prof)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in results] == ["sdpa", "cpkit", "cpkit"]
    assert all(r["error"] is None and r["tflops_per_gpu"] > 0 for r in results)
    titles = [line for line in prof.read_text().splitlines() if line.startswith("=== ")]
    assert len(titles) == len(results)
    assert titles[1].startswith("=== cpkit p2p kv2 cp2 seq 256: 3 iterations")
    # Every rank of a cell writes its trace: the single-rank SDPA cell one, the cp2 cells two.
    traces = sorted(p.name[len("profile.txt."):] for p in tmp_path.glob("profile.txt.*.trace.json"))
    assert traces == ["cpkit_a2a_kv2_cp2_seq_256.rank0.trace.json", "cpkit_a2a_kv2_cp2_seq_256.rank1.trace.json",
                      "cpkit_p2p_kv2_cp2_seq_256.rank0.trace.json", "cpkit_p2p_kv2_cp2_seq_256.rank1.trace.json",
                      "sdpa_-_kv2_cp1_seq_256.rank0.trace.json"]


def test_eval_cp_bench_runs_and_profiles(tmp_path):
    pytest.importorskip("megatron.core")
    from cpkit.bench.eval_cp.eval_cp import main

    out, prof = tmp_path / "eval_cp.json", tmp_path / "profile.txt"
    assert main(["--device", "cpu", "--quick", "--seq", "64", "--out", str(out), "--profile", str(prof)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert "error" not in row and row["train_ms"] > 0 and row["eval_ms"] > 0
    assert row["loss_delta"] < 1e-5  # fp32 on CPU: the eval layout gives the training layout's loss
    text = prof.read_text()
    assert "seq 64: train layout" in text and "seq 64: eval layout" in text
    for layout in ("train", "eval"):  # the last stage's trace is there too
        assert len(list(tmp_path.glob(f"profile.txt.*seq_64_{layout}_layout.rank1.trace.json"))) == 1


def test_hybrid_bench_runs_every_cell_and_the_ratios(tmp_path):
    from cpkit.bench.hybrid.gdn_layer import main

    out = tmp_path / "hybrid.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cells = {c["mode"]: c for c in data["cells"]}
    assert set(cells) == {"one GPU", "chunkwise", "headwise", "transition"}
    assert all(c["error"] is None and c["ms"] > 0 for c in cells.values())
    assert cells["chunkwise"]["tokens"] == 128 and cells["one GPU"]["tokens"] == 256  # cp 2 halves the tokens
    assert "src/cpkit/bench/hybrid/gdn_layer.py" in data["code"]  # the code the run loaded, for its claims
