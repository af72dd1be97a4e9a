"""`python -m cpkit.bench window --quick` on CPU: exits 0 and writes a time for every cpkit row
(TE's row holds its error where TE is absent); the p2p rows name the busiest rank and how many
of its ring blocks the window leaves (its GPU figures live in the attention card and evidence/)."""

from __future__ import annotations

import json

from cpkit.bench.window import main


def test_window_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "window.json"
    assert main(["--device", "cpu", "--quick", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {r["case"]: r for r in payload["results"]}
    cpkit = [case for case in rows if case.startswith("cpkit")]
    assert len(cpkit) == 3 and all(rows[c].get("ms", 0) > 0 for c in cpkit), rows
    # 512 tokens at cp=4: chunks of 64, window 32: rank 1 (chunks 1, 6) meets ranks 0 and 2 only.
    assert "cpkit p2p, window (rank 1: 3 of 4 blocks)" in rows
    assert payload["settings"]["window"] == 32 and "TE a2a, window" in rows
