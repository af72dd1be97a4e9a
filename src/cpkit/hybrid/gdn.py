"""Gated delta net (GDN) layers under CP, in Megatron-LM's two `linear_cp_mode`s.

- **chunkwise**: tokens stay in the contiguous layout (src/cpkit/hybrid/layout.py). Each rank
  runs its part of every sequence once from a zero state with the identity appended as extra
  state columns (zero values), which gives in one pass its part's transition P and its zero-start
  final state B (the state is linear in the incoming one: S_out = P S_in + B). One all-gather of
  (P, B) per layer lets rank r fold ranks 0..r-1 into its incoming state, and a second pass from
  that state gives the exact output. The causal conv1d receives the previous ranks' last W-1
  tokens of each sequence (its halo) by one all-gather.
- **headwise**: one all-to-all turns this rank's tokens of all heads into all tokens of H/cp
  heads; the conv and the delta rule run on whole sequences; one all-to-all brings the output
  back. It reads any layout (the gathered rows are put in sequence order by their indices), so
  a model in zigzag needs no transition for it.

Both are differentiable through autograd: the collectives' backward sends the gradients back.
The collectives are shared with the Mamba layer (src/cpkit/hybrid/recurrent_cp.py).
Shapes: x [T_local, C] rows of this rank in its layout; `cu_seqlens` global padded offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from cpkit.errors import CPConfigError
from cpkit.hybrid.delta_rule import gated_delta_rule_varlen
from cpkit.hybrid.layout import CpPartitionMode, check_partition_lengths
from cpkit.hybrid.recurrent_cp import (LINEAR_CP_MODES, causal_conv1d_cp, fold_earlier_ranks, gathered_order, heads_in,
                                       heads_out, local_offsets, mode_violations)
from cpkit.parallel.group_info import group_rank, group_size

__all__ = ["LINEAR_CP_MODES", "GDNShape", "gated_delta_rule_cp", "causal_conv1d_cp", "GatedDeltaNet"]


def gated_delta_rule_cp(q, k, v, beta, g, cu_seqlens: Sequence[int], group: Any, scale: Optional[float] = None,
                        chunk_size: int = 64, kernel: str = "auto") -> torch.Tensor:
    """Chunkwise CP: o [T_local, H, V] of this rank's contiguous rows (q, k [T_local, H, K], v
    [T_local, H, V], beta, g [T_local, H]), every sequence starting from a zero state on rank 0.
    `kernel`: src/cpkit/hybrid/delta_rule.py::kernel_for (fla's kernels on GPUs where installed)."""
    cp = group_size(group)
    local = local_offsets(check_partition_lengths(cu_seqlens, cp), cp)
    n, h, dk, dv = len(local) - 1, k.shape[1], k.shape[2], v.shape[2]
    rule = lambda values, start: gated_delta_rule_varlen(q, k, values, beta, g, local, start, scale,  # noqa: E731
                                                         chunk_size, kernel)
    if cp == 1:
        return rule(v, None)[0]
    eye = torch.eye(dk, dtype=torch.float32, device=v.device)
    start = torch.cat([eye.expand(n, h, dk, dk), eye.new_zeros(n, h, dk, dv)], -1)  # [I | 0]: P and B in one pass
    if v.dtype == torch.float64:
        start = start.double()
    summaries = rule(torch.cat([v.new_zeros(v.shape[0], h, dk), v], -1), start)[1]  # [n, H, K, K + V]
    # S_out = P S_in + B, per sequence and head: one all-gather of (P, B)
    entering = fold_earlier_ranks(summaries, group, lambda part, state: part[..., :dk] @ state + part[..., dk:],
                                  (n, h, dk, dv))
    return rule(v, entering)[0]


@dataclass(frozen=True)
class GDNShape:
    """A GDN layer's sizes: hidden, heads, key and value head dims, conv width."""

    hidden: int
    heads: int
    head_k: int
    head_v: int
    conv_width: int = 4


class GatedDeltaNet(torch.nn.Module):
    """A gated delta net layer (Qwen3-Next / Megatron-LM's GatedDeltaNet, without the output
    gate): in_proj -> q, k, v (causal depthwise conv1d, SiLU, q and k L2-normalized), beta =
    sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) -> the gated delta rule -> RMS norm -> out_proj.

    `forward(x, cu_seqlens, group, mode, layout)`: x [T_local, hidden] of this rank, in `layout`
    (chunkwise needs contiguous), `cu_seqlens` the batch's global padded offsets. `core`
    replaces the delta rule and conv (the tests' float64 references at cp 1)."""

    def __init__(self, shape: GDNShape, dtype=torch.float32, device=None, chunk_size: int = 64, kernel: str = "auto"):
        super().__init__()
        s = self.shape = shape
        self.chunk_size, self.kernel = chunk_size, kernel
        kw = dict(dtype=dtype, device=device)
        self.in_proj = torch.nn.Linear(s.hidden, s.heads * (2 * s.head_k + s.head_v + 2), bias=False, **kw)
        self.conv_weight = torch.nn.Parameter(torch.randn(s.heads * (2 * s.head_k + s.head_v), s.conv_width, **kw) * 0.5)
        self.A_log = torch.nn.Parameter(torch.rand(s.heads, **kw).log())
        self.dt_bias = torch.nn.Parameter(torch.randn(s.heads, **kw) * 0.1)
        self.norm_weight = torch.nn.Parameter(torch.ones(s.head_v, **kw))
        self.out_proj = torch.nn.Linear(s.heads * s.head_v, s.hidden, bias=False, **kw)

    def _split(self, x):
        s = self.shape
        sizes = [s.heads * s.head_k, s.heads * s.head_k, s.heads * s.head_v, s.heads, s.heads]
        return torch.split(self.in_proj(x), sizes, -1)

    def _gates(self, b, a):
        return torch.sigmoid(b), -self.A_log.exp() * F.softplus(a + self.dt_bias)

    def _finish(self, o):  # o [T, H, V]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return self.out_proj(o.reshape(o.shape[0], -1))

    def _qkv(self, mixed, t, heads):
        s = self.shape
        q, k, v = torch.split(F.silu(mixed), [heads * s.head_k, heads * s.head_k, heads * s.head_v], -1)
        q = F.normalize(q.reshape(t, heads, s.head_k), dim=-1)
        k = F.normalize(k.reshape(t, heads, s.head_k), dim=-1)
        return q, k, v.reshape(t, heads, s.head_v)

    def forward(self, x: torch.Tensor, cu_seqlens: Sequence[int], group: Any, mode: str = "chunkwise",
                layout: CpPartitionMode | str = CpPartitionMode.CONTIGUOUS, core=None) -> torch.Tensor:
        s, cp = self.shape, group_size(group)
        layout = CpPartitionMode(layout)
        problems = mode_violations(mode, layout, s.heads, cp)
        if problems:
            raise CPConfigError(problems)
        cu = check_partition_lengths(cu_seqlens, cp)
        q, k, v, b, a = self._split(x)
        beta, g = self._gates(b, a)
        mixed = torch.cat([q, k, v], -1)
        if core is not None:  # the reference path at cp 1
            mixed = torch.cat([core.conv(mixed[lo:hi], self.conv_weight) for lo, hi in zip(cu, cu[1:])])
            q, k, v = self._qkv(mixed.to(x.dtype), x.shape[0], s.heads)
            o = torch.cat([core.rule(q[lo:hi], k[lo:hi], v[lo:hi], beta[lo:hi], g[lo:hi]) for lo, hi in zip(cu, cu[1:])])
            return self._finish(o.to(x.dtype))
        if mode == "chunkwise" or cp == 1:  # at cp 1 both modes are the plain layer (and None is no group)
            mixed = causal_conv1d_cp(mixed, self.conv_weight, cu, group)
            q, k, v = self._qkv(mixed, x.shape[0], s.heads)
            o = gated_delta_rule_cp(q, k, v, beta, g, cu, group, chunk_size=self.chunk_size, kernel=self.kernel)
            return self._finish(o)
        order = gathered_order(cu, cp, layout, x.device)
        h = s.heads // cp
        rank = group_rank(group)
        qkv = [t.reshape(x.shape[0], s.heads, -1) for t in torch.split(mixed, [s.heads * s.head_k] * 2 + [s.heads * s.head_v], -1)]
        gathered = [heads_in(t, cp, group, order) for t in (*qkv, beta.unsqueeze(-1), g.unsqueeze(-1))]
        weights = [w.reshape(s.heads, -1, s.conv_width)[rank * h:(rank + 1) * h].reshape(-1, s.conv_width)
                   for w in torch.split(self.conv_weight, [s.heads * s.head_k] * 2 + [s.heads * s.head_v])]
        # whole sequences now: the conv and the rule run as at cp 1 (group None), on this rank's heads
        convolved = [causal_conv1d_cp(t.reshape(t.shape[0], -1), w, cu, None) for t, w in zip(gathered[:3], weights)]
        q, k, v = self._qkv(torch.cat(convolved, -1), convolved[0].shape[0], h)
        o = gated_delta_rule_cp(q, k, v, gathered[3].squeeze(-1), gathered[4].squeeze(-1), cu, None,
                                chunk_size=self.chunk_size, kernel=self.kernel)
        return self._finish(heads_out(o, cp, group, order))

