"""The device paths on one GPU (marker gpu1; skipped with the reason where no CUDA device is
visible): the LSE merge of key blocks in fp32 and bf16 (sbhd and THD), sharding of tensors that
live on the GPU, ContextParallelAttention at cp=1 against MCore's local DotProductAttention, and
against Transformer Engine's DotProductAttention where TE is importable. The kernels one by one
(with their LSE) and the varlen THD kernel are tested in functional/test_attention.py
(`test_cuda_kernel_matches_math`, `test_cuda_varlen_kernel_matches_dense_per_sequence`).

References are computed in float32 on the same (rounded) inputs. Tolerances, per dtype:
- fp32: rtol = atol = 1e-4 (the fused kernels and MCore's baddbmm + softmax reduce in another
  order; TF32 is off, torch's default for matmuls).
- bf16: rtol = 2e-2 and atol = 2e-2 x the reference's largest magnitude (one rounding of each
  block's output to bf16), as in functional/test_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from cpkit.attention.kernels import attn_fwd
from cpkit.attention.merge import merge, merge_
from cpkit.sharding import gather_seq, gather_thd, pad_cu_seqlens, position_ids, shard_seq, shard_thd

pytestmark = [pytest.mark.gpu1, pytest.mark.usefixtures("flex_compiled")]  # functional/conftest.py

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCALE = 0.125


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    want = want.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item(),
                                   msg=lambda m: f"{what}: {m}")


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to("cuda", dtype)


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_merge_of_key_blocks_matches_full_attention(dtype_name, layout):
    """Attention over three key blocks, merged by their LSEs (merge and the in-place merge_ the
    ring uses, with a running output in the input dtype), equals attention over all keys; also
    into the second half of the running tensors (views, as the ring merges its second query
    chunk), the first half untouched."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(11)
    tokens, bounds = 768, [0, 100, 352, 768]
    if layout == "sbhd":
        q = _randn(tokens, 2, 8, 64, dtype=dtype, gen=gen)
        k, v = (_randn(tokens, 2, 2, 64, dtype=dtype, gen=gen) for _ in range(2))
    else:
        q = _randn(tokens, 8, 64, dtype=dtype, gen=gen)
        k, v = (_randn(tokens, 2, 64, dtype=dtype, gen=gen) for _ in range(2))

    def attend(kb, vb, inputs_dtype, kernel=None):
        args = [x.to(inputs_dtype) for x in (q, kb, vb)]
        if layout == "sbhd":
            return attn_fwd(*args, False, SCALE, kernel=kernel)
        cu_q = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, kb.shape[0]], dtype=torch.int32, device="cuda")
        return attn_fwd(*args, False, SCALE, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=tokens, max_seqlen_k=kb.shape[0], kernel=kernel)

    blocks = [attend(k[a:b], v[a:b], dtype) for a, b in zip(bounds[:-1], bounds[1:])]
    want_out, want_lse = attend(k, v, torch.float32, kernel="math")

    out, lse = merge([o for o, _ in blocks], [l for _, l in blocks])
    assert out.dtype == lse.dtype == torch.float32 and out.device.type == "cuda"
    _close(out, want_out, dtype, "merge out")
    torch.testing.assert_close(lse, want_lse, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)

    running, running_lse = blocks[0][0].clone(), blocks[0][1].clone()
    for o, l in blocks[1:]:
        merge_(running, running_lse, o, l)
    assert running.dtype == dtype
    _close(running, want_out, dtype, "merge_ out")
    torch.testing.assert_close(running_lse, want_lse, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)
    # Into views: the second half of the rows, merged into the running tensors' second half.
    half = tokens // 2
    first = [(o.narrow(0, 0, half), l.narrow(-1, 0, half)) for o, l in blocks]
    second = [(o.narrow(0, half, half), l.narrow(-1, half, half)) for o, l in blocks]
    running = torch.cat([first[0][0], second[0][0]]).clone()
    running_lse = torch.cat([first[0][1], second[0][1]], dim=-1).clone()
    for o, l in second[1:]:
        merge_(running.narrow(0, half, half), running_lse.narrow(-1, half, half), o, l)
    torch.testing.assert_close(running[:half], first[0][0], rtol=0, atol=0)  # rows not merged: untouched
    _close(running[half:], want_out[half:], dtype, "merge_ into a view")
    torch.testing.assert_close(running_lse[..., half:], want_lse[..., half:],
                               rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_sharding_on_device_matches_cpu(cp_size):
    """shard_seq / shard_thd of a GPU tensor give, on the GPU, the CPU result, and gathering the
    shards restores the input."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4 * cp_size * 8, 2, 3, generator=gen)
    shards = [shard_seq(x.cuda(), r, cp_size, seq_dim=0) for r in range(cp_size)]
    for r, shard in enumerate(shards):
        assert shard.device.type == "cuda"
        torch.testing.assert_close(shard.cpu(), shard_seq(x, r, cp_size, seq_dim=0), rtol=0, atol=0)
        torch.testing.assert_close(position_ids(x.shape[0], r, cp_size, device="cuda").cpu(),
                                   position_ids(x.shape[0], r, cp_size))
    torch.testing.assert_close(gather_seq(shards, seq_dim=0).cpu(), x, rtol=0, atol=0)

    cu = pad_cu_seqlens([5, 17, 2 * cp_size, 31], cp_size)
    t = torch.randn(int(cu[-1]), 4, 8, generator=gen)
    thd = [shard_thd(t.cuda(), cu.cuda(), r, cp_size) for r in range(cp_size)]
    for r, shard in enumerate(thd):
        assert shard.device.type == "cuda"
        torch.testing.assert_close(shard.cpu(), shard_thd(t, cu, r, cp_size), rtol=0, atol=0)
    torch.testing.assert_close(gather_thd(thd, cu.cuda()).cpu(), t, rtol=0, atol=0)


def _config(dtype, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2,
              attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=1,
              bf16=dtype == torch.bfloat16, params_dtype=dtype)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _assert_module_matches(ours, theirs, dtype, seed):
    """`ours(q, k, v)` against `theirs(q, k, v)` on the same sbhd GQA inputs (8 q / 2 kv heads of
    64, 512 x 2 tokens): the output and dq, dk, dv within the dtype's tolerance."""
    gen = torch.Generator().manual_seed(seed)
    q = _randn(512, 2, 8, 64, dtype=dtype, gen=gen).requires_grad_()
    k, v = (_randn(512, 2, 2, 64, dtype=dtype, gen=gen).requires_grad_() for _ in range(2))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, ref = ours(q, k, v), theirs(q2, k2, v2)
    assert out.shape == ref.shape == (512, 2, 8 * 64)
    _close(out, ref, dtype, "out")
    dout = _randn(*out.shape, dtype=dtype, gen=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), dout)
    for name, got, want in zip("qkv", grads, ref_grads):
        _close(got, want, dtype, f"d{name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_module_at_cp1_matches_mcore_local_attention(world1, dtype_name, causal):
    """ContextParallelAttention at cp=1 on the GPU: MCore's DotProductAttention's output and
    gradients (sbhd, GQA)."""
    from cpkit.mcore_cpu import mcore_on_cuda

    with mcore_on_cuda():  # this process may have run CPU tests under the shim before
        _module_at_cp1_matches_mcore_local_attention(dtype_name, causal)


def _module_at_cp1_matches_mcore_local_attention(dtype_name, causal):
    import torch.distributed as dist
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from cpkit.attention.module import ContextParallelAttention
    from cpkit.compat import new_pg_collection

    dtype = DTYPES[dtype_name]
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    config = _config(dtype)
    group = dist.new_group([0])
    ours = ContextParallelAttention(config, 1, mask, "self", pg_collection=new_pg_collection(tp=group, cp=group))
    theirs = DotProductAttention(config, 1, mask, "self", pg_collection=new_pg_collection(tp=group))
    _assert_module_matches(lambda q, k, v: ours(q, k, v, None, attn_mask_type=mask),
                           lambda q, k, v: theirs(q, k, v, None, attn_mask_type=mask), dtype, seed=13)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
def test_module_at_cp1_matches_transformer_engine(world1, causal):
    """ContextParallelAttention at cp=1 against TE's DotProductAttention (bf16, sbhd, GQA), where
    TE is importable."""
    from cpkit.testing.te_support import te_skip_reason

    reason = te_skip_reason()
    if reason:
        pytest.skip(reason)
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from megatron.core.transformer.enums import AttnMaskType

    from cpkit.attention.module import ContextParallelAttention
    from cpkit.compat import new_pg_collection

    dtype = torch.bfloat16
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    group = dist.new_group([0])
    ours = ContextParallelAttention(_config(dtype), 1, mask, "self",
                                    pg_collection=new_pg_collection(tp=group, cp=group))
    theirs = te.DotProductAttention(8, 64, num_gqa_groups=2, attention_dropout=0.0, qkv_format="sbhd",
                                    attn_mask_type="causal" if causal else "no_mask", softmax_scale=SCALE)
    _assert_module_matches(lambda q, k, v: ours(q, k, v, None, attn_mask_type=mask), theirs, dtype, seed=14)


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal_window", "two_sided_window"])
def test_band_block_on_flex_attention_matches_dense_math(causal, dtype_name, layout):
    """A sliding-window block of the ring (rank 1's queries against rank 0's keys at cp=2)
    through FlexAttention (the CUDA path of band_fwd/band_bwd) equals the dense-mask math:
    output, LSE and dq/dk/dv given the final out and LSE, with GQA and an MLA v head dim; and
    FlexAttention really ran (no fallback to math)."""
    from cpkit.attention import flex_band
    from cpkit.attention.band import Band, Window, band_bwd, band_fwd
    from cpkit.attention.chunks import local_seq

    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 256, 384, 1024], device="cuda") if layout == "thd" else None
    seq = local_seq(512, 2, cu, 640 if cu is not None else None)
    window = Window(100, None) if causal else Window(60, 90)
    band = Band(window, causal, seq, 1, "cuda").block(0)
    lead = (512,) if layout == "thd" else (512, 2)
    q = _randn(*lead, 8, 64, dtype=dtype, gen=gen)
    k = _randn(*lead, 2, 64, dtype=dtype, gen=gen)
    v = _randn(*lead, 2, 32, dtype=dtype, gen=gen)
    dout = _randn(*lead, 8, 32, dtype=dtype, gen=gen)
    flex_band._FAILED.clear()

    out, lse = band_fwd(q, k, v, band, SCALE)
    want_out, want_lse = band_fwd(*(x.float() for x in (q, k, v)), band, SCALE, kernel="math")
    assert not flex_band._FAILED, "FlexAttention fell back to math"
    _close(out, want_out, dtype, "band out")
    seen = torch.isfinite(want_lse)  # rows with no key in this block: -inf in both
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)

    grads = band_bwd(dout, q, k, v, want_out.to(dtype), want_lse, band, SCALE)
    want = band_bwd(*(x.float() for x in (dout, q, k, v, want_out)), want_lse, band, SCALE, kernel="math")
    assert not flex_band._FAILED, "FlexAttention fell back to math in the backward"
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        _close(got, ref, dtype, name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal_window", "two_sided_window"])
def test_a_thd_band_block_on_the_dynamic_shape_kernel_matches_dense_math(causal, monkeypatch):
    """Past STATIC_SHAPES shapes every band block runs on the one dynamic-shape kernel (packed
    batches of ever-new lengths): a THD block there also runs on FlexAttention, equal to the
    dense-mask math, forward and backward. Its two-sided window failed to lower on torch 2.11
    with the window's bounds as Python ints; which kernel ran depended on the cases before."""
    from cpkit.attention import flex_band
    from cpkit.attention.band import Band, Window, band_bwd, band_fwd
    from cpkit.attention.chunks import local_seq

    monkeypatch.setattr(flex_band, "STATIC_SHAPES", 0)
    monkeypatch.setattr(flex_band, "_STATIC_KEYS", set())
    monkeypatch.setattr(flex_band, "_FAILED", set())
    gen = torch.Generator().manual_seed(7)
    seq = local_seq(512, 2, torch.tensor([0, 256, 384, 1024], device="cuda"), 640)
    band = Band(Window(100, None) if causal else Window(60, 90), causal, seq, 1, "cuda").block(0)
    q, k, v, dout = (_randn(512, h, d, dtype=torch.float32, gen=gen) for h, d in ((8, 64), (2, 64), (2, 32), (8, 32)))
    out, lse = band_fwd(q, k, v, band, SCALE)
    want_out, want_lse = band_fwd(q, k, v, band, SCALE, kernel="math")
    grads = band_bwd(dout, q, k, v, want_out, want_lse, band, SCALE)
    want = band_bwd(dout, q, k, v, want_out, want_lse, band, SCALE, kernel="math")
    assert not flex_band._FAILED, "FlexAttention fell back to math"
    _close(out, want_out, torch.float32, "band out")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        _close(got, ref, torch.float32, name)


def test_band_blocks_of_ever_new_packings_compile_a_bounded_number_of_times():
    """Packed batches change length every micro-batch: ten THD packings of different totals run
    through FlexAttention with at most STATIC_SHAPES shape-specialised compilations and then
    one dynamic-shape kernel (a couple of graphs), never falling back, and the last packing
    (on the dynamic kernel) still equals the dense-mask math (bf16 tolerance)."""
    from torch._dynamo.utils import counters

    from cpkit.attention import flex_band
    from cpkit.attention.band import Band, Window, band_fwd
    from cpkit.attention.chunks import local_seq

    gen = torch.Generator().manual_seed(9)
    flex_band._FAILED.clear()
    flex_band._STATIC_KEYS.clear()
    torch._dynamo.reset()  # count this test's compilations only
    before = counters["stats"]["unique_graphs"]
    for i in range(10):
        lens = torch.tensor([256 + 64 * i, 128, 512 + 32 * i])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to("cuda")
        tokens = int(cu[-1]) // 2
        band = Band(Window(100, None), True, local_seq(tokens, 2, cu, int(lens.max())), 1, "cuda").block(0)
        q = _randn(tokens, 8, 64, dtype=torch.bfloat16, gen=gen)
        k, v = (_randn(tokens, 2, 64, dtype=torch.bfloat16, gen=gen) for _ in range(2))
        out, _ = band_fwd(q, k, v, band, SCALE)
    compiled = counters["stats"]["unique_graphs"] - before
    bound = flex_band.STATIC_SHAPES + 2
    assert not flex_band._FAILED and flex_band.STATIC_SHAPES <= compiled <= bound, f"{compiled} graphs for 10 packings"
    want, _ = band_fwd(*(x.float() for x in (q, k, v)), band, SCALE, kernel="math")
    _close(out, want, torch.bfloat16, "band out, last packing")
