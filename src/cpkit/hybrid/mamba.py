"""Mamba-2 mixers under CP, in Megatron-LM's two `linear_cp_mode`s, as gdn.py runs the GDN.

- **chunkwise**: tokens stay in the contiguous layout (src/cpkit/hybrid/layout.py). Each rank
  scans its part of every sequence from a zero state, which gives the part's zero-start final
  state; the part's transition is a scalar per head, exp(sum of dt A over the part). One
  all-gather of (log transition, state) per layer lets rank r fold ranks 0..r-1 into its incoming
  state, and a second scan from that state gives the exact output. The causal conv1d over x, B, C
  receives the previous ranks' last W-1 tokens by one all-gather.
- **headwise** (what MCore's MambaContextParallel does): all-to-alls turn this rank's tokens of
  all heads into all tokens of H/cp heads (and of their groups of B and C, repeated where there
  are fewer groups than ranks); the conv and the scan run on whole sequences with this rank's
  slices of the conv, dt_bias, A_log and D; one all-to-all brings y back. It reads either layout.

The gate z stays on its rank in both modes: y * silu(z) after y is back. Both are
differentiable through autograd (the collectives are src/cpkit/hybrid/recurrent_cp.py).
Shapes: x [T_local, hidden] rows of this rank in its layout; `cu_seqlens` global padded offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from cpkit.errors import CPConfigError, Violation
from cpkit.hybrid.layout import CpPartitionMode, check_partition_lengths
from cpkit.hybrid.recurrent_cp import (causal_conv1d_cp, fold_earlier_ranks, gathered_order, heads_in, heads_out,
                                       local_offsets, mode_violations)
from cpkit.hybrid.ssd import discretize_dt, ssd_scan_varlen
from cpkit.parallel.group_info import group_rank, group_size

__all__ = ["Mamba2Shape", "ssd_scan_cp", "Mamba2Mixer"]


def ssd_scan_cp(x, dt, A, B, C, cu_seqlens: Sequence[int], group: Any, D: Optional[torch.Tensor] = None,
                dt_bias: Optional[torch.Tensor] = None, chunk_size: int = 64) -> torch.Tensor:
    """Chunkwise CP: y [T_local, H, P] of this rank's contiguous rows (x [T_local, H, P], raw dt
    [T_local, H] (softplus(dt + dt_bias) inside), A [H], B, C [T_local, G, N]), every sequence
    starting from a zero state on rank 0. Over `group`: one all-gather (an all-reduce backward)."""
    cp = group_size(group)
    local = local_offsets(check_partition_lengths(cu_seqlens, cp), cp)
    n, (h, p), dn = len(local) - 1, x.shape[1:], B.shape[-1]
    dt = discretize_dt(dt.to(torch.promote_types(x.dtype, torch.float32)), dt_bias, dt_softplus=True)
    scan = lambda start: ssd_scan_varlen(x, dt, A, B, C, local, chunk_size, D=D, initial_states=start)  # noqa: E731
    if cp == 1:
        return scan(None)[0]
    finals = scan(None)[1]  # [n, H, P, N]: each part's state from zero
    sequence_of_row = torch.repeat_interleave(torch.arange(n, device=x.device),
                                              torch.tensor([b - a for a, b in zip(local, local[1:])], device=x.device))
    log_transition = finals.new_zeros(n, h).index_add(0, sequence_of_row, dt * A)  # sum of dt A per part
    summary = torch.cat([log_transition.unsqueeze(-1), finals.flatten(-2)], -1)  # [n, H, 1 + P*N]
    entering = fold_earlier_ranks(summary, group, _fold, (n, h, p, dn))  # one all-gather
    return scan(entering)[0]


def _fold(part: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """S_out = exp(log transition) S_in + S_zero, per sequence and head."""
    return part[..., :1].exp().unsqueeze(-1) * state + part[..., 1:].reshape(state.shape)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 mixer's sizes, as MCore's config names them: hidden, heads (mamba_num_heads), head
    dim P (mamba_head_dim), state N (mamba_state_dim), groups of heads sharing B and C
    (mamba_num_groups), conv width (d_conv)."""

    hidden: int
    heads: int
    head_dim: int
    state: int
    groups: int = 1
    conv_width: int = 4

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def violations(self) -> list[Violation]:
        """What MCore's MambaMixer asserts about these sizes, with the fix."""
        problems = [Violation(name, value, "must be positive", f"use {name} >= 1")
                    for name, value in (("hidden", self.hidden), ("heads", self.heads), ("head_dim", self.head_dim),
                                        ("state", self.state), ("groups", self.groups),
                                        ("conv_width", self.conv_width)) if value < 1]
        if not problems and self.heads % self.groups:
            problems.append(Violation("groups", self.groups, f"every group has the same number of heads: must divide "
                                      f"heads={self.heads}", f"use a divisor of {self.heads}, e.g. 1"))
        return problems


