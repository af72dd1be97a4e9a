"""MCore's own hybrid model (megatron/core/models/hybrid/hybrid_model.py::HybridModel, megatron-core
0.19) with attention and gated delta net (GDN) layers trains at cp 2 (and 4) like cp 1: the loss
of each of 3 SGD steps and, after the first, every parameter's gradient (gloo; NCCL on 2 GPUs).

The model: HybridModel with the layer pattern PATTERN ("*" attention, "G" MCore's GatedDeltaNet,
"-" MLP), RoPE, small dims, fp32. The layer specs are MCore's HybridStackSubmodules with local
(non-TE) linears and MCore's torch norms; the attention layers' core attention is cpkit's
ContextParallelAttention (`cpkit.attention.spec.get_gpt_layer_spec_with_cp_attention`, as
`cpkit.attention.gpt` builds its GPT): MCore's own CPU attention (DotProductAttention) refuses
cp > 1 and its CP attention is Transformer Engine's (CUDA). The final norm is left out
(`post_layer_norm=False` in the stack spec): HybridStack builds it as TENorm whatever the spec.

What MCore 0.19.2's hybrid CP supports here: the GDN's CP is headwise only (`tensor_a2a_cp2hp`:
one all-to-all to whole sequences of H/cp heads, undoing attention's zigzag, and back; there is
no chunkwise `linear_cp_mode` in 0.19.2), in sbhd; the batch is sharded in zigzag
(`cpkit.sharding.shard_batch`, MCore's load-balanced layout) and both layer kinds read it as is.
THD (packed) GDN needs fla's kernels (`deterministic_mode` refuses THD: "Packed sequence does not
support deterministic mode"), so THD is not run on CPU. Mamba layers ("M") are not in the pattern:
MCore's MambaMixer needs mamba_ssm and causal_conv1d (CUDA builds; it raises ImportError without).

On CPU (gloo) the GDN runs MCore's deterministic mode (`config.deterministic_mode`: its
torch-native chunked rule `torch_chunk_gated_delta_rule` and F.conv1d) with three stand-ins, set in
each rank by `_gdn_on_cpu`, that change no arithmetic of the layer:
- the `HAVE_FLA` check in `_GDNBase.__init__` passes (fla, the flash-linear-attention package,
  is Triton, GPU only; deterministic mode calls none of its kernels but l2norm),
- fla's `l2norm` (a Triton kernel) is `x / sqrt(sum(x^2) + 1e-6)` over the last dim in torch,
- `torch.cuda.current_device()` in the GDN modules (parameter placement, the head permutation's
  device) is "cpu".
MCore's jit fuser (torch.compile on torch >= 2.2, a C++ build on CPU) is switched off with
`megatron.core.jit.disable_jit_fuser` before the GDN module is imported, on every backend. On
NCCL the GDN needs fla (its l2norm); without it the gpu2 case skips with the reason.

Tolerances (fp32): the loss 1e-5 relative; gradients atol 2e-5, rtol 1e-4 (CP changes the order
of the attention merge and of the gradient sums over the 160 tokens; the GDN's rule runs on whole
sequences at every cp size). Measured on gloo: loss 1e-7 relative, gradients 3.4e-8 at most.

Also checked: the built layers (2 attention on cpkit's attention and 2 GDN, each at the run's cp
size; 2 MLP), cpkit's zigzag shard equal to MCore's `get_batch_on_this_cp_rank`, that the
comparison fails when the GDN's zigzag undo/redo (`_undo_attention_load_balancing`,
`_redo_attention_load_balancing` as `common` imports them) is skipped at cp 2, and the THD refusal
above. No upstream defect of the invariant found: cp 2 and 4 equal cp 1. MCore's
`get_parameter_local_cp` indexes with a list of slices, which torch 2.14 warns is deprecated
(still sliced right).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import device, launch

PATTERN = "*G-G*-"
SEQ, BATCH, VOCAB, HIDDEN = 80, 2, 96, 32  # SEQ: a multiple of 2 * 4, two chunks of the rule (64)
STEPS = 3
TOL = dict(loss_rel=1e-5, atol=2e-5, rtol=1e-4)


def _hybrid_skip_reason() -> str | None:
    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        import megatron.core

        return (f"megatron-core {megatron.core.__version__} has no megatron.core.models.hybrid "
                "(HybridModel and the gated_delta_net package are megatron-core 0.19+)")
    return None


needs_hybrid = pytest.mark.skipif(_hybrid_skip_reason() is not None, reason=_hybrid_skip_reason() or "")


def _fla_skip_reason() -> str | None:
    if importlib.util.find_spec("fla") is None:
        return ("flash-linear-attention is not installed (import fla failed): MCore's GatedDeltaNet on "
                "CUDA needs fla's l2norm (pip install fla-core)")
    return None


class _CudaOnCpu:
    @staticmethod
    def current_device():
        return "cpu"


class _TorchOnCpu:
    """`torch` as the GDN modules see it on CPU: torch.cuda.current_device() is "cpu"."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, **_) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim=dim, keepdim=True) + eps)


