"""Mamba-2's chunked SSD scan (src/cpkit/hybrid/ssd.py) against a token-by-token float64 recurrence
that shares no code with it (src/cpkit/testing/recurrent_reference.py::ssd_reference): the output,
the final state and the gradient of every input (x, dt, A, B, C, D, dt_bias and the initial
state), batched (sbhd) and over packed sequences (THD) with empty and one-token sequences, at
lengths that fill chunks and lengths that do not, with heads sharing B and C in groups."""

from __future__ import annotations

import pytest
import torch

from cpkit.hybrid.ssd import ssd_scan, ssd_scan_varlen
from cpkit.testing.recurrent_reference import ssd_reference

#: float64 chunked vs float64 token loop: only rounding differs.
TOL64 = dict(atol=1e-10, rtol=1e-10)
HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5
NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial state")


def _inputs(lead: tuple[int, ...], t: int, states: tuple[int, ...] | None, seed: int = 0) -> list[torch.Tensor]:
    """x, dt (before dt_bias and softplus), A < 0, B, C, D, dt_bias and the initial state(s) (or
    None), each a float64 leaf that requires grad."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    tensors = [rand(*lead, t, HEADS, HEAD_DIM), rand(*lead, t, HEADS) * 0.5,
               -(0.5 + torch.rand(HEADS, generator=gen, dtype=torch.float64)),
               rand(*lead, t, GROUPS, STATE), rand(*lead, t, GROUPS, STATE), rand(HEADS), rand(HEADS) * 0.3,
               None if states is None else rand(*states, HEADS, HEAD_DIM, STATE)]
    return [z if z is None else z.requires_grad_(True) for z in tensors]


def _assert_same_with_gradients(got, want, leaves):
    (y, s), (y_ref, s_ref) = got, want
    torch.testing.assert_close(y, y_ref, **TOL64)
    torch.testing.assert_close(s, s_ref, **TOL64)
    if y.numel() == 0:
        return
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    used = [(name, z) for name, z in zip(NAMES, leaves) if z is not None]
    grads = torch.autograd.grad((y * w).sum() + s.sum(), [z for _, z in used])
    grads_ref = torch.autograd.grad((y_ref * w).sum() + s_ref.sum(), [z for _, z in used])
    for (name, _), a, b in zip(used, grads, grads_ref):
        torch.testing.assert_close(a, b, **TOL64, msg=lambda m, n=name: f"d{n}: {m}")


def _reference(x, dt, A, B, C, D, dt_bias, s0):
    return ssd_reference(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True, initial_state=s0)


@pytest.mark.parametrize("t,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (0, 4), (130, 64)])
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "given-state"])
def test_batched_scan_equals_the_token_loop_with_every_gradient(t, chunk, state):
    x, dt, A, B, C, D, dt_bias, s0 = leaves = _inputs((2,), t, (2,) if state else None)
    got = ssd_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True, initial_state=s0)
    per_row = [_reference(x[i], dt[i], A, B[i], C[i], D, dt_bias, None if s0 is None else s0[i]) for i in range(2)]
    want = torch.stack([y for y, _ in per_row]), torch.stack([s for _, s in per_row])
    _assert_same_with_gradients(got, want, leaves)


@pytest.mark.parametrize("lengths", [[5, 0, 1, 9], [0], [3, 4]], ids=["mixed-with-empty", "one-empty", "short"])
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "given-state"])
def test_varlen_scan_equals_the_token_loop_per_sequence_with_every_gradient(lengths, state):
    offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
    x, dt, A, B, C, D, dt_bias, s0 = leaves = _inputs((), offsets[-1], (len(lengths),) if state else None)
    got = ssd_scan_varlen(x, dt, A, B, C, offsets, 4, D=D, dt_bias=dt_bias, dt_softplus=True, initial_states=s0)
    per_seq = [_reference(x[a:b], dt[a:b], A, B[a:b], C[a:b], D, dt_bias, None if s0 is None else s0[i])
               for i, (a, b) in enumerate(zip(offsets, offsets[1:]))]
    want = torch.cat([y for y, _ in per_seq]), torch.stack([s for _, s in per_seq])
    _assert_same_with_gradients(got, want, leaves)


def test_the_state_is_linear_in_the_incoming_state_with_a_scalar_transition_per_head():
    """What chunkwise CP relies on: S_T(S0) = exp(sum_t dt_t A) S0 + S_T(0), per head."""
    x, dt, A, B, C, D, dt_bias, s0 = _inputs((1,), 11, (1,))
    _, s_zero = ssd_scan(x, dt, A, B, C, 4, D=D, dt_bias=dt_bias, dt_softplus=True)
    _, s_full = ssd_scan(x, dt, A, B, C, 4, D=D, dt_bias=dt_bias, dt_softplus=True, initial_state=s0)
    transition = (torch.nn.functional.softplus(dt + dt_bias) * A).sum(1).exp()  # [1, H]
    torch.testing.assert_close(s_full, transition[..., None, None] * s0 + s_zero, **TOL64)


def test_float32_inputs_compute_in_float32_and_keep_their_dtype():
    x, dt, A, B, C, D, dt_bias, _ = (z if z is None else z.detach().float() for z in _inputs((1,), 9, None))
    y, s = ssd_scan(x, dt, A, B, C, 4, D=D, dt_bias=dt_bias, dt_softplus=True)
    y_ref, s_ref = _reference(x[0], dt[0], A, B[0], C[0], D, dt_bias, None)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(y[0].double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s[0].double(), s_ref, atol=1e-5, rtol=1e-5)
