"""Tensor views and GQA helpers shared by the attention kernel adapters.

Sequence-first [s, b, h, d] (MCore's layout) to the layouts torch's kernels take, as views (no
copy), and the expansion of KV heads for kernels without native GQA (a copy), with its inverse
for the gradients.
"""

from __future__ import annotations

import torch

__all__ = ["bhsd", "bshd", "expand_kv", "from_bhsd", "reduce_kv"]


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat kv heads (dim -2) so that query head i sees kv head i // group."""
    group = heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the grads of expanded kv heads back onto the kv heads (dim -2)."""
    group = dx.shape[-2] // kv_heads
    return dx if group == 1 else dx.unflatten(-2, (kv_heads, group)).sum(-2)


def bshd(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, s, h, d], a view (its own inverse)."""
    return x.transpose(0, 1)


def bhsd(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d], a view."""
    return x.permute(1, 2, 0, 3)


def from_bhsd(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d], a view (the inverse of bhsd)."""
    return x.permute(2, 0, 1, 3)
