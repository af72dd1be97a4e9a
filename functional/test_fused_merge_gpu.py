"""The Triton merge (`src/cpkit/attention/fused_merge.py`) on one GPU (marker gpu1).

Attention over the union of two key blocks, computed here by softmax over the concatenated
scores in float64, is the reference; each block's output and LSE come from the same float64
math, rounded to the dtype under test. The merge under test folds the second block into the
first in place, as the ring does: sbhd and THD, a view (the second query chunk), a 16-bit
running output (a ring of 2) and an fp32 one, head dims 128 and 96 (not a power of two), and
rows that saw no key in one part or in both (which must keep their output and an LSE of -inf).

Tolerances: fp32 output and LSE rtol = atol = 1e-5 (a few fp32 roundings); a 16-bit output is
the fp32 merge rounded once, plus the rounding of each block's output to the dtype: rtol = atol
= 2 ulp of the dtype at 1 (bf16 2**-7, fp16 2**-10) x the largest magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpkit.attention import fused_merge

pytestmark = [
    pytest.mark.gpu1,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fused_merge.available(), reason="Triton is not importable"),
]

ULP2 = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _block(scores: torch.Tensor, values: torch.Tensor):
    """float64 attention of one key block: (output [rows, d], LSE [rows]); a row whose scores
    are all -inf has output 0 and LSE -inf, like the kernels."""
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ values, lse


def _problem(rows: int, keys: int, dim: int, empty_every: int):
    """Scores of `rows` queries against two key blocks and their values, float64; every
    `empty_every`-th row sees no key in block 0, the next none in block 1, the next none at all."""
    g = torch.Generator().manual_seed(rows * 31 + dim)
    scores = [torch.randn(rows, keys, generator=g, dtype=torch.float64) * 2 for _ in range(2)]
    values = [torch.randn(keys, dim, generator=g, dtype=torch.float64) for _ in range(2)]
    for r in range(0, rows, empty_every):
        scores[0][r] = -math.inf
        if r + 1 < rows:
            scores[1][r + 1] = -math.inf
        if r + 2 < rows:
            scores[0][r + 2] = scores[1][r + 2] = -math.inf
    return scores, values


def _layout(flat: torch.Tensor, shape, thd: bool):
    """[rows, d] (rows ordered s, b, h) as [s, b, h, d] or [t, h, d]; an LSE [rows] as [b, h, s]
    or [h, t]."""
    if flat.dim() == 2:
        return flat.reshape(*shape, flat.shape[-1])
    if thd:
        return flat.reshape(shape).movedim(0, -1).contiguous()
    return flat.reshape(shape).permute(1, 2, 0).contiguous()


@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
@pytest.mark.parametrize("dim", [128, 96])
@pytest.mark.parametrize("running", ["float32", "bfloat16", "float16"])
def test_fused_merge_equals_attention_over_both_key_blocks(thd, dim, running):
    shape = (40, 6) if thd else (20, 2, 3)  # [t, h] or [s, b, h]: 240 rows
    rows = math.prod(shape)
    scores, values = _problem(rows, keys=17, dim=dim, empty_every=11)
    full_out, full_lse = _block(torch.cat(scores, -1), torch.cat(values, 0))
    parts = [_block(s, v) for s, v in zip(scores, values)]
    run_dtype = getattr(torch, running)
    block_dtype = torch.bfloat16 if running == "float32" else run_dtype
    dev = torch.device("cuda")
    out = _layout(parts[0][0], shape, thd).to(dev, run_dtype).contiguous()
    lse = _layout(parts[0][1], shape, thd).to(dev, torch.float32)
    block_out = _layout(parts[1][0], shape, thd).to(dev, block_dtype).contiguous()
    block_lse = _layout(parts[1][1], shape, thd).to(dev, torch.float32)
    assert fused_merge.supports(out, lse, block_out, block_lse)

    fused_merge.fused_merge_(out, lse, block_out, block_lse)

    want_out = _layout(full_out, shape, thd).to(dev)
    want_lse = _layout(full_lse, shape, thd).to(dev)
    worst = want_out.abs().max().item()
    tol = ULP2[block_dtype]
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol * worst)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    empty = torch.isinf(want_lse)
    assert empty.any() and torch.equal(torch.isinf(lse), empty)


def test_fused_merge_into_a_view_changes_only_the_view():
    # The ring's "q_second" block merges into the second half of the queries only.
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    out = torch.randn(16, 2, 4, 128, device=dev, generator=g)
    lse = torch.randn(2, 4, 16, device=dev, generator=g)
    block_out = torch.randn(8, 2, 4, 128, device=dev, generator=g, dtype=torch.bfloat16)
    block_lse = torch.randn(2, 4, 8, device=dev, generator=g)
    before_out, before_lse = out.clone(), lse.clone()
    view_out, view_lse = out.narrow(0, 8, 8), lse.narrow(-1, 8, 8)
    assert fused_merge.supports(view_out, view_lse, block_out, block_lse)

    fused_merge.fused_merge_(view_out, view_lse, block_out, block_lse)

    torch.testing.assert_close(out[:8], before_out[:8], rtol=0, atol=0)
    torch.testing.assert_close(lse[..., :8], before_lse[..., :8], rtol=0, atol=0)
    l_old, l_new = before_lse[..., 8:].double(), block_lse.double()
    want_lse = torch.logaddexp(l_old, l_new)
    w_old = torch.exp(l_old - want_lse).permute(2, 0, 1).unsqueeze(-1)
    w_new = torch.exp(l_new - want_lse).permute(2, 0, 1).unsqueeze(-1)
    want = w_old * before_out[8:].double() + w_new * block_out.double()
    torch.testing.assert_close(out[8:].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[..., 8:].double(), want_lse, rtol=1e-5, atol=1e-5)


def test_merge_takes_the_torch_ops_by_default_and_the_fused_kernel_when_asked(monkeypatch):
    from cpkit.attention import merge as merge_module

    calls = []
    monkeypatch.setattr(fused_merge, "fused_merge_", lambda *a: calls.append(a))
    dev = torch.device("cuda")
    out, block = torch.zeros(4, 1, 2, 8, device=dev), torch.ones(4, 1, 2, 8, device=dev)
    lse, block_lse = torch.zeros(1, 2, 4, device=dev), torch.zeros(1, 2, 4, device=dev)
    merge_module.merge_(out, lse, block, block_lse)
    assert not calls and torch.allclose(out, torch.full_like(out, 0.5))  # the default: torch ops
    merge_module.merge_(out, lse, block, block_lse, fused=True)
    assert len(calls) == 1
