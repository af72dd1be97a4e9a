"""ContextParallelAttention, its layer spec and TE adapter, and the attention bench helpers, on CPU
in one process (world size 1).

Tolerance for cp=1 against MCore's DotProductAttention (fp32): rtol=atol=1e-5. Both compute the
same softmax(q k^T * scale) v in fp32; they differ only in the order of the reductions (MCore:
baddbmm + softmax + bmm; cpkit: a fused kernel or a blockwise exact-math path with an LSE).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from cpkit.attention.module import ContextParallelAttention
from cpkit.compat import new_pg_collection
from cpkit.errors import CPConfigError
from cpkit.mcore_cpu import mcore_cpu_shim

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def groups(world1):
    """Two distinct world-size-1 gloo groups (conftest's world1 initializes torch.distributed),
    and MCore's global memory buffer, which MCore on CUDA needs too (the CPU shim no longer
    creates it on demand)."""
    from cpkit.compat import ensure_global_memory_buffer

    ensure_global_memory_buffer()
    return dist.new_group([0]), dist.new_group([0])


def make_config(**overrides) -> TransformerConfig:
    kw = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=1,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def make_attn(groups, *, config=None, mask=AttnMaskType.causal, layer_number=1, **kw):
    g, _ = groups
    return ContextParallelAttention(
        config or make_config(), layer_number, mask, "self",
        pg_collection=new_pg_collection(tp=g, cp=g), **kw,
    )


def qkv(s=16, b=2, h=4, kvh=2, d=16, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, h, d, generator=gen)
    k = torch.randn(s, b, kvh, d, generator=gen)
    v = torch.randn(s, b, kvh, d, generator=gen)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


# ------------------------------------------------------------------------------ build errors


def test_unknown_comm_type_raises(groups):
    with pytest.raises(CPConfigError) as err:
        make_attn(groups, cp_comm_type="ring")
    assert err.value.field == "cp_comm_type" and "a2a+p2p" in str(err.value)


def test_none_comm_type_means_p2p(groups):
    assert make_attn(groups, cp_comm_type=None).cp_comm_type == "p2p"


def test_attention_dropout_raises_unless_zero(groups):
    with pytest.raises(CPConfigError) as err:
        make_attn(groups, config=make_config(attention_dropout=0.1))
    assert err.value.field == "attention_dropout" and "attention_dropout=0.0" in str(err.value)
    # An explicit attention_dropout=0.0 overrides the config, as in MCore.
    make_attn(groups, config=make_config(attention_dropout=0.1), attention_dropout=0.0)


def test_a2a_p2p_without_hierarchical_groups_raises(groups):
    config = make_config(context_parallel_size=2, cp_comm_type="a2a+p2p")
    with pytest.raises(CPConfigError) as err:
        make_attn(groups, config=config, cp_comm_type="a2a+p2p")
    assert err.value.field == "pg_collection.hcp"


def test_a2a_p2p_with_a_single_hcp_group_raises(groups):
    g, _ = groups
    pgc = new_pg_collection(tp=g, cp=g, hcp=[g])
    config = make_config(context_parallel_size=2, cp_comm_type="a2a+p2p")
    with pytest.raises(CPConfigError, match="exactly two groups"):
        ContextParallelAttention(config, 1, AttnMaskType.causal, "self",
                                 cp_comm_type="a2a+p2p", pg_collection=pgc)


def test_cp_without_cp_group_raises(groups):
    g, _ = groups
    config = make_config(context_parallel_size=2)
    with pytest.raises(CPConfigError) as err:
        ContextParallelAttention(config, 1, AttnMaskType.causal, "self",
                                 pg_collection=new_pg_collection(tp=g))
    assert err.value.field == "pg_collection.cp"


def test_cp_group_size_must_match_config(groups):
    with pytest.raises(CPConfigError, match="context_parallel_size=2"):
        make_attn(groups, config=make_config(context_parallel_size=2))


def test_masks_that_need_a_tensor_raise(groups):
    with pytest.raises(CPConfigError) as err:
        make_attn(groups, mask=AttnMaskType.arbitrary)
    assert err.value.field == "attn_mask_type"
    # padding masks are only meaningful for THD (cu_seqlens delimit the sequences).
    attn = make_attn(groups, mask=AttnMaskType.padding_causal)
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(CPConfigError, match="only with THD") as err:
        attn(q, k, v, None)
    assert err.value.field == "attn_mask_type"


def test_unsupported_features_all_reported(groups):
    config = make_config(attention_dropout=0.1, qk_clip=True, qk_clip_alpha=0.5, qk_clip_threshold=100.0)
    with pytest.raises(CPConfigError) as err:
        ContextParallelAttention(config, 1, AttnMaskType.causal, "cross",
                                 pg_collection=new_pg_collection(tp=groups[0], cp=groups[0]))
    fields = {v.field for v in err.value.violations}
    assert fields == {"attention_dropout", "attention_type", "qk_clip"}


def test_window_follows_window_attn_skip_freq(groups):
    """The window applies on the layers MCore's window_attn_skip_freq selects, as in its own
    DotProductAttention: every layer but each 2nd here."""
    config = make_config(window_size=(4, 0), window_attn_skip_freq=2)
    assert [make_attn(groups, config=config, layer_number=n).window_size for n in (1, 2, 3)] == [(4, 0), None, (4, 0)]
    assert make_attn(groups).window_size is None


def test_softmax_offset_follows_softmax_type(groups):
    assert make_attn(groups).softmax_offset is None
    off = make_attn(groups, config=make_config(softmax_type="off-by-one", use_cpu_initialization=True))
    assert torch.equal(off.softmax_offset, torch.zeros(4)) and "softmax_offset" not in off.state_dict()
    learn = make_attn(groups, config=make_config(softmax_type="learnable", use_cpu_initialization=True))
    assert isinstance(learn.softmax_offset, torch.nn.Parameter) and learn.softmax_offset.shape == (4,)
    assert "softmax_offset" in learn.state_dict()


@pytest.mark.parametrize("window", [None, (3, 0)], ids=["full", "window3"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_cp1_matches_mcore_with_window_and_sinks(groups, window, softmax_type, monkeypatch):
    """cp=1 against MCore's own DotProductAttention (its FusedScaleMaskSoftmax window mask and
    SoftmaxOne sink column): output and dq, dk, dv, and the learnable sink's gradient."""
    config = make_config(window_size=window, softmax_type=softmax_type, use_cpu_initialization=True)
    attn = make_attn(groups, config=config)
    # MCore allocates its sink logits on torch.cuda.current_device(); this test runs on the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    ref_attn = DotProductAttention(config, 1, AttnMaskType.causal, "self",
                                   pg_collection=new_pg_collection(tp=dist.new_group([0])))
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
            ref_attn.softmax_offset.copy_(attn.softmax_offset)
    q, k, v = qkv()
    out = attn(q, k, v, None)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with mcore_cpu_shim():
        ref = ref_attn(q2, k2, v2, None, attn_mask_type=AttnMaskType.causal)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    dout = torch.randn_like(out)
    params = [attn.softmax_offset] if softmax_type == "learnable" else []
    ref_params = [ref_attn.softmax_offset] if softmax_type == "learnable" else []
    grads = torch.autograd.grad(out, (q, k, v, *params), dout)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2, *ref_params), dout)
    for name, got, want in zip(["q", "k", "v", "sink"], grads, ref_grads):
        torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_attention_bias_and_forward_mask_override_raise(groups):
    attn = make_attn(groups)
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(CPConfigError, match="attention bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(CPConfigError):
        attn(q, k, v, None, attn_mask_type=AttnMaskType.padding)


# ------------------------------------------------------------------------ cp=1 equivalence


def _mcore_reference(config, mask, layer_number, softmax_scale, q, k, v):
    g = dist.new_group([0])
    ref = DotProductAttention(config, layer_number, mask, "self", softmax_scale=softmax_scale,
                              pg_collection=new_pg_collection(tp=g))
    with mcore_cpu_shim():
        return ref(q, k, v, None, attn_mask_type=mask)


@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize(
    "scaling",
    [dict(), dict(softmax_scale=0.3), dict(apply_query_key_layer_scaling=True, layer_number=3)],
    ids=["default_scale", "explicit_scale", "qk_layer_scaling"],
)
def test_cp1_matches_mcore_dot_product_attention(groups, mask, kv_heads, scaling):
    scaling = dict(scaling)
    layer_number = scaling.pop("layer_number", 1)
    softmax_scale = scaling.pop("softmax_scale", None)
    config = make_config(num_query_groups=kv_heads, **scaling)
    attn = make_attn(groups, config=config, mask=mask, layer_number=layer_number,
                     softmax_scale=softmax_scale)
    assert attn.cp_size == 1

    q, k, v = qkv(kvh=kv_heads)
    out = attn(q, k, v, None, attn_mask_type=mask)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _mcore_reference(config, mask, layer_number, softmax_scale, q2, k2, v2)

    assert out.shape == ref.shape == (16, 2, 4 * 16)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), dout)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m, n=name: f"d{n}: {m}")