def _gdn_on_cpu(on_cpu: bool) -> None:
    """The stand-ins of the module docstring; the jit fuser off before the GDN is imported."""
    import sys

    from megatron.core import jit

    if "megatron.core.ssm.gated_delta_net.common" not in sys.modules:
        jit.disable_jit_fuser()
    from megatron.core.ssm.gated_delta_net import common, gdn

    if not on_cpu:
        return
    common.HAVE_FLA = True
    common.l2norm = _l2norm
    common.torch = gdn.torch = _TorchOnCpu()


def _stack_spec():
    """MCore's HybridStack with local linears, torch norms and cpkit's core attention."""
    import dataclasses

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from cpkit.attention.spec import get_gpt_layer_spec_with_cp_attention

    full = get_gpt_layer_spec_with_cp_attention(normalization="RMSNorm")
    attention = dataclasses.replace(full, submodules=dataclasses.replace(
        full.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp))
    gdn = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=HybridStack, params={"post_layer_norm": False},
                      submodules=HybridStackSubmodules(attention_layer=attention, gdn_layer=gdn, mlp_layer=mlp))


def _config(cp: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=len(PATTERN), hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
        linear_num_value_heads=8, deterministic_mode=True, context_parallel_size=cp,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=device().type == "cpu", perform_initialization=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False)


@torch.no_grad()
def _init(model, seed: int = 11) -> None:
    """Every parameter from (seed, its name): the same weights at every cp size."""
    import zlib

    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        r = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            value = torch.log(1.0 + 3.0 * torch.rand(p.shape, generator=gen))
        elif name.endswith("dt_bias"):
            value = 0.5 * r
        elif "conv1d" in name:
            value = 0.3 * r
        elif "norm" in name and name.endswith("weight"):
            value = 1.0 + 0.1 * r
        else:
            value = 0.05 * r
        p.copy_(value.to(p.dtype))


def _pg_collection(cp_group, single):
    from cpkit.compat import new_pg_collection

    return new_pg_collection(tp=single, pp=single, mp=single, cp=cp_group, dp=single, tp_cp=cp_group,
                             dp_cp=cp_group, tp_dp_cp=cp_group, embd=single, pos_embd=single,
                             intra_dp_cp=cp_group, expt_dp=cp_group, intra_expt_dp=cp_group, expt_tp=single,
                             tp_ep=single, tp_ep_pp=single, ep=single)


def _batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.1).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).expand(BATCH, -1).contiguous(), "loss_mask": mask}


def _identity(tensor, cp_size):
    return tensor


