"""The attention benchmark's table (cpkit.bench.attention.attention_table): TFLOP/s cells, and the cpkit/TE
and /sdpa ratio columns computed from the same run's cells (numbers here are made up)."""

from __future__ import annotations

import pytest

from cpkit.bench.attention.attention_table import render, sdpa_ratios, te_ratios


def cell(backend, comm, seq, tflops, kv=8, cp=4, error=None):
    return dict(backend=backend, comm=comm, kv_heads=kv, cp=1 if backend == "sdpa" else cp, seq=seq,
                tflops_per_gpu=None if error else tflops, error=error, notes=[])


RESULTS = [
    cell("sdpa", "-", 32768, 500.0), cell("sdpa", "-", 131072, 540.0),
    cell("cpkit", "p2p", 32768, 450.0), cell("cpkit", "p2p", 131072, 520.0),
    cell("te", "p2p", 32768, 400.0), cell("te", "p2p", 131072, 540.0),
    cell("cpkit", "a2a", 32768, 430.0), cell("cpkit", "a2a", 131072, 0.0, error="error: OOM"),
    cell("te", "a2a", 32768, 430.0), cell("te", "a2a", 131072, 510.0),
    cell("torch", "-", 32768, 300.0),
]


def test_te_ratios_pair_cells_of_the_same_comm_kv_cp_and_seq():
    assert te_ratios(RESULTS) == {("cpkit p2p kv8 cp4", 32768): 450.0 / 400.0,
                                  ("cpkit p2p kv8 cp4", 131072): 520.0 / 540.0,
                                  ("cpkit a2a kv8 cp4", 32768): 1.0}


def test_sdpa_ratios_cover_every_cp_row_with_a_reference():
    ratios = sdpa_ratios(RESULTS)
    assert ratios[("te p2p kv8 cp4", 131072)] == pytest.approx(1.0)
    assert ratios[("torch - kv8 cp4", 32768)] == pytest.approx(0.6)
    assert ("cpkit a2a kv8 cp4", 131072) not in ratios  # the cell failed
    assert not any(row.startswith("sdpa") for row, _ in ratios)


def test_render_writes_the_ratio_columns_and_the_summary():
    lines = render(RESULTS, [32768, 131072]).splitlines()
    assert lines[0].split() == ["TFLOP/s", "per", "GPU", "32K", "128K", "cpkit/TE", "32K", "cpkit/TE", "128K",
                                "/sdpa", "32K", "/sdpa", "128K"]
    p2p = next(line for line in lines if line.startswith("cpkit p2p"))
    assert p2p.split()[4:] == ["450.0", "520.0", "1.125", "0.963", "0.900", "0.963"]
    te = next(line for line in lines if line.startswith("te p2p"))
    assert te.split()[4:] == ["400.0", "540.0", "-", "-", "0.800", "1.000"]
    assert lines[-1] == "cpkit/TE: cpkit behind TE in 1 of 3 cells; lowest 0.963 (cpkit p2p kv8 cp4 128K)"


def test_render_without_te_or_sdpa_has_no_ratio_columns():
    table = render([cell("cpkit", "p2p", 1024, 12.34)], [1024])
    assert table.splitlines()[0].split() == ["TFLOP/s", "per", "GPU", "1K"]
    assert "12.3" in table and "cpkit/TE" not in table


# ------------------------------------------------------------------------------- features


def test_feature_cells_pair_with_te_of_the_same_feature_and_have_no_sdpa_ratio():
    results = RESULTS + [
        dict(cell("cpkit", "a2a", 32768, 300.0), feature="window"),
        dict(cell("te", "a2a", 32768, 250.0), feature="window"),
        dict(cell("cpkit", "p2p", 32768, 200.0), feature="window"),
        dict(cell("te", "p2p", 32768, 0.0, error="error: AssertionError: window needs a2a"), feature="window"),
        dict(cell("te", "p2p", 32768, 0.0, error="error: ValueError: No dot product attention backend is av..."),
             feature="sink"),
    ]
    te = te_ratios(results)
    assert te[("cpkit a2a window kv8 cp4", 32768)] == 300.0 / 250.0
    assert ("cpkit p2p window kv8 cp4", 32768) not in te  # TE refused: no ratio, its error shows
    assert not any("window" in row for row, _ in sdpa_ratios(results))
    table = render(results, [32768, 131072])
    assert "te p2p window kv8 cp4" in table and "error: AssertionError" in table
    sink_row = next(line for line in table.splitlines() if line.startswith("te p2p sink"))
    assert sink_row.split()[5:7] == ["TE", "refuses"]


def test_tes_all_gather_two_sided_window_has_no_ratio_and_says_why():
    """TE attends another band there (functional/test_te_backend_window.py): its figure shows,
    marked, and no cpkit/TE ratio is made of it; TE's other window cells still pair."""
    results = RESULTS + [
        dict(cell("cpkit", "all_gather", 32768, 330.0), feature="window2"),
        dict(cell("te", "all_gather", 32768, 440.0), feature="window2"),
        dict(cell("cpkit", "all_gather", 32768, 290.0), feature="window"),
        dict(cell("te", "all_gather", 32768, 170.0), feature="window"),
    ]
    te = te_ratios(results)
    assert ("cpkit all_gather window2 kv8 cp4", 32768) not in te
    assert te[("cpkit all_gather window kv8 cp4", 32768)] == 290.0 / 170.0
    table = render(results, [32768])
    assert "440.0+" in table and "+ TE attends keys i-2W .. i here (functional/test_te_backend_window.py)" in table


