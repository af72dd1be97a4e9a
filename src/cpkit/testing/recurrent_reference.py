"""Independent references for recurrent layers under CP: token-by-token recurrences in float64
(the gated delta rule, Mamba-2's SSD) and a tap-by-tap causal conv, sharing no code with the
chunked paths they check (src/cpkit/hybrid/)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["gated_delta_rule_reference", "ssd_reference", "causal_conv1d_reference"]


def gated_delta_rule_reference(q, k, v, beta, g, initial_state: Optional[torch.Tensor] = None,
                               scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, H, V], final state [H, K, V]), one token at a time in float64:
    S = exp(g_t) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)."""
    t, h, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, beta, g = (x.double() for x in (q, k, v, beta, g))
    state = torch.zeros(h, dk, v.shape[-1], dtype=torch.float64, device=v.device) if initial_state is None \
        else initial_state.double()
    outs = []
    for i in range(t):
        state = state * g[i].exp()[:, None, None]
        error = v[i] - torch.einsum("hkv,hk->hv", state, k[i])
        state = state + beta[i][:, None, None] * torch.einsum("hk,hv->hkv", k[i], error)
        outs.append(torch.einsum("hkv,hk->hv", state, q[i] * scale))
    o = torch.stack(outs) if outs else v.new_zeros((0, h, v.shape[-1]))
    return o, state


def ssd_reference(x, dt, A, B, C, D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                  dt_softplus: bool = False,
                  initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSD recurrence, (y [T, H, P], final state [H, P, N]), one token at a time in float64,
    x [T, H, P], dt [T, H], A [H], B, C [T, G, N] (head h reads group h // (H/G)):
    dt = log(1 + exp(dt + dt_bias));  S = exp(dt A) S + dt x B^T;  y = S C + D x."""
    t, h, p = x.shape
    groups, n = B.shape[1:]
    x, dt, A, B, C = (z.double() for z in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = torch.log1p(torch.exp(dt))
    group_of_head = [head * groups // h for head in range(h)]
    state = torch.zeros(h, p, n, dtype=torch.float64, device=x.device) if initial_state is None \
        else initial_state.double()
    outs = []
    for i in range(t):
        b_i, c_i = B[i, group_of_head], C[i, group_of_head]  # [H, N]
        state = torch.exp(dt[i] * A)[:, None, None] * state + torch.einsum("hp,hn->hpn", dt[i][:, None] * x[i], b_i)
        y = torch.einsum("hpn,hn->hp", state, c_i)
        if D is not None:
            y = y + (D.double() if D.dim() == 2 else D.double()[:, None]) * x[i]
        outs.append(y)
    return (torch.stack(outs) if outs else x.new_zeros((0, h, p))), state


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution of one sequence, x [T, C], weight [C, W]: out_t = sum_j
    weight[:, j] x_{t - (W - 1) + j}, zeros before the start; float64, a loop over taps."""
    x, weight = x.double(), weight.double()
    width = weight.shape[1]
    out = torch.zeros_like(x)
    for j in range(width):
        shift = width - 1 - j
        if shift < x.shape[0]:
            out[shift:] += weight[:, j] * x[: x.shape[0] - shift]
    return out
