"""The Mamba-2 mixer (src/cpkit/hybrid/mamba.py) in one process: at cp 1 it equals the same
parameters run through the float64 references (src/cpkit/testing/recurrent_reference.py), with
and without the gated norm, on packed sequences with an empty one; bad sizes and bad CP settings
are refused before any communication, every violation at once with its fix. The layer under CP
on 2, 3 and 4 ranks: functional/test_hybrid_mamba.py."""

from __future__ import annotations

import types

import pytest
import torch

from cpkit.errors import CPConfigError
from cpkit.hybrid.mamba import Mamba2Mixer, Mamba2Shape
from cpkit.testing.fakes import fake_group
from cpkit.testing.recurrent_reference import causal_conv1d_reference, ssd_reference

SHAPE = Mamba2Shape(hidden=16, heads=4, head_dim=3, state=5, groups=2)
REFERENCE = types.SimpleNamespace(
    conv=causal_conv1d_reference,
    scan=lambda x, dt, A, B, C, D, dt_bias: ssd_reference(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)[0])


@pytest.mark.parametrize("rmsnorm", [True, False], ids=["gated-norm", "gate-only"])
def test_the_layer_at_cp1_equals_the_references_with_every_gradient(rmsnorm):
    torch.manual_seed(0)
    layer = Mamba2Mixer(SHAPE, dtype=torch.float64, chunk_size=4, rmsnorm=rmsnorm)
    with torch.no_grad():
        layer.dt_bias.normal_(0.0, 0.5)
        layer.A_log.uniform_(-1.0, 0.5)
        layer.D.normal_()
    cu = [0, 7, 7, 8, 20]
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    outs = []
    for core in (None, REFERENCE):
        layer.zero_grad()
        x.grad = None
        y = layer(x, cu, None, core=core)
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)).sum().backward()
        outs.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = outs
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(dx, dx_ref, atol=1e-12, rtol=1e-12)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-12, rtol=1e-12,
                                   msg=lambda m, n=name: f"d{n}: {m}")


def test_bad_sizes_are_refused_all_at_once_with_the_fix():
    with pytest.raises(CPConfigError) as err:
        Mamba2Mixer(Mamba2Shape(hidden=16, heads=4, head_dim=0, state=5, groups=3))
    assert [v.field for v in err.value.violations] == ["head_dim"]  # the group check waits for positive sizes
    with pytest.raises(CPConfigError) as err:
        Mamba2Mixer(Mamba2Shape(hidden=16, heads=4, head_dim=3, state=5, groups=3))
    (violation,) = err.value.violations
    assert (violation.field, violation.value) == ("groups", 3) and "divisor of 4" in violation.fix


def test_headwise_at_a_size_heads_and_groups_do_not_divide_names_both():
    """cp 3 with 4 heads in 2 groups: MCore's MambaContextParallel asserts one at a time."""
    x = torch.zeros(4, 16)
    with pytest.raises(CPConfigError) as err:
        Mamba2Mixer(SHAPE)(x, [0, 12], fake_group([0, 1, 2]), mode="headwise")
    assert [(v.field, v.value) for v in err.value.violations] == [("heads", 4), ("groups", 2)]
    assert all("chunkwise" in v.fix for v in err.value.violations)


def test_chunkwise_refuses_zigzag_rows_and_unknown_modes():
    x = torch.zeros(6, 16)
    with pytest.raises(CPConfigError, match="relayout") as err:
        Mamba2Mixer(SHAPE)(x, [0, 12], fake_group([0, 1]), mode="chunkwise", layout="zigzag")
    assert err.value.field == "layout"
    with pytest.raises(CPConfigError) as err:
        Mamba2Mixer(SHAPE)(x, [0, 12], fake_group([0, 1]), mode="ringwise")
    assert err.value.field == "linear_cp_mode"
