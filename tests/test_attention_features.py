"""CP attention features at cp=1 (the local path every comm type ends in) against a plain
reference, and their checks: MLA head dims, attention sinks, sliding window, odd-length THD.

The multi-rank counterparts (every comm type, 2 and 4 ranks) are in
functional/test_attention_features.py. fp32 tolerance rtol = atol = 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from cpkit.attention import context_parallel_attention
from cpkit.attention.band import Band, Window, check_window
from cpkit.attention.chunks import local_seq
from cpkit.errors import CPConfigError
from cpkit.testing.reference import masked_sink_reference

FP32 = dict(rtol=1e-5, atol=1e-5)


def _inputs(thd: bool, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (23,) if thd else (24, 2)
    q = torch.randn(*shape, 4, 16, generator=gen)
    k = torch.randn(*shape, 2, 16, generator=gen)
    v = torch.randn(*shape, 2, dv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v)]


def _feature_cases():
    """Each feature alone in both layouts, then gpt-oss's and DeepSeek's combinations."""
    cases = []
    for thd in (False, True):
        fmt = "thd" if thd else "sbhd"
        for causal in (True, False):
            mask = "causal" if causal else "nomask"
            cases += [
                pytest.param(thd, causal, None, None, 8, id=f"{fmt}-{mask}-mla-dv8"),
                pytest.param(thd, causal, None, None, 24, id=f"{fmt}-{mask}-mla-dv24"),
                pytest.param(thd, causal, None, "off-by-one", 16, id=f"{fmt}-{mask}-off-by-one"),
                pytest.param(thd, causal, None, "learnable", 16, id=f"{fmt}-{mask}-learnable"),
                pytest.param(thd, causal, (5, 3), None, 16, id=f"{fmt}-{mask}-window5-3"),
            ]
        cases += [
            pytest.param(thd, True, (5, 0), "learnable", 16, id=f"{fmt}-causal-window5-learnable"),
            pytest.param(thd, True, (5, 0), "off-by-one", 8, id=f"{fmt}-causal-window5-off-by-one-mla"),
        ]
    return cases


@pytest.mark.parametrize("thd,causal,window,sink,dv", _feature_cases())
def test_local_features_match_reference(thd, causal, window, sink, dv):
    """The features at cp=1, THD with odd and empty sequences (handled exactly: nothing is
    split, so nothing is rounded)."""
    q, k, v = _inputs(thd, dv)
    cu = torch.tensor([0, 7, 7, 20, 23], dtype=torch.int32) if thd else None
    logits = None
    if sink is not None:
        logits = torch.zeros(4) if sink == "off-by-one" else torch.tensor([0.3, -1.0, 2.0, 0.0])
        logits.requires_grad_(sink == "learnable")
    out = context_parallel_attention(q, k, v, cp_group=None, cp_comm_type="p2p", causal=causal, cu_seqlens=cu,
                                     window_size=window, softmax_offset=logits)
    assert out.shape == (*q.shape[:-1], dv)
    leaves = [q, k, v] + ([logits] if sink == "learnable" else [])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref = masked_sink_reference(q, k, v, causal=causal, scale=0.25, window=window, sink=logits, cu=cu)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    torch.testing.assert_close(out, ref, **FP32)
    for name, got, want in zip(["q", "k", "v", "sink"], grads, ref_grads):
        torch.testing.assert_close(got, want, **FP32, msg=lambda m, n=name: f"d{n}: {m}")


def test_band_skips_blocks_wholly_outside_the_window():
    """cp=4, s=48 (chunks of 6), causal window of 5: rank 0 holds chunks 0 and 7; the tokens of
    rank 2 (chunks 2, 5) and rank 3 (3, 4) are more than 5 positions before every query of
    chunk 7 and after every query of chunk 0, so those ring blocks are skipped; rank 1's chunk 6
    borders chunk 7 and its block is computed with the band mask."""
    seq = local_seq(12, 4)
    band = Band(Window(5, None), True, seq, rank=0, device="cpu")
    assert band.block(2) is None and band.block(3) is None
    mask = band.block(1).dense()
    q_pos = torch.tensor([*range(0, 6), *range(42, 48)])
    k_pos = torch.tensor([*range(6, 12), *range(36, 42)])
    diff = q_pos.view(-1, 1) - k_pos.view(1, -1)
    assert torch.equal(mask, (diff >= 0) & (diff <= 5)) and mask.any()
    assert band.block(0) is not None and band.block(0).dense().diagonal().all()  # a query sees itself
    # Without the window every block is live; with a two-sided window rank 1 sees rank 0 too.
    two_sided = Band(Window(5, 5), False, seq, rank=1, device="cpu")
    assert two_sided.block(0) is not None and two_sided.block(3) is None


def test_window_and_sink_arguments_are_checked():
    q, k, v = _inputs(False, 16)
    kw = dict(cp_group=None, cp_comm_type="p2p", causal=True)
    for bad in ((4,), (4, -2), (1.5, 0), "4,0"):
        with pytest.raises(CPConfigError, match="window_size"):
            context_parallel_attention(q, k, v, window_size=bad, **kw)
    assert check_window((-1, -1), causal=False) is None and check_window((-1, 7), causal=True) is None
    assert check_window((4, 9), causal=True) == Window(4, None)
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.int64), [0.0] * 4):
        with pytest.raises(CPConfigError, match="softmax_offset"):
            context_parallel_attention(q, k, v, softmax_offset=bad, **kw)
    with pytest.raises(CPConfigError, match="k.shape/v.shape"):
        context_parallel_attention(q, k, v[:, :1], **kw)  # v with other kv heads than k


def test_skill_feature_table_matches_the_tested_matrix():
    """The attention skill's feature table is the one rendered from the matrix the functional
    grid is parametrized from; regenerate it with feature_table_markdown() when they differ."""
    from functional.test_attention_features import (COMMS, FEATURE_MATRIX, FEATURE_TABLE, _cases,
                                                    feature_table_markdown)

    text = (_repo() / "skills/context-parallel-attention/SKILL.md").read_text()
    start, end = "<!-- feature-table:start -->\n", "\n<!-- feature-table:end -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == feature_table_markdown(), "regenerate the table:\n" + feature_table_markdown()
    # Transformer Engine's column has one cell per layout of each row, no more.
    te_layouts = {feature: set(te) for feature, (_, _, te) in FEATURE_TABLE.items()}
    assert te_layouts == {feature: set(fmts) for feature, fmts in FEATURE_MATRIX.items()}
    # Every cell the table claims is a case the grid runs, on 2 and on 4 ranks.
    for world_size in (2, 4):
        ran = {(c["feature"], c["fmt"], c["comm"]) for c in _cases("gloo", world_size)}
        assert ran == {(f, fmt, comm) for f, fmts in FEATURE_MATRIX.items() for fmt in fmts for comm in COMMS}


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]
