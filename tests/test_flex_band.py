"""The FlexAttention path of sliding-window blocks (`src/cpkit/attention/flex_band.py`) on CPU.

CPU runs FlexAttention's forward uncompiled (its reference implementation) and has no backward,
so these tests check the wrapper: layouts (sbhd, THD), GQA, MLA head dims, the band as a block
mask and the LSE convention against the exact dense-mask math; the backward's algebra (a block's
share of the merged attention, taken through the block's own output and LSE) with a
differentiable math forward; and the fallback. The compiled kernel itself is checked on one GPU
by functional/test_device.py. fp32 tolerance rtol = atol = 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from cpkit.attention import flex_band
from cpkit.attention.band import Band, Window, _math_band_bwd, _math_band_fwd
from cpkit.attention.chunks import local_seq

FP32 = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # uncompiled FlexAttention warns


def _band(thd: bool, window: Window, causal: bool, rank: int, src: int, cp: int = 2):
    """A block of rank `rank`'s queries against rank `src`'s keys: 40 tokens sbhd, or THD
    sequences of 16, 8 and 24 tokens."""
    cu = torch.tensor([0, 16, 24, 48]) if thd else None
    tokens = (48 if thd else 40) // cp
    band = Band(window, causal, local_seq(tokens, cp, cu, 24 if thd else None), rank, "cpu")
    return band.block(src), tokens


def _qkv(thd: bool, tokens: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lead = (tokens,) if thd else (tokens, 2)
    return (torch.randn(*lead, 4, 16, generator=gen), torch.randn(*lead, 2, 16, generator=gen),
            torch.randn(*lead, 2, dv, generator=gen))


@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
@pytest.mark.parametrize("window,causal", [(Window(5, None), True), (Window(3, 6), False)],
                         ids=["causal-window", "two-sided"])
@pytest.mark.parametrize("rank,src", [(0, 0), (1, 0), (0, 1)])
def test_flex_forward_matches_dense_band_math(thd, window, causal, rank, src):
    """Output and LSE (natural log, -inf where a row sees no key) equal the dense-mask math;
    v has its own head dim (MLA) and 2 kv heads for 4 query heads (GQA)."""
    band, tokens = _band(thd, window, causal, rank, src)
    if band is None:
        pytest.skip("block wholly outside the window")
    q, k, v = _qkv(thd, tokens, dv=8)
    out, lse = flex_band.fwd(q, k, v, band, 0.25)
    ref_out, ref_lse = _math_band_fwd(q, k, v, band.dense(), 0.25)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(lse, ref_lse, **FP32)


def _math_block(mask: torch.Tensor, scale: float):
    """A differentiable band-masked block in [b, h, s, d] returning (o_b, lse_b)."""
    def block(q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, 1) for x in (k, v))
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - torch.nan_to_num(lse, neginf=0.0).unsqueeze(-1))
        return p @ v, lse
    return block


def test_share_of_merge_grads_equals_the_exact_block_backward():
    """Two blocks of one query set (keys before and inside the window), merged: each block's
    share of the gradients through its own (o_b, lse_b) equals the exact backward with the
    final out and LSE, and the shares sum to the gradient of the whole attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 12, 16, generator=gen)
    ks = [torch.randn(1, 2, 12, 16, generator=gen) for _ in range(2)]
    vs = [torch.randn(1, 2, 12, 8, generator=gen) for _ in range(2)]
    pos = torch.arange(12)
    masks = [(pos.view(-1, 1) + 12 - pos.view(1, -1)) <= 14, pos.view(-1, 1) >= pos.view(1, -1)]
    masks[0][0] = False  # row 0 sees no key of block 0: it has no share there
    blocks = [_math_block(m, 0.3) for m in masks]
    parts = [b(q, k, v) for b, k, v in zip(blocks, ks, vs)]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(torch.exp(l_b - lse).unsqueeze(-1) * o_b for o_b, l_b in parts)
    dout = torch.randn(out.shape, generator=gen)

    to_sbhd = lambda x: x.permute(2, 0, 1, 3)  # noqa: E731
    for block, mask, k, v in zip(blocks, masks, ks, vs):
        got = flex_band.share_of_merge_grads(block, q, k, v, dout, out, lse)
        want = _math_band_bwd(*(to_sbhd(x) for x in (dout, q, k, v, out)), lse, mask, 0.3)
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(to_sbhd(g), w, **FP32, msg=lambda m, n=name: f"d{n}: {m}")

    leaves = [x.clone().requires_grad_() for x in (q, *ks, *vs)]
    (o0, l0), (o1, l1) = (b(leaves[0], leaves[1 + i], leaves[3 + i]) for i, b in enumerate(blocks))
    merged_lse = torch.logaddexp(l0, l1)
    merged = torch.exp(l0 - merged_lse).unsqueeze(-1) * o0 + torch.exp(l1 - merged_lse).unsqueeze(-1) * o1
    want_dq = torch.autograd.grad(merged, leaves[0], dout)[0]
    dq_sum = sum(flex_band.share_of_merge_grads(b, q, k, v, dout, out, lse)[0] for b, k, v in zip(blocks, ks, vs))
    torch.testing.assert_close(dq_sum, want_dq, **FP32)


