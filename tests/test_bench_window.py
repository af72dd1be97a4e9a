"""`python -m cpkit.bench window --quick` on CPU: exits 0 and writes a time for every row that
can run on CPU (FlexAttention's rows as exact math, the dense kernels), while the cuDNN
frontend's rows and TE's hold their errors (neither is installed in CI); the p2p rows name the
busiest rank and how many of its ring blocks the window leaves; the targets are in the JSON
(its GPU figures live in the attention card and evidence/)."""

from __future__ import annotations

import json

from cpkit.bench.attention.window import main


def test_window_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "window.json"
    assert main(["--device", "cpu", "--quick", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {r["case"]: r for r in payload["results"]}
    runnable = [case for case in rows if "cudnn_fe" not in case and not case.startswith("TE")]
    assert len(runnable) == 9 and all(rows[c].get("ms", 0) > 0 for c in runnable), rows
    library = [case for case in rows if "cudnn_fe" in case]
    assert len(library) == 9 and all("nvidia-cudnn-frontend" in rows[c]["error"] for c in library)
    # 512 tokens at cp=4: chunks of 64, window 32: rank 1 (chunks 1, 6) meets ranks 0 and 2 only.
    assert "p2p, window, flex (rank 1: 3 of 4 blocks)" in rows
    assert payload["settings"]["window"] == 32 and "TE a2a, window" in rows
    assert set(payload["targets"]) >= {"a2a_window_vs_te (<= 1.0)", "sink_over_no_sink (< 1.05)"}