def _thd_reference(q, k, v, cu, causal):
    """Per-sequence attention with expanded KV heads, [t, h, d]."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "mask,causal",
    [(AttnMaskType.causal, True), (AttnMaskType.no_mask, False),
     (AttnMaskType.padding_causal, True), (AttnMaskType.padding, False)],
    ids=["causal", "no_mask", "padding_causal", "padding"],
)
def test_cp1_thd_matches_per_sequence_attention(groups, mask, causal):
    attn = make_attn(groups, mask=mask)
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    q, k, v = (t[:, 0] for t in qkv(s=16, b=1, requires_grad=False))
    q, k, v = (t.contiguous().requires_grad_() for t in (q, k, v))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=8, max_seqlen_kv=8)
    out = attn(q, k, v, None, packed_seq_params=psp)
    assert out.shape == (16, 4 * 16)  # MCore reshapes this to [t, 1, h*d]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _thd_reference(q2, k2, v2, cu, causal).reshape(16, -1)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout),
                         torch.autograd.grad(ref, (q2, k2, v2), dout)):
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_thd_padded_without_causal_mask_raises(groups):
    attn = make_attn(groups, mask=AttnMaskType.no_mask)
    q, k, v = (t[:, 0] for t in qkv(s=16, b=1, requires_grad=False))
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor([0, 3, 10], dtype=torch.int32),
        cu_seqlens_q_padded=torch.tensor([0, 4, 16], dtype=torch.int32),
    )
    with pytest.raises(CPConfigError, match="causal"):
        attn(q, k, v, None, packed_seq_params=psp)


# ---------------------------------------------------------------- group binding and override


def test_set_context_parallel_group_swaps_with_te_signature(groups):
    g1, g2 = groups
    attn = make_attn(groups)
    assert attn.cp_group is None and attn.cp_comm_type == "p2p"
    stream = object()
    attn.set_context_parallel_group(g1, [0], stream, "a2a")
    assert (attn.cp_group, attn.cp_global_ranks, attn.cp_stream, attn.cp_comm_type) == (g1, [0], stream, "a2a")
    attn.set_context_parallel_group([g1, g2], [0], None, "a2a+p2p")
    assert attn.cp_group == [g1, g2] and attn.cp_size == 1
    attn.set_context_parallel_group(None, None, None)  # TE's default comm type
    assert attn.cp_group is None and attn.cp_comm_type == "p2p"
    with pytest.raises(CPConfigError, match="only valid for a2a\\+p2p"):
        attn.set_context_parallel_group([g1, g2], [0], None, "p2p")
    with pytest.raises(CPConfigError, match="exactly two groups"):
        attn.set_context_parallel_group([g1], [0], None, "a2a+p2p")
    with pytest.raises(CPConfigError):
        attn.set_context_parallel_group(g1, [0], None, "allgather")


class _Spy:
    """Stands in for the kernel call: records the binding seen during forward."""

    def __init__(self, attn, error=None):
        self.attn, self.error, self.seen = attn, error, []

    def __call__(self, query, key, value, causal, cu_seqlens=None, max_seqlen=None):
        self.seen.append((self.attn.cp_group, self.attn.cp_comm_type))
        if self.error is not None:
            raise self.error
        return query


def test_packed_seq_params_cp_group_is_used_for_one_forward_then_restored(groups, monkeypatch):
    g1, g2 = groups
    attn = make_attn(groups)
    attn.set_context_parallel_group(g1, [0], None, "a2a")
    spy = _Spy(attn)
    monkeypatch.setattr(attn, "_attend", spy)
    q, k, v = qkv(requires_grad=False)
    attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cp_group=g2))
    assert spy.seen == [(g2, "a2a")]
    assert (attn.cp_group, attn.cp_global_ranks, attn.cp_comm_type) == (g1, [0], "a2a")
    # local_cp_size=1 without a group turns CP off for that forward only.
    attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", local_cp_size=1))
    assert spy.seen[-1] == (None, "a2a") and attn.cp_group is g1


def test_override_restores_previous_group_when_forward_raises(groups, monkeypatch):
    g1, g2 = groups
    attn = make_attn(groups)
    attn.set_context_parallel_group(g1, [0], None, "p2p")
    spy = _Spy(attn, error=RuntimeError("kernel failed"))
    monkeypatch.setattr(attn, "_attend", spy)
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(RuntimeError, match="kernel failed"):
        attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cp_group=g2))
    assert spy.seen == [(g2, "p2p")] and attn.cp_group is g1
    # A bad override raises too, and leaves the binding as it was.
    with pytest.raises(CPConfigError, match="local_cp_size"):
        attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", local_cp_size=2))
    with pytest.raises(CPConfigError, match="local_cp_size"):
        attn(q, k, v, None, packed_seq_params=PackedSeqParams(cp_group=g2, local_cp_size=2))
    assert (attn.cp_group, attn.cp_comm_type) == (g1, "p2p")


def test_micro_batch_group_restores_the_same_objects_after_a_real_forward(groups):
    """After a forward over packed_seq_params.cp_group (dynamic CP), the module's own binding is
    the very objects it had (group, global ranks, stream, comm type), also when the forward
    raised inside CP attention (a later forward must not talk over the micro-batch's group)."""
    g1, g2 = groups
    attn = make_attn(groups)
    attn.set_context_parallel_group(g1, [0], object(), "a2a")
    before = (attn.cp_group, attn.cp_global_ranks, attn.cp_stream, attn.cp_comm_type)
    q, k, v = (t[:, 0].contiguous() for t in qkv(s=16, b=1, requires_grad=False))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    good = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cp_group=g2)
    attn(q, k, v, None, packed_seq_params=good)
    after = (attn.cp_group, attn.cp_global_ranks, attn.cp_stream, attn.cp_comm_type)
    assert all(x is y for x, y in zip(after, before))
    bad_cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # covers 12 of the 16 tokens
    bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bad_cu, cu_seqlens_kv=bad_cu, cp_group=g2)
    with pytest.raises(CPConfigError, match="cu_seqlens"):
        attn(q, k, v, None, packed_seq_params=bad)
    after = (attn.cp_group, attn.cp_global_ranks, attn.cp_stream, attn.cp_comm_type)
    assert all(x is y for x, y in zip(after, before))