def test_a_shape_flex_cannot_run_warns_once_and_falls_back(monkeypatch):
    """try_run returns None with one warning, and does not try that shape/dtype again."""
    monkeypatch.setattr(flex_band, "_FAILED", set())
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no kernel for head dim 24")

    q, k, v = _qkv(False, 4, dv=24)
    with pytest.warns(UserWarning, match="FlexAttention failed"):
        assert flex_band.try_run(broken, q, k, v, None, 1.0) is None
    assert flex_band.try_run(broken, q, k, v, None, 1.0) is None and len(calls) == 1
    assert not flex_band.wanted(q, None)  # CPU: exact math


@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
@pytest.mark.parametrize("window,causal", [(Window(150, None), True), (Window(40, 300), False),
                                           (Window(None, 0), False)], ids=["causal", "two-sided", "right-only"])
@pytest.mark.parametrize("rank,src", [(0, 0), (1, 0), (1, 1)])
def test_tiles_cover_the_band_and_full_tiles_lie_inside_it(thd, window, causal, rank, src):
    """Every 128 x 128 tile with a pair the dense mask allows is partial or full; every full
    tile is allowed throughout; a tile neither is wholly outside (cp=2, 1040 tokens: several
    tiles per block, sequences of 300, 260 and 480 tokens that cross tile borders)."""
    cu = torch.tensor([0, 300, 560, 1040]) if thd else None
    band = Band(window, causal, local_seq(520, 2, cu, 480 if thd else None), rank, "cpu").block(src)
    if band is None:
        pytest.skip("block wholly outside the window")
    partial, full = flex_band.block_tiles(band)
    dense = band.dense()
    nq, nk = partial.shape
    tiles = torch.nn.functional.pad(dense, (0, nk * 128 - dense.shape[1], 0, nq * 128 - dense.shape[0]))
    tiles = tiles.view(nq, 128, nk, 128)  # entries past the block's end: False
    assert torch.equal(partial | full, partial | full | tiles.any(3).any(1))  # no allowed pair left out
    assert not (partial & full).any()
    rows, cols = dense.shape
    within = torch.zeros(nq * 128, nk * 128, dtype=torch.bool)
    within[:rows, :cols] = True
    allowed_or_outside = (tiles | ~within.view(nq, 128, nk, 128)).all(3).all(1)
    assert torch.equal(full & allowed_or_outside, full)
    if not thd and causal and rank == src:  # the diagonal block of a 150-token window has inner tiles
        assert full.any() and partial.any() and not (partial | full).all()

    q, k, v = _qkv(thd, 520, dv=8)
    out, lse = flex_band.fwd(q, k, v, band, 0.25)
    ref_out, ref_lse = _math_band_fwd(q, k, v, dense, 0.25)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(lse, ref_lse, **FP32)


def test_first_shapes_get_their_own_kernels_and_later_ones_share_a_dynamic_one(monkeypatch):
    """CUDA routing (no kernel runs here): the first STATIC_SHAPES keys (shapes, dtype, window)
    go to the shape-specialised compiled function, a key seen before keeps it, and every new
    key after that goes to the one dynamic-shape function."""
    from types import SimpleNamespace

    monkeypatch.setattr(flex_band, "_STATIC_KEYS", set())
    band = SimpleNamespace(window=Window(4, None), causal=True, q=(None, None))

    def call(tokens):
        q = SimpleNamespace(device=torch.device("cuda"), shape=(1, 4, tokens, 16), dtype=torch.bfloat16)
        kv = SimpleNamespace(shape=(1, 2, tokens, 16))
        return flex_band._attention(q, kv, kv, band)

    static, dynamic = flex_band._compiled(False), flex_band._compiled(True)
    assert static is not dynamic
    assert [call(t) for t in range(100, 100 + flex_band.STATIC_SHAPES)] == [static] * flex_band.STATIC_SHAPES
    assert call(5000) is dynamic and call(6000) is dynamic
    assert call(100) is static  # a shape with its own kernel keeps it


