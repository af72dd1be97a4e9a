"""Megatron-LM dev's GatedDeltaNet (megatron/core/ssm/gated_delta_net/gdn.py, from CPKIT_MLM_SRC)
at cp 2 equals the same module at cp 1, in each `linear_cp_mode` (chunkwise, headwise), on 2 GPUs
with NCCL: the output rows of each rank and every parameter gradient (summed over the CP ranks).

gpu2 only: its gated delta rule and conv are flash-linear-attention's Triton kernels (`fla`, the
fla-core wheel), CUDA only; without the checkout, fla or CUDA the test skips with the reason.
Both runs use the same weights (the cp-1 module loads the cp-2 module's state dict) and the same
global sbhd batch (batch 1, 256 tokens); the cp-2 rank holds its zigzag shard (indices from the
definition, tests/test_hybrid_layout.py::reference_indices), the layout dev's GatedDeltaNet takes
in both modes (chunkwise converts to contiguous inside and back). The cp-1 module runs on every
rank on the whole batch, over a CP group of one rank.

Tolerance: float32 parameters and activations; fla's kernels multiply in TF32 (10-bit mantissa,
eps 2^-11), so errors are relative to the largest reference magnitude: max |cp2 - cp1| <=
REL * max |cp1| with REL = 2e-2 (about 40 TF32 ulps, for the state passed between ranks and the
chunk sums that cp 2 orders differently).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import dist_params, launch
from cpkit.testing.mlm_hybrid import gdn_skip_reason, mlm_commit
from tests.test_hybrid_layout import reference_indices

REL = 2e-2
SEQ = 256
NCCL2 = [p for p in dist_params((2,)) if p.values[0] == "nccl"]
needs_fla = pytest.mark.skipif(gdn_skip_reason() is not None, reason=gdn_skip_reason() or "")


def _config(cp: int, mode: str):
    import importlib.util

    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    te = importlib.util.find_spec("transformer_engine") is not None
    return TransformerConfig(
        hidden_size=128, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, num_layers=1, normalization="RMSNorm",
        use_cpu_initialization=True, layernorm_zero_centered_gamma=True, num_attention_heads=8,
        activation_func=F.silu, bf16=False, params_dtype=torch.float32, context_parallel_size=cp,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1], linear_cp_mode=mode,
        cp_partition_mode="zigzag", transformer_impl="transformer_engine" if te else "local")


def _module(config, groups):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet

    tp, cp = groups
    spec = get_gated_delta_net_module_spec(config=config)
    return GatedDeltaNet(config, submodules=spec.submodules, layer_number=1, bias=False, conv_bias=False,
                         conv_init=1.0, use_qk_l2norm=True, A_init_range=(1, 16),
                         pg_collection=ProcessGroupCollection(tp=tp, cp=cp, tp_cp=cp)).cuda()


def _gdn_case(mode: str) -> dict:
    from cpkit.testing.mlm_hybrid import load_mlm_modules

    load_mlm_modules(["megatron.core.parallel_state", "megatron.core.tensor_parallel.random"])
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank, cp = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    model_parallel_cuda_manual_seed(123)
    singles = [dist.new_group([r]) for r in range(cp)]  # every rank joins every new_group call
    cp_group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    layer = _module(_config(cp, mode), (tp_group, cp_group))
    ref = _module(_config(1, mode), (singles[rank], singles[rank]))
    ref.load_state_dict(layer.state_dict())

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, 1, 128, generator=gen).cuda()
    w = torch.randn(SEQ, 1, 128, generator=gen).cuda()
    idx = torch.tensor(reference_indices("zigzag", [SEQ], cp, rank)).cuda()
    x_ref = x.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref, None)
    (y_ref * w).sum().backward()
    x_local = x[idx].clone().requires_grad_(True)
    y, _ = layer(x_local, None)
    (y * w[idx]).sum().backward()

    problems = []

    def check(name, got, want):
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        if not err <= REL * scale:
            problems.append(f"{name}: max error {err:.3g} > {REL} x {scale:.3g}")

    check("output", y.detach(), y_ref.detach()[idx])
    check("dx", x_local.grad, x_ref.grad[idx])
    refs = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=cp_group)  # each rank holds its tokens' share
        check(f"d{name}", grad, refs[name].grad if refs[name].grad is not None else torch.zeros_like(p))
    parallel_state.destroy_model_parallel()
    return {"problems": problems}


@needs_fla
@pytest.mark.parametrize("mode", ["chunkwise", "headwise"])
@pytest.mark.parametrize("backend,world_size", NCCL2)
def test_dev_gdn_at_cp2_equals_cp1_outputs_and_parameter_gradients(backend, world_size, mode):
    results = launch(_gdn_case, world_size, backend=backend, timeout=300, args=(mode,))
    for rank, result in enumerate(results):
        assert result == {"problems": []}, (rank, result, f"Megatron-LM {mlm_commit()}")
