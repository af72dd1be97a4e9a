"""A gated delta net layer under CP equals CP 1, in both of Megatron-LM's modes, on 2, 3 and 4
ranks (gloo; NCCL on GPUs), sbhd and THD.

The reference runs the same layer's parameters at CP 1 with a token-by-token float64 recurrence
and a tap-by-tap causal conv (src/cpkit/testing/recurrent_reference.py), which share no code with
the chunked CP path. Compared: the output rows of each rank and the gradients of its input rows
and of every parameter (in_proj's q, k, v, beta and gate rows, the conv weights, A_log, dt_bias,
the norm and out_proj), summed over the ranks. chunkwise reads the contiguous layout; headwise
reads either layout (zigzag, as the attention leaves it, needs no transition).

Tolerance: float64 throughout, atol = rtol = 1e-9 (the chunked form and the token loop differ
only by rounding, about 1e-13 here).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import device, launch
from tests.test_hybrid_layout import reference_indices

TOL = dict(atol=1e-9, rtol=1e-9)
LENGTHS = {"sbhd": lambda cp: [8 * cp], "thd": lambda cp: [6 * cp, 0, 2 * cp, 10 * cp]}
MODES = [("chunkwise", "contiguous"), ("headwise", "contiguous"), ("headwise", "zigzag")]


def _layer(seed: int = 3):
    from cpkit.hybrid.gdn import GatedDeltaNet, GDNShape

    torch.manual_seed(seed)
    return GatedDeltaNet(GDNShape(hidden=16, heads=12, head_k=4, head_v=3), dtype=torch.float64, device=device(),
                         chunk_size=4)


def _reference_core():
    from cpkit.testing.recurrent_reference import causal_conv1d_reference, gated_delta_rule_reference

    return types.SimpleNamespace(conv=causal_conv1d_reference,
                                 rule=lambda q, k, v, beta, g: gated_delta_rule_reference(q, k, v, beta, g)[0])


def layer_problems(make_layer, reference_core, fmt: str, mode: str, layout: str, group) -> list[str]:
    """A recurrent layer (`make_layer()`, GDN or Mamba) under CP in `mode` and `layout` against the
    same layer at cp 1 on `reference_core()` (float64 loops sharing no code with the chunked path):
    what differs among the output, dx and every parameter's gradient (summed over the ranks)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    lens = LENGTHS[fmt](cp)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(cu[-1], 16, generator=gen, dtype=torch.float64).to(device())
    w = torch.randn(cu[-1], 16, generator=gen, dtype=torch.float64).to(device())
    ref_layer, layer = make_layer(), make_layer()
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref_layer(x_ref, cu, None, core=reference_core())
    (y_ref * w).sum().backward()
    idx = torch.tensor(reference_indices(layout, lens, cp, rank), dtype=torch.int64, device=device())
    x_local = x[idx].clone().requires_grad_(True)
    y = layer(x_local, cu, group, mode=mode, layout=layout)
    (y * w[idx]).sum().backward()
    problems = []
    for name, got, want in [("output", y.detach(), y_ref.detach()[idx]), ("dx", x_local.grad, x_ref.grad[idx])]:
        if not torch.allclose(got, want, **TOL):
            problems.append(f"{name}: max error {(got - want).abs().max().item():.3g}")
    for (name, p), p_ref in zip(layer.named_parameters(), ref_layer.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank holds its tokens' share
        if not torch.allclose(grad, p_ref.grad, **TOL):
            problems.append(f"d{name}: max error {(grad - p_ref.grad).abs().max().item():.3g}")
    return problems


def _gdn_case(fmt: str, mode: str, layout: str) -> dict:
    group = dist.new_group(list(range(dist.get_world_size())))
    return {"problems": layer_problems(_layer, _reference_core, fmt, mode, layout, group)}


# The largest ring first: a fault in the state fold shows from 3 ranks on, and -x stops at the first.
GLOO = [pytest.param("gloo", n, marks=pytest.mark.dist, id=f"gloo{n}") for n in (4, 3, 2)]
NCCL = [pytest.param(n, marks=getattr(pytest.mark, f"gpu{n}"), id=f"nccl{n}") for n in (2, 4)]


@pytest.mark.parametrize("mode,layout", MODES, ids=[f"{m}-{lay}" for m, lay in MODES])
@pytest.mark.parametrize("fmt", sorted(LENGTHS))
@pytest.mark.parametrize("backend,world_size", GLOO)
def test_gdn_layer_under_cp_equals_cp1_outputs_and_every_gradient(backend, world_size, fmt, mode, layout):
    results = launch(_gdn_case, world_size, backend=backend, timeout=300, args=(fmt, mode, layout))
    for rank, result in enumerate(results):
        assert result == {"problems": []}, (rank, result)


def _every_gdn_case() -> dict:
    return {f"{fmt}-{mode}-{layout}": _gdn_case(fmt, mode, layout)["problems"] for fmt in sorted(LENGTHS)
            for mode, layout in MODES}


@pytest.mark.parametrize("world_size", NCCL)
def test_gdn_layer_under_cp_equals_cp1_on_nccl(world_size):
    """The same cases on NCCL, in one launch (one NCCL start-up for all six)."""
    results = launch(_every_gdn_case, world_size, backend="nccl", timeout=300)
    for rank, result in enumerate(results):
        assert all(v == [] for v in result.values()), (rank, result)
