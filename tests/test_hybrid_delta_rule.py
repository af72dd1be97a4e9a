"""The chunked gated delta rule (src/cpkit/hybrid/delta_rule.py) against a token-by-token float64
recurrence that shares no code with it (src/cpkit/testing/recurrent_reference.py): outputs, final
state and every gradient, from a zero and from a given state, at lengths that fill chunks and
lengths that do not."""

from __future__ import annotations

import pytest
import torch

from cpkit.hybrid.delta_rule import chunk_gated_delta_rule
from cpkit.testing.recurrent_reference import gated_delta_rule_reference

#: float64 chunked vs float64 token loop: only rounding differs.
TOL64 = dict(atol=1e-10, rtol=1e-10)


def _inputs(t, h=2, dk=4, dv=3, seed=0, state=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dk, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(t, h, dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(t, h, generator=gen, dtype=torch.float64)
    g = -torch.rand(t, h, generator=gen, dtype=torch.float64) * 0.5
    s0 = torch.randn(h, dk, dv, generator=gen, dtype=torch.float64) if state else None
    return [x.requires_grad_(True) for x in (q, k, v, beta, g)], s0


@pytest.mark.parametrize("t,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (32, 64), (0, 4)])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_equals_the_token_loop_with_gradients(t, chunk, state):
    (q, k, v, beta, g), s0 = _inputs(t, state=state)
    o, s = chunk_gated_delta_rule(q, k, v, beta, g, initial_state=s0, chunk_size=chunk)
    o_ref, s_ref = gated_delta_rule_reference(q, k, v, beta, g, initial_state=s0)
    torch.testing.assert_close(o, o_ref, **TOL64)
    torch.testing.assert_close(s, s_ref, **TOL64)
    if t == 0:
        return
    w = torch.randn_like(o_ref)
    grads = torch.autograd.grad((o * w).sum() + s.sum(), (q, k, v, beta, g))
    grads_ref = torch.autograd.grad((o_ref * w).sum() + s_ref.sum(), (q, k, v, beta, g))
    for name, a, b in zip("q k v beta g".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, **TOL64, msg=lambda m, n=name: f"d{n}: {m}")


def test_the_state_is_linear_in_the_incoming_state():
    """What chunkwise CP relies on: S_T(S0) = P S0 + S_T(0), P from the identity with zero values."""
    (q, k, v, beta, g), s0 = _inputs(11, state=True)
    _, s_zero = chunk_gated_delta_rule(q, k, v, beta, g, chunk_size=4)
    _, p = chunk_gated_delta_rule(q, k, torch.zeros(11, 2, 4, dtype=torch.float64), beta, g,
                                  initial_state=torch.eye(4, dtype=torch.float64).expand(2, 4, 4), chunk_size=4)
    _, s_full = chunk_gated_delta_rule(q, k, v, beta, g, initial_state=s0, chunk_size=4)
    torch.testing.assert_close(s_full, p @ s0 + s_zero, **TOL64)
