"""Kernel conformance on one GPU (marker gpu1): every CUDA kernel choice gets every input form a
comm type can hand a kernel, forward and backward, against exact float32 math written here.

Why: a kernel adapter either computes every form its callers produce or refuses it with a clear
error. `a2a` and `a2a+p2p` hand the kernel q, k, v (and the gradient of the output) as strided
views split out of one packed all-to-all buffer; the other comm types hand dense tensors. A test
that feeds only dense tensors cannot see a kernel that assumes densely packed rows.

Kernel choices (`CPAttentionOptions.kernel`, no fallback where forced):
- `cudnn_fe` (the cuDNN frontend; skipped with the reason where it does not import), `cudnn`
  (torch's cuDNN SDPA, dense only), `flash`, `efficient` and `math` through
  `kernels.attn_fwd` / `attn_bwd`;
- windows go through `band.band_fwd` / `band_bwd`: `cudnn_fe`, FlexAttention (`flex`: the band
  with a forced torch kernel, which takes band blocks to FlexAttention) and `math`.

Forms: sbhd dense; sbhd strided (views of one packed [s, b, heads*dims] buffer, as a2a makes
them); THD densely packed; THD strided (views of one packed [t, heads*dims] buffer, the
gradient of the output a view too). Features on each: GQA (8 query heads over 2 kv heads)
throughout; MLA head dims 192/128; sink logits (off-by-one and learnable); a causal window and
two two-sided windows (one wide enough that cuDNN's backward takes it as a staircase,
`cudnn_fe.staircase`). THD packings, adversarial ones included:
- `mixed`: 300, 1, 724, 512, 511 tokens (a one-token sequence among long ones);
- `short`: sequences shorter than 2*cp before padding, padded to 2*cp = 8: lengths 8 (a CP
  half-chunk of one real token and the rest padding, TE #2186's case is a half-chunk that is
  all padding: here the padding tokens are ordinary tokens of their sequence, as cpkit packs);
- `tail`: one long sequence followed by a sequence that is only tail padding (TE #3331).

Tolerances, per dtype (one rounding of each output and gradient to the input dtype, the kernel
reducing in its own order): bf16 rtol = 2e-2, atol = 2e-2 x the reference's largest magnitude;
fp16 5e-3 likewise; the float32 LSE rtol = atol = the dtype's tolerance; d sink rtol 2e-2, atol
2e-2 x the largest |d sink|.
"""

from __future__ import annotations

import itertools
import warnings
import zlib

import pytest
import torch

from cpkit.attention import cudnn_fe, flex_band
from cpkit.attention.band import Band, Window, band_bwd, band_fwd
from cpkit.attention.chunks import local_seq
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.attention.sink import sink_grad
from cpkit.testing.reference import masked_block_reference

pytestmark = [pytest.mark.gpu1, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("flex_compiled")]  # nor FlexAttention run uncompiled: functional/conftest.py

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
SCALE = 0.125
HEADS, KV_HEADS = 8, 2
PACKINGS = {"mixed": [300, 1, 724, 512, 511], "short": [8, 8, 8, 8, 8, 8], "tail": [1000, 24]}
FEATURES = {
    # name: (causal, (lo, hi) allowed query-minus-key distances or None, sink kind, (d_qk, d_v))
    "causal": (True, None, None, (64, 64)),
    "no-mask": (False, None, None, (64, 64)),
    "mla": (True, None, None, (192, 128)),
    "sink-off-by-one": (True, None, "off-by-one", (64, 64)),
    "sink-learnable": (True, None, "learnable", (64, 64)),
    "window-causal": (True, (0, 99), None, (64, 64)),
    "window-two-sided": (False, (-30, 50), None, (64, 64)),
    "window-two-sided-wide": (False, (-300, 200), None, (64, 64)),  # cuDNN's backward: a staircase
}
FORMS = ("sbhd", "sbhd-strided", "thd", "thd-strided")
DENSE_KERNELS = ("cudnn_fe", "cudnn", "flash", "efficient", "math")
BAND_KERNELS = ("cudnn_fe", "flex", "math")


