"""The gated delta rule on flash-linear-attention's kernels (GPU), as cpkit's CP wraps them.

One GPU (gpu1): the rule over packed sequences on fla (src/cpkit/hybrid/delta_rule.py::
gated_delta_rule_varlen, one varlen call, an empty sequence and a given initial state included)
against the float64 token loop: bf16 inputs, the error held to a bound derived from bf16's own:
at most 4x the error of cpkit's PyTorch chunked form on the same bf16 inputs, plus 1e-3 of the
output's scale (both compute in fp32 from bf16 inputs; fla multiplies in TF32). The gradients of
q, k, v, beta, g and the initial state likewise.

Two GPUs (gpu2): a GDN layer in bf16 at cp 2 on fla, chunkwise and headwise, against the same
layer at cp 1 on fla: outputs and parameter gradients within 2e-2 of their scale (bf16's
rounding over a sequence of 256 tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.hybrid.delta_rule import _fla, fla_refusal
from cpkit.testing import device, launch
from cpkit.testing.recurrent_reference import gated_delta_rule_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fla = pytest.mark.skipif(_fla() is None, reason="flash-linear-attention (fla) is not importable: pip install "
                               "--no-deps fla-core flash-linear-attention (the GPU proof carries them in .fla/)")
_REFUSAL = fla_refusal(torch.device("cuda")) if torch.cuda.is_available() and _fla() is not None else None
# Where fla refuses to train (an old Triton on Hopper), cpkit runs its PyTorch form: nothing of fla to hold.
fla_trains = pytest.mark.skipif(_REFUSAL is not None, reason=f"{_REFUSAL}; cpkit uses its PyTorch chunked rule here")


def _inputs(t, h=4, dk=64, dv=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.3
    return q, k, v, beta, g


@pytest.mark.gpu1
@needs_cuda
@needs_fla
@fla_trains
def test_fla_varlen_rule_is_within_bf16s_own_error_of_the_float64_loop():
    from cpkit.hybrid.delta_rule import gated_delta_rule_varlen

    lens = [100, 0, 37, 256]
    offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
    inputs = _inputs(offsets[-1])
    start = torch.randn(len(lens), 4, 64, 64, generator=torch.Generator().manual_seed(1)) * 0.1

    def run(kernel):
        leaves = [x.to(torch.bfloat16).cuda().requires_grad_(True) for x in inputs]
        s0 = start.cuda().requires_grad_(True)
        o, final = gated_delta_rule_varlen(*leaves, offsets, s0, kernel=kernel)
        (o.float().sum() + final.sum()).backward()
        return o.float().cpu(), final.float().cpu(), [x.grad.float().cpu() for x in (*leaves, s0)]

    refs_o, refs_s, refs_g = [], [], []
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        leaves = [x[a:b].to(torch.bfloat16).double().requires_grad_(True) for x in inputs]
        s0 = start[i].double().requires_grad_(True)
        o, s = gated_delta_rule_reference(*leaves, initial_state=s0)
        if b > a:
            (o.sum() + s.sum()).backward()
            refs_g.append([x.grad for x in leaves] + [s0.grad])
        else:
            refs_g.append([torch.zeros_like(x) for x in leaves] + [torch.ones_like(s0)])
        refs_o.append(o)
        refs_s.append(s)
    ref_o, ref_s = torch.cat(refs_o).float(), torch.stack(refs_s).float()
    ref_g = [torch.cat([r[j] for r in refs_g]).float() for j in range(5)] + [torch.stack([r[5] for r in refs_g]).float()]
    fla, torch_form = run("fla"), run("torch")
    for name, got, base, ref in [("o", fla[0], torch_form[0], ref_o), ("final state", fla[1], torch_form[1], ref_s),
                                 *[(f"d{n}", a, b, r) for n, a, b, r in zip(("q", "k", "v", "beta", "g", "h0"),
                                                                           fla[2], torch_form[2], ref_g)]]:
        bound = 4 * (base - ref).abs().max().item() + 1e-3 * ref.abs().max().item()
        assert (got - ref).abs().max().item() <= bound, (name, (got - ref).abs().max().item(), bound)


def _layer_cp_case(mode: str) -> list[str]:
    from cpkit.hybrid.gdn import GatedDeltaNet, GDNShape

    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    cu = [0, 256]
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(3)).to(device(), torch.bfloat16)
    problems = []
    outs = {}
    for name, grp in (("cp1", None), ("cp", group)):
        torch.manual_seed(0)
        layer = GatedDeltaNet(GDNShape(128, 4, 32, 32), dtype=torch.bfloat16, device=device(), kernel="fla")
        rows = x if grp is None else x[rank * 128:(rank + 1) * 128]  # contiguous at cp 2 (one sequence)
        y = layer(rows.clone().requires_grad_(True), cu, grp, mode=mode)
        y.float().sum().backward()
        grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
        if grp is not None:
            for g in grads.values():
                dist.all_reduce(g, group=grp)
            y = y.float()
        outs[name] = (y.float().detach(), grads)
    y1, g1 = outs["cp1"]
    yc, gc = outs["cp"]
    y1 = y1[rank * 128:(rank + 1) * 128]
    if (yc - y1).abs().max() > 2e-2 * y1.abs().max():
        problems.append(f"output: {(yc - y1).abs().max().item():.3g}")
    for n in g1:
        if (gc[n] - g1[n]).abs().max() > 2e-2 * g1[n].abs().max():
            problems.append(f"d{n}: {(gc[n] - g1[n]).abs().max().item():.3g} of {g1[n].abs().max().item():.3g}")
    return problems


@pytest.mark.gpu2
@needs_cuda
@needs_fla
@fla_trains
@pytest.mark.parametrize("mode", ["chunkwise", "headwise"])
def test_gdn_layer_on_fla_at_cp2_equals_cp1(mode):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    results = launch(_layer_cp_case, 2, backend="nccl", timeout=300, args=(mode,))
    assert results == [[], []], results
