"""The gated delta rule in its chunked form, pure PyTorch (runs everywhere; the CPU tests stand on it).

Per head, with state S [K, V], decay a_t = exp(g_t) (g_t <= 0), write strength beta_t in [0, 1]:

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T (scale * q_t)

Chunked (chunks of C tokens, cumulative log decay G_i inside a chunk): with A_ij = beta_i (k_i . k_j)
exp(G_i - G_j) for j < i and T = (I + A)^-1 (a unit lower-triangular solve), U = T (beta v) and
W = T (beta k exp(G)); from the incoming state S:

    V' = U - W S,   o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) V',   S' = exp(G_C) S + (k exp(G_C - G))^T V'

The state is linear in the incoming state, which is what CP uses (src/cpkit/hybrid/gdn.py).
Shapes: q, k [T, H, K]; v [T, H, V]; beta, g [T, H]; state [H, K, V]. One sequence per call.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                           initial_state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, H, V], final state [H, K, V]) of one sequence from `initial_state` (zeros when None).
    Computes in float32 at least (float64 stays float64); `o` comes back in v's dtype."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    out_dtype, dtype = v.dtype, torch.promote_types(v.dtype, torch.float32)
    scale = dk ** -0.5 if scale is None else scale
    state = (torch.zeros(h, dk, dv, dtype=dtype, device=v.device) if initial_state is None
             else initial_state.to(dtype))
    if t == 0:
        return v.new_zeros((0, h, dv)), state  # an empty sequence passes its state on unchanged
    c = chunk_size
    pad = -t % c
    n = (t + pad) // c

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, *] -> [H, N, C, *]; padding: beta 0, g 0
        x = torch.nn.functional.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad)) if pad else x.to(dtype)
        return x.reshape(n, c, h, *x.shape[2:]).movedim(2, 0)

    q, k, v = chunks(q) * scale, chunks(k), chunks(v)
    beta, g = chunks(beta.unsqueeze(-1)).squeeze(-1), chunks(g.unsqueeze(-1)).squeeze(-1)
    gcum = g.cumsum(-1)  # [H, N, C]
    diff = gcum.unsqueeze(-1) - gcum.unsqueeze(-2)  # G_i - G_j
    lower = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    decay = diff.masked_fill(~lower, float("-inf")).exp()  # exp(G_i - G_j) for j <= i, else 0
    k_beta = k * beta.unsqueeze(-1)
    a = (k_beta @ k.transpose(-1, -2)) * decay.tril(-1)
    eye = torch.eye(c, dtype=dtype, device=v.device)
    solve = lambda rhs: torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)  # noqa: E731
    u = solve(v * beta.unsqueeze(-1))
    w = solve(k_beta * gcum.exp().unsqueeze(-1))
    intra = (q @ k.transpose(-1, -2)) * decay  # inclusive of the diagonal: o_t sees its own write
    outs = []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        outs.append((q[:, i] * gcum[:, i].exp().unsqueeze(-1)) @ state + intra[:, i] @ v_new)
        last = gcum[:, i, -1]
        state = (state * last.exp()[:, None, None]
                 + (k[:, i] * (last.unsqueeze(-1) - gcum[:, i]).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new)
    o = torch.stack(outs, 1).reshape(h, n * c, dv)[:, :t].movedim(0, 1)
    return o.to(out_dtype), state