def test_attended_pairs_count_every_query_key_pair_of_the_band():
    from cpkit.bench.attention.attention_features import attended_pairs

    for seq, causal, window in [(10, True, (3, 0)), (10, False, (3, 2)), (7, False, (9, 9)),
                                (12, True, (11, 5)), (5, False, (0, 0))]:
        left, right = window
        brute = sum(1 for i in range(seq) for j in range(seq)
                    if i - left <= j <= i + (0 if causal else right))
        assert attended_pairs(seq, causal, window) == brute, (seq, causal, window)
    assert attended_pairs(8, True, None) == 32 and attended_pairs(8, False, None) == 64


def test_dense_feature_flops_are_the_causal_formula_and_mla_counts_both_head_dims():
    from cpkit.bench.attention.attention import causal_fwd_bwd_flops
    from cpkit.bench.attention.attention_features import feature, fwd_bwd_flops

    assert fwd_bwd_flops(1, 32, 4096, 128, feature("dense", 64)) == causal_fwd_bwd_flops(1, 32, 4096, 128)
    mla = feature("mla", 64)
    assert fwd_bwd_flops(1, 32, 4096, 128, mla) == causal_fwd_bwd_flops(1, 32, 4096, 128) * (192 + 128) / 256
    assert mla.kv_heads(32, 8) == 32 and feature("sink", 64).kv_heads(32, 8) == 8
    with pytest.raises(ValueError, match="must be one of"):
        feature("windows", 64)


def test_build_cases_runs_features_on_cpkit_and_te_and_dense_only_on_sdpa_and_torch():
    from cpkit.bench.attention.attention import build_cases

    cases = build_cases(["cpkit", "te", "sdpa", "torch"], ["a2a"], [8], [4], [1024], 2, te_ok=True,
                        features=("dense", "sink"))
    assert [(c.backend, c.feature) for c in cases] == [
        ("sdpa", "dense"), ("cpkit", "dense"), ("te", "dense"), ("cpkit", "sink"),
        ("te", "sink"), ("torch", "dense")]
    only = build_cases(["cpkit", "sdpa"], ["a2a"], [8], [4], [1024], 2, te_ok=False, features=("window",))
    assert [(c.backend, c.feature) for c in only] == [("cpkit", "window")]


def test_bench_refuses_an_unknown_feature(capsys):
    from cpkit.bench.attention.attention import main

    assert main(["--device", "cpu", "--features", "dense,windw"]) == 2
    assert "--features ['windw']: each must be one of" in capsys.readouterr().err


def test_a_requested_cell_without_a_row_is_named_with_its_reason():
    from cpkit.bench.attention.attention import build_cases, dropped_cells

    cases = build_cases(["cpkit"], ["p2p", "a2a+p2p"], [8], [2, 4], [1024], 2, te_ok=False)
    assert {(c.comm, c.cp) for c in cases} == {("p2p", 2), ("p2p", 4), ("a2a+p2p", 4)}
    notes = dropped_cells(["p2p", "a2a+p2p"], [2, 4], 2)
    assert notes == ["no a2a+p2p row at cp 2: a2a+p2p needs two levels > 1 and --hcp-a2a 2 at cp 2 leaves a p2p "
                     "level of 1, which is plain a2a (its own row); at cp 4, --hcp-a2a 2 is [2, 2]"]
    assert "does not divide" in dropped_cells(["a2a+p2p"], [6], 4)[0]
    assert dropped_cells(["p2p"], [2], 2) == []


def test_repeated_runs_give_each_cells_median_and_spread(tmp_path):
    import json

    from cpkit.bench.attention.repeats import cell_ratios, main, render

    def run(cpkit_tflops):
        return [{"backend": b, "comm": "p2p", "kv_heads": 8, "cp": 2, "seq": 32768, "tflops_per_gpu": t}
                for b, t in (("cpkit", cpkit_tflops), ("te", 100.0))]

    runs = [run(99.0), run(103.0), run(101.0)]
    ratios = cell_ratios(runs)
    assert ratios == {("cpkit p2p kv8 cp2", 32768): [0.99, 1.03, 1.01]}
    text = render(ratios)
    assert "1.010 (0.040, n=3)" in text and "at or ahead of TE (median >= 1.00) in all 1 cells" in text
    assert "behind TE (median < 1.00) in 1 of 1 cells: cpkit p2p kv8 cp2 32K 0.990" in render(
        cell_ratios([run(99.0), run(98.0), run(103.0)]))
    paths = []
    for i, results in enumerate(runs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"results": results}))
    assert main([str(p) for p in paths]) == 0


def test_machine_info_records_no_te_where_mcore_is_missing(monkeypatch):
    """The hybrid bench runs without megatron-core: its machine record says TE None, not a crash."""
    import sys

    from cpkit.bench.common import machine_info

    monkeypatch.setitem(sys.modules, "cpkit.attention.te", None)  # as if its MCore import failed
    assert machine_info()["transformer_engine"] is None
