"""The attention benchmark's table (cpkit.bench.attention_table): TFLOP/s cells, and the cpkit/TE
and /sdpa ratio columns computed from the same run's cells (numbers here are made up)."""

from __future__ import annotations

import pytest

from cpkit.bench.attention_table import render, sdpa_ratios, te_ratios


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