def test_a2a_p2p_override_needs_a_group_list(groups, monkeypatch):
    g1, g2 = groups
    attn = make_attn(groups)
    attn.set_context_parallel_group([g1, g1], [0], None, "a2a+p2p")
    monkeypatch.setattr(attn, "_attend", _Spy(attn))
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(CPConfigError, match="a2a_group, p2p_group"):
        attn(q, k, v, None, packed_seq_params=PackedSeqParams(cp_group=g2))
    assert attn.cp_group == [g1, g1]
    attn(q, k, v, None, packed_seq_params=PackedSeqParams(cp_group=[g2, g2]))
    assert attn.cp_group == [g1, g1]


# ---------------------------------------------------------------------------- spec and TE


def test_spec_puts_cp_attention_in_the_local_gpt_layer():
    from megatron.core.transformer.dot_product_attention import DotProductAttention as Local
    from cpkit.attention.spec import get_gpt_layer_spec_with_cp_attention

    spec = get_gpt_layer_spec_with_cp_attention(normalization="RMSNorm", qk_layernorm=True)
    sub = spec.submodules.self_attention.submodules
    assert sub.core_attention is ContextParallelAttention
    # MCore's own spec is untouched (the helper deep-copies).
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention is Local
    with pytest.raises(TypeError, match="does not accept"):
        get_gpt_layer_spec_with_cp_attention(no_such_option=True)
    # MLA: MCore's MLASelfAttention with cpkit's core attention
    mla = get_gpt_layer_spec_with_cp_attention(multi_latent_attention=True).submodules.self_attention
    assert mla.module.__name__ == "MLASelfAttention" and mla.submodules.core_attention is ContextParallelAttention
    # options reach the core attention as ModuleSpec params
    from cpkit.attention.options import CPAttentionOptions

    opts = CPAttentionOptions(a2a_chunks=1)
    core = get_gpt_layer_spec_with_cp_attention(options=opts).submodules.self_attention.submodules.core_attention
    assert core.module is ContextParallelAttention and core.params == {"options": opts}


