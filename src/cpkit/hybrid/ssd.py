"""Mamba-2's SSD scan in its chunked form, pure PyTorch (runs everywhere; the CPU tests stand on it).

Per head h, with state S [P, N] and head h reading group g(h) = h // (H/G) of B and C (Mamba-2's
ngroups), dt_t = softplus(dt_t + dt_bias) where asked (as mamba_ssm's dt_softplus), A_h < 0:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D_h x_t

Chunked (chunks of c tokens, cumulative log decay L_i = sum_{k <= i} dt_k A inside a chunk), from
the incoming state S:

    y_i = exp(L_i) S C_i + sum_{j <= i} exp(L_i - L_j) (C_i . B_j) dt_j x_j + D x_i
    S'  = exp(L_c) S + sum_j exp(L_c - L_j) dt_j x_j B_j^T

The terms inside a chunk run for every chunk at once (a masked decay matrix); the state passes from
chunk to chunk in a loop. The state is linear in the incoming one with a scalar transition per
head, exp(sum of dt A), which is what CP uses (src/cpkit/hybrid/mamba.py).
Shapes: x [b, T, H, P]; dt [b, T, H]; A [H]; B, C [b, T, G, N]; D [H] (or [H, P]); state [b, H, P, N].
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

__all__ = ["ssd_scan", "ssd_scan_varlen", "discretize_dt"]


def discretize_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False) -> torch.Tensor:
    """The step sizes the scan uses: dt (+ dt_bias per head), through softplus where asked."""
    dt = dt if dt_bias is None else dt + dt_bias
    return F.softplus(dt) if dt_softplus else dt


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int = 64, D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
             dt_softplus: bool = False,
             initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, T, H, P], final state [b, H, P, N]) of a batch of equal-length sequences (sbhd) from
    `initial_state` (zeros when None); the arguments as mamba_ssm's mamba_chunk_scan_combined.
    Computes in float32 at least (float64 stays float64); `y` comes back in x's dtype."""
    b, t, h, p = x.shape
    n = B.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    state = (x.new_zeros((b, h, p, n), dtype=dtype) if initial_state is None else initial_state.to(dtype))
    steps = discretize_dt(dt.to(dtype), dt_bias, dt_softplus)
    y, state = _chunked_scan(x.to(dtype), steps, A.to(dtype), B.to(dtype), C.to(dtype), state, chunk_size)
    if D is not None:
        y = y + (D if D.dim() == 2 else D[:, None]).to(dtype) * x
    return y.to(x.dtype), state


def _chunked_scan(x, dt, A, B, C, state, c: int):
    """The scan proper, dt already discretized; padding tokens get dt 0 (no decay, no write)."""
    b, t, h, p = x.shape
    heads_per_group = h // B.shape[-2]
    if t == 0:
        return x.new_zeros((b, 0, h, p)), state  # an empty sequence passes its state on unchanged
    pad = -t % c
    k = (t + pad) // c

    def chunks(z: torch.Tensor) -> torch.Tensor:  # [b, T, ...] -> [b, K, c, ...]
        z = F.pad(z, (0, 0) * (z.dim() - 2) + (0, pad)) if pad else z
        return z.reshape(b, k, c, *z.shape[2:])

    x, dt, B, C = chunks(x), chunks(dt), chunks(B), chunks(C)
    log_decay = (dt * A).cumsum(2)  # L_i, [b, K, c, H]
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    diff = log_decay.unsqueeze(3) - log_decay.unsqueeze(2)  # [b, K, c(i), c(j), H]: L_i - L_j
    decay = diff.masked_fill(~lower[..., None], float("-inf")).exp()  # exp(L_i - L_j) for j <= i, else 0
    scores = torch.einsum("bkign,bkjgn->bkijg", C, B).repeat_interleave(heads_per_group, -1)
    written = x * dt.unsqueeze(-1)  # dt_j x_j
    y = torch.einsum("bkijh,bkjhp->bkihp", scores * decay, written)
    B_heads, C_heads = B.repeat_interleave(heads_per_group, -2), C.repeat_interleave(heads_per_group, -2)
    to_end = (log_decay[:, :, -1:] - log_decay).exp()  # exp(L_c - L_j)
    own = torch.einsum("bkjh,bkjhp,bkjhn->bkhpn", to_end, written, B_heads)  # each chunk's state from zero
    through = log_decay[:, :, -1].exp()  # [b, K, H]: a chunk's transition
    entering = []
    for i in range(k):
        entering.append(state)
        state = through[:, i, :, None, None] * state + own[:, i]
    entering = torch.stack(entering, 1)  # [b, K, H, P, N]
    y = y + torch.einsum("bkihn,bkhpn->bkihp", C_heads, entering) * log_decay.exp().unsqueeze(-1)
    return y.reshape(b, k * c, h, p)[:, :t], state


def ssd_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    offsets: Sequence[int], chunk_size: int = 64, D: Optional[torch.Tensor] = None,
                    dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                    initial_states: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over packed sequences (THD: rows [offsets[i], offsets[i+1]) each a sequence; x [T, H,
    P], dt [T, H], B, C [T, G, N]): (y [T, H, P], final states [n, H, P, N]); `initial_states` [n, H,
    P, N] or None (zeros). The sequences run as one batch, each padded at its end to the longest
    (dt 0 there: the state passes unchanged), so an empty sequence passes its initial state through."""
    spans = list(zip(offsets, offsets[1:]))
    n, (h, p), dn = len(spans), x.shape[1:], B.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    if not spans or max(b - a for a, b in spans) == 0:
        start = x.new_zeros((n, h, p, dn), dtype=dtype) if initial_states is None else initial_states.to(dtype)
        return x[:0], start
    steps = discretize_dt(dt.to(dtype), dt_bias, dt_softplus)
    batch = lambda z: pad_sequence([z[a:b] for a, b in spans], batch_first=True)  # noqa: E731
    y, finals = ssd_scan(batch(x), batch(steps), A, batch(B), batch(C), chunk_size, D, initial_state=initial_states)
    return torch.cat([y[i, :b - a] for i, (a, b) in enumerate(spans)]), finals
