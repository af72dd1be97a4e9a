"""A small hybrid language model under CP: attention layers in zigzag, recurrent layers (gated
delta net, Mamba-2) in contiguous, one relayout on each side of every run of recurrent layers.

`HybridLM(pattern="AGA")` stacks pre-norm residual blocks: "A" is causal self-attention through
cpkit's `context_parallel_attention` (THD, the batch's global padded offsets), "G" a
`GatedDeltaNet`, "M" a `Mamba2Mixer` (each chunkwise or headwise). Tokens arrive in zigzag (the
attention's layout, cpkit.sharding.thd_partition); the routes are built once per batch (`HybridBatch`) and every
transition reuses them. Weights are a function of the seed, so every CP size starts identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from cpkit.attention.functional import context_parallel_attention
from cpkit.errors import CPConfigError
from cpkit.hybrid.gdn import GatedDeltaNet, GDNShape
from cpkit.hybrid.layout import CpPartitionMode, HybridRoutes, build_routes, relayout
from cpkit.hybrid.mamba import Mamba2Mixer, Mamba2Shape
from cpkit.parallel.group_info import group_rank, group_size

__all__ = ["HybridBatch", "HybridLM"]


@dataclass(frozen=True)
class HybridBatch:
    """One batch as every layer reads it: the global padded offsets, the routes between the two
    layouts (built once) and the CP group."""

    cu_seqlens: tuple[int, ...]
    routes: HybridRoutes
    group: Any

    @classmethod
    def build(cls, cu_seqlens: Sequence[int], group: Any, device: Any = "cpu") -> "HybridBatch":
        cp = group_size(group)
        return cls(tuple(int(c) for c in cu_seqlens), build_routes(cu_seqlens, group_rank(group), cp, device), group)


class _Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, dtype, device):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype, device=device)
        self.out = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x, batch: HybridBatch, comm: str):
        t, hidden = x.shape
        q, k, v = self.qkv(x).reshape(t, 3, self.heads, hidden // self.heads).unbind(1)
        cu = torch.tensor(batch.cu_seqlens, dtype=torch.int32, device=x.device)
        group = batch.group if group_size(batch.group) > 1 else None
        o = context_parallel_attention(q, k, v, cp_group=group, cp_comm_type=comm, causal=True, cu_seqlens=cu)
        return self.out(o.reshape(t, hidden))


#: The recurrent layers a pattern names, each built from (hidden, heads, dtype, device).
_RECURRENT = {
    "G": lambda hidden, heads, dtype, device: GatedDeltaNet(GDNShape(hidden, heads, hidden // heads, hidden // heads),
                                                            dtype=dtype, device=device),
    "M": lambda hidden, heads, dtype, device: Mamba2Mixer(Mamba2Shape(hidden, heads, hidden // heads, hidden // heads),
                                                          dtype=dtype, device=device),
}


class HybridLM(torch.nn.Module):
    """Embedding, the `pattern`'s blocks ("A" attention, "G" gated delta net, "M" Mamba-2), RMS norm,
    head. `linear_cp_mode` ("chunkwise" or "headwise") is every recurrent layer's mode."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, pattern: str = "AGA", seed: int = 0,
                 dtype=torch.float32, device=None, linear_cp_mode: str = "chunkwise", comm: str = "p2p"):
        super().__init__()
        if set(pattern) - set(_RECURRENT) - {"A"} or not pattern:
            raise CPConfigError.single("pattern", pattern, "must be a non-empty string of 'A' (attention), "
                                       "'G' (gated delta net) and 'M' (Mamba-2)", "use e.g. 'AGA'")
        torch.manual_seed(seed)
        self.pattern, self.linear_cp_mode, self.comm = pattern, linear_cp_mode, comm
        self.embed = torch.nn.Embedding(vocab, hidden, dtype=dtype, device=device)
        self.layers = torch.nn.ModuleList(
            _Attention(hidden, heads, dtype, device) if kind == "A" else _RECURRENT[kind](hidden, heads, dtype, device)
            for kind in pattern)
        self.norms = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
                                            for _ in pattern)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor, batch: HybridBatch) -> torch.Tensor:
        """Logits [T_local, vocab] of this rank's zigzag tokens [T_local]."""
        x = self.embed(tokens)
        layout = CpPartitionMode.ZIGZAG
        contiguous = self.linear_cp_mode == "chunkwise"  # headwise reads zigzag as it is
        for kind, layer, norm in zip(self.pattern, self.layers, self.norms):
            want = CpPartitionMode.CONTIGUOUS if kind in _RECURRENT and contiguous else CpPartitionMode.ZIGZAG
            if want is not layout:
                x, layout = relayout(x, batch.routes, want, batch.group), want
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
            h = layer(h, batch, self.comm) if kind == "A" else layer(h, batch.cu_seqlens, batch.group,
                                                                     mode=self.linear_cp_mode, layout=layout)
            x = x + h
        if layout is not CpPartitionMode.ZIGZAG:
            x = relayout(x, batch.routes, CpPartitionMode.ZIGZAG, batch.group)
        return self.head(x)

    def loss_sum(self, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, batch: HybridBatch) -> torch.Tensor:
        """The sum of this rank's masked token losses (divide by the global token count)."""
        logits = self.forward(tokens, batch)
        return (F.cross_entropy(logits.float(), labels, reduction="none") * mask).sum()