def _cases():
    for feature, form in itertools.product(FEATURES, FORMS):
        windowed = FEATURES[feature][1] is not None
        for kernel in BAND_KERNELS if windowed else DENSE_KERNELS:
            if kernel == "cudnn" and form.startswith("thd"):
                continue  # torch's cuDNN SDPA has no varlen entry: THD loops over sequences on it only by fallback
            packings = list(PACKINGS) if form.startswith("thd") else ["-"]
            for packing in packings:
                yield pytest.param(feature, form, kernel, packing, id=f"{kernel}-{form}-{feature}-{packing}")


def _skip_unavailable(kernel):
    if kernel == "cudnn_fe" and not cudnn_fe.available():
        pytest.skip(f"nvidia-cudnn-frontend is not importable: {cudnn_fe.INSTALL_HINT}")
    if kernel == "flex" and not flex_band.wanted(torch.empty(0, device="cuda"), "flash"):
        pytest.skip("this torch has no FlexAttention")


def _positions(form, packing, tokens):
    """(position in its sequence, sequence id) of every token, from the lengths alone."""
    if form.startswith("sbhd"):
        return torch.arange(tokens), torch.zeros(tokens, dtype=torch.long)
    lengths = PACKINGS[packing]
    pos = torch.cat([torch.arange(n) for n in lengths])
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return pos, seg


def _packed(lead, parts, dtype, gen, strided):
    """Tensors [*lead, heads, dim] for `parts` = [(heads, dim), ...]: independent dense ones, or
    (`strided`) views split out of one packed [*lead, sum(heads * dim)] buffer, the way a2a's
    all-to-all hands them to the kernel (row stride = the whole buffer's width)."""
    if not strided:
        return [torch.randn(*lead, h, d, generator=gen).to("cuda", dtype) for h, d in parts]
    width = sum(h * d for h, d in parts)
    buf = torch.randn(*lead, width, generator=gen).to("cuda", dtype)
    views = buf.split([h * d for h, d in parts], dim=-1)
    return [x.unflatten(-1, part) for x, part in zip(views, parts)]


def _to_bhsd(x, thd):
    return x.permute(1, 0, 2).unsqueeze(0) if thd else x.permute(1, 2, 0, 3)


def _from_bhsd(x, thd):
    return x[0].permute(1, 0, 2) if thd else x.permute(2, 0, 1, 3)