@pytest.mark.parametrize("wrapper", ["_flex_static", "_flex_dynamic"])
def test_compiled_wrappers_call_nothing_behind_an_lru_cache(wrapper):
    """Dynamo traces the FlexAttention wrappers; had they called a functools.lru_cache-wrapped
    function, it would trace through the cache and warn ("silent incorrectness is a potential
    risk"). Traced here with the eager backend on CPU: no such warning, and the result is
    FlexAttention's."""
    import warnings

    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(0))
    fn = getattr(flex_band, wrapper)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = torch.compile(fn, backend="eager", dynamic=wrapper == "_flex_dynamic")(q, q, q)
    assert not [w for w in record if "lru_cache" in str(w.message)], [str(w.message) for w in record]
    torch.testing.assert_close(got, flex_band._FLEX.flex_attention(q, q, q), **FP32)


def test_a_wrapper_at_dynamos_recompile_limit_is_replaced_never_run_uncompiled(monkeypatch):
    """FlexAttention uncompiled is its unfused path ([s_q, s_k] scores in memory), and dynamo runs
    a function uncompiled once its compiled variants reach the recompile limit; one wrapper
    collects variants beyond its keys (strides, grad mode). Here (CPU, dynamo with the eager
    backend, a recompile limit of 1) a second variant through the same wrapper gets a fresh
    wrapper of its kind: FlexAttention stays traced (it warns "called without torch.compile"
    otherwise) and the result is FlexAttention's."""
    import functools
    import warnings

    from torch.nn.attention import flex_attention as module

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(flex_band, "_COMPILED", {})
    torch._dynamo.reset()
    first = flex_band._compiled(False)
    gen = torch.Generator().manual_seed(0)
    dense, strided = torch.randn(1, 2, 128, 16, generator=gen), torch.randn(1, 2, 16, 128, generator=gen).mT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = {id(q): module.flex_attention(q, q, q) for q in (dense, strided)}  # uncompiled: it warns
    monkeypatch.setattr(module, "_WARNINGS_SHOWN", set(), raising=False)  # its warnings come once
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile.*")
        for q in (dense, strided, dense):
            got = flex_band._run_compiled(flex_band._compiled(False), lambda fn: fn(q, q, q))
            torch.testing.assert_close(got, want[id(q)], **FP32)
    assert flex_band._compiled(False) is not first  # the second variant's wrapper took over


@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
def test_the_strided_and_dense_forms_of_one_block_share_one_compiled_graph(thd, monkeypatch):
    """a2a hands the kernel q, k, v as views split out of one packed buffer; the other comm types
    hand dense tensors. Dynamo specialises on strides, so each form of one shape compiled its own
    kernels (the gpu1 conformance matrix runs both: seconds per compile). Here (CPU, dynamo with
    the eager backend) the strided form after the dense one compiles no new graph, and both
    equal FlexAttention's uncompiled result."""
    import functools

    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(flex_band, "_COMPILED", {})
    torch._dynamo.reset()
    band, tokens = _band(thd, Window(5, None), True, 1, 0)
    dense = _qkv(thd, tokens, dv=16)
    lead = (tokens,) if thd else (tokens, 2)
    buf = torch.cat([x.flatten(-2) for x in dense], dim=-1)  # one packed buffer, as a2a receives it
    strided = [x.unflatten(-1, (h, 16)) for x, h in zip(buf.split([64, 32, 32], dim=-1), (4, 2, 2))]
    assert not strided[0].is_contiguous() and strided[0].shape == dense[0].shape and lead == dense[0].shape[:-2]
    want = flex_band.fwd(*dense, band, 0.25)  # uncompiled on CPU
    monkeypatch.setattr(flex_band, "_attention", lambda q, k, v, band: flex_band._compiled(False))
    graphs = []
    for form in (dense, strided):
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        got = flex_band.fwd(*form, band, 0.25)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"] - before)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **FP32)
    assert graphs == [1, 0], f"graphs compiled by the dense, then the strided form: {graphs}"