def _layer_kinds(model) -> dict:
    """{kind: [cp size of each such layer]} of the built model's decoder."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.mlp_layer import MLPLayer

    from cpkit.attention.module import ContextParallelAttention

    kinds = {"attention": [], "gdn": [], "mlp": []}
    for layer in model.decoder.layers:
        if isinstance(layer, MLPLayer):
            kinds["mlp"].append(1)
        elif isinstance(layer.self_attention, GatedDeltaNet):
            kinds["gdn"].append(layer.self_attention.cp_size)
        elif isinstance(layer.self_attention.core_attention, ContextParallelAttention):
            kinds["attention"].append(layer.self_attention.core_attention.pg_collection.cp.size())
    return kinds


def _thd_refusal(model, cp: int) -> str | None:
    """What a GDN layer of `model` raises on a THD batch (one sequence of SEQ tokens), or None."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    layer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    cu = torch.tensor([0, SEQ], dtype=torch.int32, device=device())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
    try:
        layer(torch.zeros(SEQ // cp, 1, HIDDEN, device=device()), None, packed_seq_params=params)
    except AssertionError as err:
        return f"AssertionError: {err}"
    return None


def _train(fault: str | None = None) -> dict:
    """cp 1 and cp = world size on this rank, STEPS SGD steps each: the losses, the first step's
    gradients (summed over the CP ranks) and what was built. `fault` "gdn-zigzag": the GDN's undoing
    (and redoing) of attention's zigzag order skipped in the CP run (the comparison must see it)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from cpkit.compat import mcore_batch_on_this_cp_rank
    from cpkit.sharding import shard_batch
    from cpkit.testing.models import named_gradients, train_step

    dev = device()
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank joins every new_group call
    group = dist.new_group(list(range(world)))
    batch = {k: v.to(dev) for k, v in _batch().items()}
    results, kinds, same_as_mcore, thd = {}, {}, None, None
    for name, cp_group in (("cp1", singles[rank]), ("cp", group)):
        pgc = _pg_collection(cp_group, singles[rank])
        cp = cp_group.size()
        model = HybridModel(_config(cp), _stack_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                            hybrid_layer_pattern=PATTERN, position_embedding_type="rope", pg_collection=pgc)
        model.to(dev)
        _init(model)
        kinds[name] = _layer_kinds(model)
        local = shard_batch(batch, cp_group if cp > 1 else None)
        if cp > 1:  # cpkit's zigzag shard is the one MCore's get_batch_on_this_cp_rank cuts
            mcore = mcore_batch_on_this_cp_rank(dict(batch), cp_group)
            same_as_mcore = all(torch.equal(local[k], mcore[k]) for k in local)
            thd = _thd_refusal(model, cp)
        losses, grads = [], None
        with _planted(fault if name == "cp" else None):
            for step in range(STEPS):
                losses.append(train_step(model, local, pgc, lr=0.5))
                if step == 0:
                    grads = named_gradients(model)
        results[name] = (losses, grads)
    (l1, g1), (lc, gc) = results["cp1"], results["cp"]
    errors = {n: float((gc[n] - g1[n]).abs().max()) for n in g1}
    bad = {n: errors[n] for n in g1 if not torch.allclose(gc[n], g1[n], atol=TOL["atol"], rtol=TOL["rtol"])}
    return {"losses": (l1, lc), "grad_mismatch": bad, "layers": kinds, "shard_same_as_mcore": same_as_mcore,
            "loss_ok": all(abs(a - b) <= TOL["loss_rel"] * abs(a) for a, b in zip(l1, lc)),
            "max_grad_err": max(errors.values()), "thd": thd}


class _planted:
    """The fault `name` in MCore's GDN for the duration of the block (None: nothing)."""

    def __init__(self, name: str | None):
        self.name = name

    def __enter__(self):
        from megatron.core.ssm.gated_delta_net import common

        self.saved = common._undo_attention_load_balancing, common._redo_attention_load_balancing
        if self.name == "gdn-zigzag":
            common._undo_attention_load_balancing = common._redo_attention_load_balancing = _identity
        elif self.name is not None:
            raise ValueError(f"unknown fault {self.name!r}")

    def __exit__(self, *exc):
        from megatron.core.ssm.gated_delta_net import common

        common._undo_attention_load_balancing, common._redo_attention_load_balancing = self.saved


def _scenario(with_fault: bool) -> dict:
    """The clean run and, with `with_fault`, the planted one, in one launch."""
    from cpkit.mcore_cpu import install_mcore_cpu_shim

    install_mcore_cpu_shim()
    _gdn_on_cpu(device().type == "cpu")
    out = {"clean": _train()}
    if with_fault:
        out["fault"] = _train("gdn-zigzag")
    return out


@functools.lru_cache(maxsize=None)
def _results(backend: str, world_size: int) -> tuple:
    return tuple(launch(_scenario, world_size, backend=backend, timeout=300, args=(world_size == 2,)))


def _check(result: dict, world_size: int, rank: int) -> None:
    assert result["layers"] == {"cp1": {"attention": [1, 1], "gdn": [1, 1], "mlp": [1, 1]},
                                "cp": {"attention": [world_size] * 2, "gdn": [world_size] * 2, "mlp": [1, 1]}}, \
        (rank, result["layers"])
    assert result["shard_same_as_mcore"] is True, (rank, result)
    assert result["loss_ok"] and result["grad_mismatch"] == {}, (rank, result)


GLOO = [pytest.param("gloo", n, marks=pytest.mark.dist, id=f"gloo{n}") for n in (2, 4)]


@needs_hybrid
@pytest.mark.parametrize("backend,world_size", GLOO)
def test_mcore_hybrid_model_trains_at_cp_like_cp1(backend, world_size):
    for rank, result in enumerate(_results(backend, world_size)):
        _check(result["clean"], world_size, rank)


@needs_hybrid
@pytest.mark.dist
def test_the_comparison_sees_a_gdn_reading_zigzag_rows_as_contiguous():
    """With the GDN's zigzag undo/redo skipped at cp 2, the losses and gradients differ from cp 1."""
    for rank, result in enumerate(_results("gloo", 2)):
        assert not result["fault"]["loss_ok"] and result["fault"]["grad_mismatch"], (rank, result["fault"])


@needs_hybrid
@pytest.mark.dist
def test_mcore_gdn_refuses_thd_in_deterministic_mode():
    """The docstring's reason THD is not run on CPU: MCore's GDN asserts it, at cp 2 as at cp 1."""
    for rank, result in enumerate(_results("gloo", 2)):
        assert result["clean"]["thd"] == "AssertionError: Packed sequence does not support deterministic mode.", rank


@pytest.mark.gpu2
@pytest.mark.skipif(_fla_skip_reason() is not None, reason=_fla_skip_reason() or "")
@needs_hybrid
def test_mcore_hybrid_model_trains_at_cp_like_cp1_on_nccl():
    for rank, result in enumerate(_results("nccl", 2)):
        _check(result["clean"], 2, rank)
