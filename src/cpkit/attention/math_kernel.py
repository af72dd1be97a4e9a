"""The `math` kernel: exact attention in plain PyTorch (float32 scores, O(s^2) memory), with
the LSE and a hand-written backward, in the kernels' call shape (cpkit.attention.kernels); and
`reference_attention`, the same attention through autograd, the tests' reference.

Dense only: q [s, b, h, d], k [s_k, b, h_kv, d], v [s_k, b, h_kv, d_v] (v may have its own head
dim); GQA by grouping query heads over each KV head, without copying KV.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from cpkit.attention.views import bhsd, expand_kv, from_bhsd

__all__ = ["math_bwd", "math_fwd", "math_scores", "reference_attention"]


def math_scores(q, k, causal, scale):
    """(q, k as float32 [b, h_kv, g, s, d] / [b, h_kv, 1, s_k, d], scaled scores
    [b, h_kv, g, s, s_k] with -inf above the diagonal when `causal`)."""
    s, b, h, d = q.shape
    kv_heads = k.shape[2]
    qf = bhsd(q.float()).reshape(b, kv_heads, h // kv_heads, s, d)
    kf = bhsd(k.float()).unsqueeze(2)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [b, hkv, g, s, s_k]
    if causal:
        mask = torch.ones(s, k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return qf, kf, scores


def math_fwd(q, k, v, causal, scale):
    """(out like q with v's head dim, float32 LSE [b, h, s])."""
    s, b, h, d = q.shape
    _, _, scores = math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(p, bhsd(v.float()).unsqueeze(2))  # [b, hkv, g, s, d]
    return from_bhsd(out.reshape(b, h, s, -1)).to(q.dtype), lse.reshape(b, h, s)


def math_bwd(dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) in the dtypes of q, k, v, from the final `out` and `lse` of the attention."""
    s, b, h, d = q.shape
    kv_heads = k.shape[2]
    qf, kf, scores = math_scores(q, k, causal, scale)
    g = h // kv_heads
    p = torch.exp(scores - lse.reshape(b, kv_heads, g, s).unsqueeze(-1))
    do = bhsd(dout.float()).reshape(b, kv_heads, g, s, -1)
    of = bhsd(out.float()).reshape(b, kv_heads, g, s, -1)
    vf = bhsd(v.float()).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # [b, hkv, s_k, d]
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * of).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
    return (
        from_bhsd(dq.reshape(b, h, s, -1)).to(q.dtype),
        from_bhsd(dk).to(k.dtype),
        from_bhsd(dv).to(v.dtype),
    )


def reference_attention(q, k, v, causal: bool, scale: Optional[float] = None) -> torch.Tensor:
    """Plain-PyTorch attention through autograd (materializes the scores): the test reference.

    Dense q [s, b, h, d], k/v [s, b, h_kv, d]; computed in float32, returned in q.dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    h = q.shape[-2]
    qf, kf, vf = q.float(), expand_kv(k, h).float(), expand_kv(v, h).float()
    scores = torch.einsum("sbhd,tbhd->bhst", qf, kf) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, -1), vf).to(q.dtype)
