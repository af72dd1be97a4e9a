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

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_varlen", "kernel_for", "fla_refusal"]


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


def _fla():
    """flash-linear-attention's chunked kernel, or None where it is not installed (CPU CI)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except Exception:  # not installed, or its Triton does not load here: the PyTorch form runs
        return None
    return kernel


def fla_refusal(device: torch.device) -> str | None:
    """Why fla's gated delta rule cannot train on `device` here, or None. fla 0.6.0 refuses its
    gated backward (chunk_bwd_dqkwg) on Hopper with Triton >= 3.4.0 and < 3.7.1, which compute it
    wrong (fla's own check: Triton >= 3.4.0, < 3.7.1 compiles it wrong), unless tilelang is installed; seen on H200 with torch 2.11's Triton."""
    if _fla() is None:
        return "flash-linear-attention (fla) is not importable"
    if device.type != "cuda":
        return f"fla's kernels are Triton: CUDA only, not {device.type}"
    import importlib.util

    import triton

    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if hopper and (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
        return (f"fla refuses its gated backward on Hopper with Triton {triton.__version__} (>= 3.4.0, < 3.7.1 "
                "computes it wrong, fla's own check) unless tilelang is installed")
    return None


def kernel_for(x: torch.Tensor, kernel: str = "auto") -> str:
    """Which implementation runs the rule for `x`: "fla" (flash-linear-attention's Triton kernels:
    CUDA, bf16/fp16/fp32, where fla_refusal finds nothing against it), else "torch"
    (chunk_gated_delta_rule: everywhere, float64 too). `kernel` forces one ("torch" or "fla")."""
    from cpkit.errors import CPConfigError

    if kernel not in ("auto", "torch", "fla"):
        raise CPConfigError.single("kernel", kernel, "must be 'auto', 'torch' or 'fla'", "use 'auto'")
    if kernel == "torch":
        return "torch"
    why = fla_refusal(x.device) or (None if x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                                    else f"fla takes bf16, fp16 or fp32, not {x.dtype}")
    if kernel == "fla" and why:
        raise CPConfigError.single("kernel", kernel, f"fla cannot run here: {why}", "use kernel='auto'")
    return "torch" if why else "fla"


def gated_delta_rule_varlen(q, k, v, beta, g, offsets, initial_state=None, scale=None, chunk_size: int = 64,
                            kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over packed sequences (rows [offsets[i], offsets[i+1]) each a sequence): (o [T, H, V],
    final states [N, H, K, V]); `initial_state` [N, H, K, V] or None (zeros). One fla call for
    all sequences on GPU (its varlen form), a loop of chunk_gated_delta_rule elsewhere. An empty
    sequence passes its initial state through."""
    n, h, dk, dv = len(offsets) - 1, k.shape[1], k.shape[2], v.shape[2]
    spans = list(zip(offsets, offsets[1:]))
    if kernel_for(v, kernel) == "torch":
        outs, finals = [], []
        for i, (a, b) in enumerate(spans):
            o, s = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], beta[a:b], g[a:b],
                                          None if initial_state is None else initial_state[i], scale, chunk_size)
            outs.append(o)
            finals.append(s)
        state_dtype = torch.promote_types(v.dtype, torch.float32)
        return (torch.cat(outs) if outs else v[:0],
                torch.stack(finals) if finals else v.new_zeros((0, h, dk, dv), dtype=state_dtype))
    full = [i for i, (a, b) in enumerate(spans) if b > a]
    start = (torch.zeros(n, h, dk, dv, dtype=torch.float32, device=v.device) if initial_state is None
             else initial_state.float())
    if not full:
        return v[:0], start
    cu = torch.tensor([0] + [b - a for a, b in spans if b > a], device=v.device).cumsum(0)
    o, finals = _fla()(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(), beta.unsqueeze(0),
                       scale=scale, initial_state=start[full], output_final_state=True, cu_seqlens=cu)
    index = torch.tensor(full, device=v.device)
    return o.squeeze(0), start.index_copy(0, index, finals.to(start.dtype))