def group_violations(groups: int, cp: int) -> list[Violation]:
    """Headwise CP gives each rank H/cp heads and whole groups of B and C, or one group repeated
    over cp/groups ranks (MCore's MambaContextParallel): groups and cp must divide one another."""
    if cp <= 1 or groups % cp == 0 or cp % groups == 0:
        return []
    return [Violation("groups", groups, f"headwise CP needs groups divisible by cp={cp} or cp divisible by groups",
                      "use chunkwise, or a group count that divides or is a multiple of cp")]


class Mamba2Mixer(torch.nn.Module):
    """A Mamba-2 mixer as MCore's MambaMixer computes it (mamba_split_conv1d_scan_combined):
    in_proj -> z, x, B, C, dt; causal depthwise conv1d (with bias) over x, B, C, SiLU; the SSD scan
    with A = -exp(A_log), dt = softplus(dt + dt_bias) and the skip D (per head); y * silu(z); RMS
    norm over each group's channels (`rmsnorm`, eps 1e-5); out_proj. No bias on the projections.

    `forward(x, cu_seqlens, group, mode, layout)`: x [T_local, hidden] of this rank, in `layout`
    (chunkwise needs contiguous), `cu_seqlens` the batch's global padded offsets. `core` replaces
    the conv and the scan (the tests' float64 references at cp 1). Raises CPConfigError naming
    every bad size at construction and every bad mode, layout, head or group count per call."""

    def __init__(self, shape: Mamba2Shape, dtype=torch.float32, device=None, chunk_size: int = 64,
                 rmsnorm: bool = True):
        super().__init__()
        if problems := shape.violations():
            raise CPConfigError(problems)
        s = self.shape = shape
        self.chunk_size, self.rmsnorm = chunk_size, rmsnorm
        kw = dict(dtype=dtype, device=device)
        conv_dim = s.inner + 2 * s.groups * s.state
        self.in_proj = torch.nn.Linear(s.hidden, 2 * s.inner + 2 * s.groups * s.state + s.heads, bias=False, **kw)
        bound = 1 / math.sqrt(s.conv_width)  # nn.Conv1d's default, as MCore's conv1d
        self.conv_weight = torch.nn.Parameter(torch.empty(conv_dim, s.conv_width, **kw).uniform_(-bound, bound))
        self.conv_bias = torch.nn.Parameter(torch.empty(conv_dim, **kw).uniform_(-bound, bound))
        dt = torch.exp(torch.rand(s.heads, **kw) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = torch.nn.Parameter(torch.empty(s.heads, **kw).uniform_(1, 16).log())
        self.D = torch.nn.Parameter(torch.ones(s.heads, **kw))
        self.norm_weight = torch.nn.Parameter(torch.ones(s.inner, **kw)) if rmsnorm else None
        self.out_proj = torch.nn.Linear(s.inner, s.hidden, bias=False, **kw)

    def _split_xbc(self, xbc: torch.Tensor, heads: int, groups: int):
        s, t = self.shape, xbc.shape[0]
        x, B, C = torch.split(xbc, [heads * s.head_dim, groups * s.state, groups * s.state], -1)
        return x.reshape(t, heads, s.head_dim), B.reshape(t, groups, s.state), C.reshape(t, groups, s.state)

    def _finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # y [T, H, P], z [T, H*P]
        y = y.reshape(z.shape) * F.silu(z)
        if self.rmsnorm:
            per_group = y.reshape(y.shape[0], self.shape.groups, -1)
            y = (per_group * torch.rsqrt(per_group.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(z.shape)
            y = y * self.norm_weight
        return self.out_proj(y)

    def forward(self, x: torch.Tensor, cu_seqlens: Sequence[int], group: Any, mode: str = "chunkwise",
                layout: CpPartitionMode | str = CpPartitionMode.CONTIGUOUS, core=None) -> torch.Tensor:
        s, cp = self.shape, group_size(group)
        layout = CpPartitionMode(layout)
        problems = mode_violations(mode, layout, s.heads, cp)
        if mode == "headwise":
            problems += group_violations(s.groups, cp)
        if problems:
            raise CPConfigError(problems)
        cu = check_partition_lengths(cu_seqlens, cp)
        z, xbc, dt = torch.split(self.in_proj(x), [s.inner, s.inner + 2 * s.groups * s.state, s.heads], -1)
        A = -self.A_log.exp()
        if core is not None:  # the reference path at cp 1
            xbc = torch.cat([core.conv(xbc[lo:hi], self.conv_weight) for lo, hi in zip(cu, cu[1:])]).to(x.dtype)
            xs, B, C = self._split_xbc(F.silu(xbc + self.conv_bias), s.heads, s.groups)
            y = torch.cat([core.scan(xs[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], self.D, self.dt_bias)
                           for lo, hi in zip(cu, cu[1:])])
            return self._finish(y.to(x.dtype), z)
        if mode == "chunkwise" or cp == 1:  # at cp 1 both modes are the plain layer (and None is no group)
            xbc = F.silu(causal_conv1d_cp(xbc, self.conv_weight, cu, group) + self.conv_bias)
            xs, B, C = self._split_xbc(xbc, s.heads, s.groups)
            y = ssd_scan_cp(xs, dt, A, B, C, cu, group, D=self.D, dt_bias=self.dt_bias, chunk_size=self.chunk_size)
            return self._finish(y, z)
        return self._finish(self._headwise(xbc, dt, A, cu, group, layout), z)

    def _conv_rows(self, param: torch.Tensor, heads: slice, first_group: int, groups: int) -> torch.Tensor:
        """The rows of a conv parameter for `heads` of x and `groups` groups of B and C from `first_group`."""
        s = self.shape
        x, B, C = torch.split(param, [s.inner, s.groups * s.state, s.groups * s.state])
        rows = slice(first_group * s.state, (first_group + groups) * s.state)
        return torch.cat([x[heads.start * s.head_dim:heads.stop * s.head_dim], B[rows], C[rows]])

    def _headwise(self, xbc, dt, A, cu, group, layout) -> torch.Tensor:
        """y [T_local, H, P]: the conv and the scan on whole sequences of this rank's H/cp heads."""
        s, cp, rank = self.shape, group_size(group), group_rank(group)
        heads, repeat = s.heads // cp, max(cp // s.groups, 1)  # a group on `repeat` ranks when groups < cp
        groups = max(s.groups // cp, 1)
        order = gathered_order(cu, cp, layout, xbc.device)
        xs, B, C = self._split_xbc(xbc, s.heads, s.groups)
        B, C = (t.repeat_interleave(repeat, 1) for t in (B, C))  # [T_local, G * repeat, N]
        xs, B, C, dt = (heads_in(t, cp, group, order) for t in (xs, B, C, dt.unsqueeze(-1)))
        mine = slice(rank * heads, (rank + 1) * heads)
        first_group = (rank // repeat) * groups
        weight, bias = (self._conv_rows(p, mine, first_group, groups) for p in (self.conv_weight, self.conv_bias))
        mixed = torch.cat([t.reshape(t.shape[0], -1) for t in (xs, B, C)], -1)
        # whole sequences now: the conv and the scan run as at cp 1 (group None), on this rank's heads
        xs, B, C = self._split_xbc(F.silu(causal_conv1d_cp(mixed, weight, cu, None) + bias), heads, groups)
        y = ssd_scan_cp(xs, dt.squeeze(-1), A[mine], B, C, cu, None, D=self.D[mine], dt_bias=self.dt_bias[mine],
                        chunk_size=self.chunk_size)
        return heads_out(y, cp, group, order)