def test_replace_core_attention_refuses_a_spec_without_one():
    from megatron.core.transformer.spec_utils import ModuleSpec
    from cpkit.attention.spec import replace_core_attention

    with pytest.raises(ValueError, match="no core_attention"):
        replace_core_attention(ModuleSpec(module=torch.nn.Identity))


def test_layer_built_from_spec_runs_at_cp1(groups):
    from megatron.core.transformer.spec_utils import build_module
    from cpkit.attention.spec import get_gpt_layer_spec_with_cp_attention

    g, _ = groups
    config = make_config(num_query_groups=2, use_cpu_initialization=True, bias_dropout_fusion=False,
                         masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    pgc = new_pg_collection(tp=g, cp=g, pp=g)
    with mcore_cpu_shim():
        layer = build_module(get_gpt_layer_spec_with_cp_attention(), config=config,
                             layer_number=1, pg_collection=pgc)
        assert isinstance(layer.self_attention.core_attention, ContextParallelAttention)
        x = torch.randn(8, 2, 64, requires_grad=True)
        out, _ = layer(x, attention_mask=None)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_te_spec_without_te_is_a_clear_error():
    from cpkit.attention.spec import get_gpt_layer_spec_te
    from cpkit.attention.te import te_available

    if te_available():
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(ImportError, match="get_gpt_layer_spec_with_cp_attention"):
        get_gpt_layer_spec_te()


class _FakeTE(torch.nn.Module):
    """Records set_context_parallel_group calls like TE's DotProductAttention would take them."""

    def __init__(self, cp_comm_type="p2p"):
        super().__init__()
        self.cp_comm_type = cp_comm_type
        self.calls = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.calls.append((cp_group, cp_global_ranks, cp_stream, cp_comm_type))


def test_bind_te_attention_groups_at_cp1_turns_cp_off(groups):
    from cpkit.attention.te import bind_te_attention_groups

    g, _ = groups
    model = torch.nn.Sequential(_FakeTE("p2p"), torch.nn.Linear(2, 2), _FakeTE("a2a+p2p"))
    n = bind_te_attention_groups(model, new_pg_collection(tp=g, cp=g), attention_type=_FakeTE)
    assert n == 2
    assert model[0].calls == [(None, None, None, "p2p")]
    assert model[2].calls == [(None, None, None, "a2a+p2p")]
    assert bind_te_attention_groups(torch.nn.Linear(2, 2), new_pg_collection(cp=g), attention_type=_FakeTE) == 0


# ----------------------------------------------------------------------------- bench helpers


def test_bench_helpers():
    from cpkit.bench.attention.attention import build_cases, causal_fwd_bwd_flops, render
    from cpkit.bench.common import format_table, parse_int_list

    assert parse_int_list("32K,65536, 128k") == [32768, 65536, 131072]
    assert causal_fwd_bwd_flops(1, 32, 1024, 128) == 3.5 * 2 * 32 * 1024**2 * 128
    cases = build_cases(["cpkit", "sdpa"], ["p2p", "a2a+p2p"], [8], [2, 4], [1024], 2, te_ok=False)
    rows = [c.row for c in cases]
    assert rows == ["sdpa - kv8 cp1", "cpkit p2p kv8 cp2", "cpkit p2p kv8 cp4", "cpkit a2a+p2p kv8 cp4"]
    table = format_table(["a", "bb"], ["1K", "2K"], {("a", "1K"): "1.0", ("bb", "2K"): "error: x"})
    assert table.splitlines()[2].split() == ["a", "1.0", "-"]
    result = dict(backend="cpkit", comm="p2p", kv_heads=8, cp=2, seq=1024, error=None,
                  tflops_per_gpu=12.34, notes=[])
    assert "12.3" in render([result], [1024])


def test_bench_write_json(tmp_path):
    import json

    from cpkit.bench.common import write_json

    path = write_json("attention", {"results": [1]}, str(tmp_path / "sub" / "a.json"))
    data = json.loads(path.read_text())
    # the payload, and the cpkit files this process loaded, which a claim made from it is held to
    assert data.pop("code") and "src/cpkit/bench/common.py" in write_json("x", {}, str(tmp_path / "b.json")).read_text()
    assert data == {"results": [1]}


def test_profile_table_lists_ops_by_host_time():
    from cpkit.bench.common import profile_table

    x = torch.randn(64, 64)
    text = profile_table(lambda: x @ x, iters=2, device=torch.device("cpu"), title="mm")
    assert text.startswith("=== mm: 2 iterations")
    assert "--- sorted by self_cpu_time_total" in text and "aten::mm" in text
    assert "self_device_time_total" not in text  # no device table without a device


def test_append_profile_writes_a_trace_per_block(tmp_path):
    import json

    from cpkit.bench.common import append_profile

    x = torch.randn(32, 32)
    path = tmp_path / "p.txt"
    for title in ("mm a", "mm b: eval"):
        append_profile(str(path), lambda: x @ x, iters=1, device=torch.device("cpu"), title=title)
    assert path.read_text().count("=== ") == 2
    # One trace per block and rank, named after the block's title (file-name safe).
    assert sorted(p.name for p in tmp_path.glob("*.trace.json")) == [
        "p.txt.mm_a.rank0.trace.json", "p.txt.mm_b_eval.rank0.trace.json"]
    assert "traceEvents" in json.loads((tmp_path / "p.txt.mm_a.rank0.trace.json").read_text())


def test_timeline_splits_compute_exposed_comm_and_idle():
    from cpkit.bench.timeline import summarize

    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    # compute 0-100 and 150-200; NCCL 50-130 (hidden 50-100, exposed 100-130); idle 130-150.
    t = summarize({"traceEvents": [k("flash_fwd", 0, 100), k("ncclDevKernel_SendRecv", 50, 80),
                                   k("gemm", 150, 50), {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 999}]})
    assert (t.span_ms, t.compute_ms, t.exposed_comm_ms, t.idle_ms, t.comm_ms) == \
        pytest.approx((0.2, 0.15, 0.03, 0.02, 0.08))
    assert t.kernels == 3
    assert summarize({"traceEvents": []}).kernels == 0


def test_kernel_split_names_the_time_outside_the_attention_kernels_per_iteration():
    from cpkit.bench.timeline import kernel_split

    def k(name, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur}

    trace = {"traceEvents": [
        k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob", 3000),
        k("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob", 6000),
        k("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)", 300),
        k("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 900),
        k("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<"
          "at::native::addcmul_cuda_kernel(at::TensorIteratorBase&)>", 600),
        k("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<float>>", 150),
        k("triton_poi_fused_add_exp_0", 60),
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 99999},
    ]}
    split, others = kernel_split(trace, iters=3, top=2)
    assert split == pytest.approx({"attn fwd": 1.0, "attn bwd": 2.0, "attn helpers": 0.1, "comm": 0.3,
                                   "other": 0.27})
    assert others == [("elementwise_kernel[addcmul_cuda_kernel]", pytest.approx(0.2)),
                      ("vectorized_elementwise_kernel[CUDAFunctor_add]", pytest.approx(0.05))]


def test_machine_info_records_the_comm_knobs(monkeypatch):
    from cpkit.bench.common import machine_info

    monkeypatch.setenv("CPKIT_A2A_CHUNKS", "1")
    monkeypatch.setenv("NCCL_MIN_P2P_NCHANNELS", "32")
    monkeypatch.setenv("HOME_NOT_RECORDED", "y")
    env = machine_info()["env"]
    assert env["CPKIT_A2A_CHUNKS"] == "1" and env["NCCL_MIN_P2P_NCHANNELS"] == "32"
    assert "HOME_NOT_RECORDED" not in env and list(env) == sorted(env)


def test_bench_refuses_bad_arguments(capsys, tmp_path):
    from cpkit.bench.attention.attention import main

    assert main(["--device", "cpu", "--seq", "100", "--cp", "4"]) == 2
    assert "divisible by 2 * cp" in capsys.readouterr().err
    assert main(["--device", "cpu", "--comm", "ring"]) == 2
    if not torch.cuda.is_available():
        assert main(["--out", str(tmp_path / "x.json")]) == 2
        assert "--device cpu --quick" in capsys.readouterr().err