def _close(got, want, tol, what):
    want = want.float()
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(want.abs().max().item(), 1e-6),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feature,form,kernel,packing", list(_cases()))
def test_kernel_computes_every_input_form(feature, form, kernel, packing, dtype):
    """One block that is the whole attention through the forced kernel: forward with LSE (a
    sink folded in), backward from that output and LSE, d sink from the LSE. A refusal must be
    a clear error (ValueError / NotImplementedError naming the form), never a wrong result."""
    _skip_unavailable(kernel)
    causal, distances, sink_kind, (d_qk, d_v) = FEATURES[feature]
    thd, strided = form.startswith("thd"), form.endswith("strided")
    tol = TOL[dtype]
    tokens = sum(PACKINGS[packing]) if thd else 1024
    lead = (tokens,) if thd else (tokens, 2)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{feature}/{form}/{packing}".encode()))
    q, k, v = _packed(lead, [(HEADS, d_qk), (KV_HEADS, d_qk), (KV_HEADS, d_v)], dtype, gen, strided)
    dout = _packed(lead, [(HEADS, d_v), (1, 16)], dtype, gen, strided)[0]  # strided: a view of a wider buffer
    sink = None
    if sink_kind == "off-by-one":
        sink = torch.zeros(HEADS, device="cuda", dtype=dtype)
    elif sink_kind == "learnable":
        sink = torch.linspace(-2.0, 2.0, HEADS, device="cuda").to(dtype)

    pos, seg = _positions(form, packing, tokens)
    diff = pos.view(-1, 1) - pos.view(1, -1)
    allowed = seg.view(-1, 1) == seg.view(1, -1)
    if causal:
        allowed &= diff >= 0
    if distances is not None:
        allowed &= (diff >= distances[0]) & (diff <= distances[1])
    want = masked_block_reference(*(_to_bhsd(x, thd) for x in (q, k, v, dout)), sink, allowed, scale=SCALE)

    kw, cu = {}, None
    if thd:
        lengths = PACKINGS[packing]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    with warnings.catch_warnings():
        # a forced kernel that silently hands the block to another is not the kernel under test
        # (FlexAttention's fallback to exact math included: on a supported GPU every band block
        # compiles, src/cpkit/attention/flex_band.py::_mask_mod says what failed before)
        warnings.filterwarnings("error", message=".*(refused|failed|falling back|looping).*")
        flex_band._FAILED.clear()
        try:
            out, lse, grads = _run(q, k, v, dout, causal, distances, sink, kernel, tokens, cu, packing, kw)
        except (ValueError, NotImplementedError) as exc:  # a clear refusal is conformant
            pytest.skip(f"{kernel} refuses {form} {feature}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    assert not flex_band._FAILED, f"FlexAttention fell back to exact math for {sorted(flex_band._FAILED)}"
    _check(out, lse, grads, (q, k, v), dout, sink, want, thd, tol)


@pytest.mark.parametrize("routing", ["specialised", "dynamic"])
@pytest.mark.parametrize("feature", ["window-causal", "window-two-sided-wide"])
def test_a_short_thd_block_runs_on_flex_attention_whichever_kernel_it_is_routed_to(feature, routing, monkeypatch):
    """The `short` packing's THD block (48 queries) on FlexAttention, routed to a kernel
    specialised to its shape or to the shared dynamic-shape one (flex_band._attention decides
    by the shapes its process compiled before). Either must compile and equal exact math: on
    torch 2.11 inductor's decoding kernel, which it picks for blocks of under 128 queries, found
    no config for this block, so the conformance case above passed or fell back to dense math
    depending on which cases its xdist worker had run first (1x H200, 4 workers)."""
    _skip_unavailable("flex")
    monkeypatch.setattr(flex_band, "_STATIC_KEYS", set())
    monkeypatch.setattr(flex_band, "STATIC_SHAPES", 0 if routing == "dynamic" else 1)
    test_kernel_computes_every_input_form(feature, "thd", "flex", "short", torch.bfloat16)


def _run(q, k, v, dout, causal, distances, sink, kernel, tokens, cu, packing, kw):
    """(out, lse, (dq, dk, dv)) of the block through `kernel`."""
    if distances is None:
        out, lse = attn_fwd(q, k, v, causal, SCALE, kernel=kernel, sink=sink, **kw)
        return out, lse, attn_bwd(dout, q, k, v, out, lse, causal, SCALE, kernel=kernel, **kw)
    left, right = distances[1], (None if causal else -distances[0])
    seq = local_seq(tokens, 1, None if cu is None else cu.long(), None if cu is None else max(PACKINGS[packing]))
    mask = Band(Window(left, right), causal, seq, 0, "cuda").block(0)
    forced = "flash" if kernel == "flex" else kernel  # a forced torch kernel takes band blocks to FlexAttention
    out, lse = band_fwd(q, k, v, mask, SCALE, forced, sink=sink)
    return out, lse, band_bwd(dout, q, k, v, out, lse, mask, SCALE, forced)


def _check(out, lse, grads, inputs, dout, sink, want, thd, tol):
    """Every mismatch (out, lse, dq, dk, dv, d sink) reported at once."""
    errors = []

    def check(fn, *args):
        try:
            fn(*args)
        except AssertionError as exc:
            errors.append(str(exc).splitlines()[0] + " " + " ".join(str(exc).splitlines()[1:4]))
    check(_close, out, _from_bhsd(want[0], thd), tol, "out")
    lse_want = want[1][0] if thd else want[1]
    check(lambda: torch.testing.assert_close(lse, lse_want, rtol=tol, atol=tol, msg=lambda m: f"lse: {m}"))
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, want[2:5], inputs):
        assert got.shape == x.shape, f"{name}: shape {tuple(got.shape)} != {tuple(x.shape)}"
        check(_close, got, _from_bhsd(ref, thd), tol, name)
    if sink is not None:
        check(_close, sink_grad(dout, out, lse, sink), want[5], 2e-2, "dsink")
    assert not errors, "\n".join(errors)
