"""Attention sinks (MCore `softmax_type` "off-by-one" and "learnable"): one extra logit per head.

The sink is a key with no value: softmax over [scores, sink] with the sink's probability
dropped. For an attention whose output is `out` and log-sum-exp `lse` over the real keys:
    lse' = logaddexp(lse, sink),    out' = out * exp(lse - lse') = out * sigmoid(lse - sink).
"off-by-one" is sink = 0 (the +1 in the denominator), "learnable" a trained logit per head.

The sink enters once, after the last LSE merge of a CP variant, never per block. The variants
keep the corrected `out'` and `lse'` for backward, so the kernels' recomputed probabilities
exp(s - lse') are already the sink softmax's and dq, dk, dv need no other change. The sink's
own gradient is dsink_h = -sum over the head's rows of p_sink * D, with p_sink = exp(sink - lse')
and D = rowsum(dout' * out') (the term every attention backward computes).

Layouts as in `merge.py`: out [s, b, h, d] or [t, h, d], lse [b, h, s] or [h, t], sink [h].
"""

from __future__ import annotations

import torch

from cpkit.attention.merge import lse_as_out

__all__ = ["apply_sink", "sink_grad"]


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse'): the attention of `out`/`lse` with the per-head logits `sink` ([h], any float
    dtype) in the softmax denominator. out' is float32 (round it once where it is stored); lse'
    float32. Rows without keys (lse = -inf) get out' = 0 and lse' = sink."""
    s = sink.detach().float().view(-1, 1)  # broadcasts over lse's [..., h, tokens]
    lse = lse.float()
    weight = torch.sigmoid(lse - s)
    return out.float() * lse_as_out(weight), torch.logaddexp(lse, s)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink (float32 [h]) of this rank's rows, from the corrected `out` and `lse`
    (`apply_sink`'s results) and the output gradient `dout`."""
    s = sink.detach().float().view(-1, 1)
    p_sink = lse_as_out(torch.exp(s - lse.float())).squeeze(-1)  # [s, b, h] or [t, h]
    d = (dout.float() * out.float()).sum(-1)
    return -(p_sink * d).flatten(0, -2).sum(0)
