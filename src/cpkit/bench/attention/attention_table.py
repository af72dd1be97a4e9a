"""The attention benchmark's table: TFLOP/s per GPU per cell, and the ratios that its targets
are stated in (measured, from the same run):

- `cpkit/TE <seq>`, on cpkit rows: cpkit's TFLOP/s over Transformer Engine's for the same comm
  type, KV heads, CP size and sequence (>= 1.00: cpkit at least as fast as TE);
- `/sdpa <seq>`, on every CP row: TFLOP/s per GPU over single-GPU SDPA's at the same KV heads and
  total sequence (the per-GPU limit a CP method approaches).

A ratio column appears only where the run has both sides; a cell with an error has no ratio. A
cell TE has no attention backend for (a feature it does not run on that comm type) says "TE
refuses".
"""

from __future__ import annotations

from typing import Optional

from cpkit.bench.common import format_table

__all__ = ["row_label", "seq_label", "render", "te_ratios", "sdpa_ratios"]


def row_label(r: dict) -> str:
    """A result's row: backend, comm type, feature (when not dense), KV heads, CP size."""
    feat = r.get("feature", "dense")
    return f"{r['backend']} {r['comm']}{'' if feat == 'dense' else ' ' + feat} kv{r['kv_heads']} cp{r['cp']}"


def _cell(r: dict) -> tuple:
    return (r["comm"], r.get("feature", "dense"), r["kv_heads"], r["cp"], r["seq"])


def seq_label(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


# TE's words when it has no attention backend for a cell's features (TE 2.20: ValueError).
_TE_REFUSAL = "No dot product attention backend"


def _error_cell(r: dict) -> str:
    """A failed cell: "TE refuses" where TE has no backend for the cell's feature and comm
    type (the JSON keeps the whole error), else the error's first line."""
    if r["backend"] == "te" and _TE_REFUSAL in r["error"]:
        return "TE refuses"
    return r["error"].splitlines()[0]


def te_other_band(r: dict) -> Optional[str]:
    """Why a TE cell's figure is not of the cell's attention (None: it is). TE 2.20.2's all_gather
    with a two-sided window attends keys i-2W .. i, not i-W .. i+W
    (functional/test_te_backend_window.py, a strict xfail): a smaller band, so no ratio."""
    if r["backend"] == "te" and r["comm"] == "all_gather" and r.get("feature") == "window2":
        return "TE attends keys i-2W .. i here (functional/test_te_backend_window.py): no ratio"
    return None


def _tflops(r: dict) -> Optional[float]:
    return None if r.get("error") or not r.get("tflops_per_gpu") else r["tflops_per_gpu"]


def te_ratios(results: list[dict]) -> dict[tuple[str, int], float]:
    """(cpkit row label, seq) -> cpkit TFLOP/s / TE TFLOP/s, for every cell both ran without error."""
    te = {_cell(r): _tflops(r) for r in results if r["backend"] == "te" and not te_other_band(r)}
    out = {}
    for r in results:
        other = te.get(_cell(r))
        if r["backend"] == "cpkit" and _tflops(r) and other:
            out[(row_label(r), r["seq"])] = _tflops(r) / other
    return out


def sdpa_ratios(results: list[dict]) -> dict[tuple[str, int], float]:
    """(row label, seq) -> TFLOP/s per GPU / single-GPU SDPA's, for every dense CP row with an
    SDPA cell (SDPA runs the dense cells only)."""
    sdpa = {(r["kv_heads"], r["seq"]): _tflops(r) for r in results if r["backend"] == "sdpa"}
    out = {}
    for r in results:
        other = sdpa.get((r["kv_heads"], r["seq"]))
        if r["backend"] != "sdpa" and r.get("feature", "dense") == "dense" and _tflops(r) and other:
            out[(row_label(r), r["seq"])] = _tflops(r) / other
    return out


def _te_summary(ratios: dict[tuple[str, int], float]) -> str:
    (row, seq), worst = min(ratios.items(), key=lambda kv: kv[1])
    behind = sum(v < 1.0 for v in ratios.values())
    return (f"cpkit/TE: cpkit behind TE in {behind} of {len(ratios)} cells; lowest {worst:.3f} "
            f"({row} {seq_label(seq)})")


def render(results: list[dict], seqs: list[int], device: str = "cuda") -> str:
    """The result table: rows backend/comm/kv-heads/cp; columns TFLOP/s per GPU (per rank on
    CPU) per total sequence, then the cpkit/TE and /sdpa ratios per sequence where the run has them."""
    rows, cells = [], {}
    for r in results:
        label = row_label(r)
        if label not in rows:
            rows.append(label)
        if r["error"]:
            text = _error_cell(r)
        else:
            text = f"{r['tflops_per_gpu']:.1f}" if r["tflops_per_gpu"] >= 1 else f"{r['tflops_per_gpu']:.3g}"
            if r.get("notes"):
                text += "*"
            if te_other_band(r):
                text += "+"
        cells[(label, seq_label(r["seq"]))] = text
    columns = [seq_label(s) for s in seqs]
    te, sdpa = te_ratios(results), sdpa_ratios(results)
    for name, ratios in (("cpkit/TE", te), ("/sdpa", sdpa)):
        if ratios:
            columns += [f"{name} {seq_label(s)}" for s in seqs]
            cells.update({(row, f"{name} {seq_label(s)}"): f"{v:.3f}" for (row, s), v in ratios.items()})
    table = format_table(rows, columns, cells, corner="TFLOP/s per GPU" if device == "cuda" else "TFLOP/s per rank")
    if any(r.get("notes") for r in results):
        table += "\n* kv heads expanded to the query heads (the kernel refused native GQA)"
    why = next(filter(None, (te_other_band(r) for r in results if not r["error"])), None)
    if why:
        table += "\n+ " + why
    if te:
        table += "\n" + _te_summary(te)
    return table
