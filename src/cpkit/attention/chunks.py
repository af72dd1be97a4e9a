"""This rank's two sequence chunks, as the CP attention variants address them.

In the load-balanced layout a rank holds, for every sequence, two chunks: chunk r ("first",
j=0) and chunk 2n-1-r ("second", j=1) of the 2n chunks at its CP level of size n. Tensors are
sequence-first ([s, b, h, d] sbhd or [t, h, d] THD), so chunks live on dim 0 (dim -1 of an LSE).
For sbhd the chunks are the two halves (views); for THD they are interleaved per sequence and
addressed with index tensors built on the device without host syncs.

Also the token permutations used around collectives: `gathered_to_natural` (all-gathered zigzag
shards -> natural order) and `a2a_reorder` (Ulysses all-to-all output -> the next level's
zigzag layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from cpkit.attention.merge import merge_
from cpkit.sharding import segments_to_index

__all__ = ["LocalSeq", "local_seq", "gathered_to_natural", "a2a_reorder"]


@dataclass
class LocalSeq:
    """The local tokens of one CP level of size `size` (dim 0 of sequence-first tensors)."""

    tokens: int
    """Local tokens on dim 0 (s_local or t_local)."""
    size: int
    """CP size of this level (1 = no CP)."""
    global_cu: Optional[torch.Tensor] = None
    """THD: global padded cu_seqlens (int64, device); None for sbhd."""
    max_len: Optional[int] = None
    """THD: upper bound of a local sequence length (global max / size)."""
    index: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    """THD: local token indices of the first and second chunks of every sequence."""

    @property
    def varlen(self) -> bool:
        return self.global_cu is not None

    @property
    def chunk_cu(self) -> Optional[torch.Tensor]:
        """THD: cu_seqlens of one chunk per sequence (global / (2 * size)), int32."""
        return None if self.global_cu is None else (self.global_cu // (2 * self.size)).to(torch.int32)

    @property
    def local_cu(self) -> Optional[torch.Tensor]:
        """THD: cu_seqlens of the local tokens (global / size), int32."""
        return None if self.global_cu is None else (self.global_cu // self.size).to(torch.int32)

    @property
    def chunk_max(self) -> Optional[int]:
        return None if self.max_len is None else self.max_len // 2

    def kw(self, q_part: str, k_part: str, k_chunks: int = 1) -> dict:
        """Kernel varlen kwargs for q and k each being "full" (both chunks) or "half" (one chunk
        per sequence, times `k_chunks` for k); {} for sbhd."""
        if not self.varlen:
            return {}

        def spec(part, mult=1):
            if part == "full":
                return self.local_cu, self.max_len
            return self.chunk_cu * mult, self.chunk_max * mult

        cu_q, max_q = spec(q_part)
        cu_k, max_k = spec(k_part, k_chunks)
        return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)

    def take(self, x: torch.Tensor, j: int, dim: int = 0) -> torch.Tensor:
        """Chunk j (0 first, 1 second) of every sequence of x along `dim` (a view for sbhd)."""
        if not self.varlen:
            half = self.tokens // 2
            return x.narrow(dim, j * half, half)
        return x.index_select(dim, self.index[j])

    def add_(self, acc: torch.Tensor, j: int, value: torch.Tensor, dim: int = 0) -> None:
        """acc[chunk j] += value, in place (acc may be a view)."""
        if not self.varlen:
            half = self.tokens // 2
            acc.narrow(dim, j * half, half).add_(value)
        else:
            acc.index_add_(dim, self.index[j], value.to(acc.dtype))

    def merge_(self, out, lse, j: int, block_out, block_lse) -> None:
        """Merge a partial result of the queries of chunk j into (out, lse), in place."""
        if not self.varlen:
            half = self.tokens // 2
            merge_(out.narrow(0, j * half, half), lse.narrow(-1, j * half, half), block_out, block_lse)
            return
        idx = self.index[j]
        o, l = out.index_select(0, idx), lse.index_select(-1, idx)
        merge_(o, l, block_out, block_lse)
        out.index_copy_(0, idx, o)
        lse.index_copy_(-1, idx, l)


def local_seq(tokens: int, size: int, global_cu: Optional[torch.Tensor] = None,
              max_len_global: Optional[int] = None) -> LocalSeq:
    """Describe `tokens` local tokens at a CP level of `size` ranks.

    THD: `global_cu` are the global padded cu_seqlens (every length a multiple of 2*size when
    size > 1) and `max_len_global` an upper bound of the longest one, divisible by 2*size.
    """
    if global_cu is None:
        return LocalSeq(tokens=tokens, size=size)
    cu = global_cu.to(torch.int64)
    if size == 1:  # nothing is split: the chunks are never addressed (and lengths may be odd)
        return LocalSeq(tokens=tokens, size=1, global_cu=cu, max_len=max_len_global)
    chunk = (cu[1:] - cu[:-1]) // (2 * size)
    local_start = cu[:-1] // size
    index = tuple(
        segments_to_index(local_start + j * chunk, chunk, tokens // 2) for j in (0, 1)
    )
    return LocalSeq(tokens=tokens, size=size, global_cu=cu, max_len=max_len_global // size, index=index)


def gathered_to_natural(seq: LocalSeq, device=None) -> torch.Tensor:
    """For rank-ordered all-gathered shards ([size * tokens] on dim 0), the natural (global)
    position of every row (int64): rank r's rows are its chunk r then its chunk 2n-1-r.
    Without cu_seqlens the result is cached per shape: treat it as read-only."""
    if not seq.varlen:
        return _cached(_gathered_to_natural, seq.tokens, seq.size, _device(device))
    return _gathered_to_natural(seq.tokens, seq.size, None, seq)


@lru_cache(maxsize=64)
def _cached(build, *args) -> torch.Tensor:
    """An sbhd row order depends only on sizes and the device: build it once, not on every
    call, where it cost a host-to-device copy and several small kernels per layer and step."""
    return build(*args)


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _gathered_to_natural(tokens: int, n: int, device, seq: Optional[LocalSeq] = None) -> torch.Tensor:
    if seq is not None:
        device = seq.global_cu.device
        cu = seq.global_cu
        starts, chunk = cu[:-1], (cu[1:] - cu[:-1]) // (2 * n)
    else:
        starts = torch.zeros(1, dtype=torch.int64, device=device)
        chunk = torch.tensor([tokens // 2], dtype=torch.int64, device=device)
    ranks = torch.arange(n, device=device).view(n, 1, 1)
    which = torch.stack([ranks, 2 * n - 1 - ranks], dim=-1).view(n, 1, 2)  # chunk ids per rank
    seg_starts = starts.view(1, -1, 1) + which * chunk.view(1, -1, 1)  # [rank, seq, 2]
    seg_lens = chunk.view(1, -1, 1).expand(n, -1, 2)
    return segments_to_index(seg_starts.reshape(-1), seg_lens.reshape(-1), n * tokens)


def a2a_reorder(tokens: int, a2a_size: int, cp_size: int, global_cu: Optional[torch.Tensor] = None,
                device=None) -> torch.Tensor:
    """Row order turning a Ulysses all-to-all output into the next level's local layout.

    The all-to-all output holds [a2a_size * tokens] rows: the `tokens` local rows of a2a rank
    a = 0..A-1 in turn, each being (per sequence) its chunk then its mirrored chunk. Taking,
    per sequence, the first chunks of a = 0..A-1 then the second chunks of a = A-1..0 gives the
    zigzag layout of the p2p level (size cp_size / A), or the natural order when A == cp_size.
    Returns the int64 indices (gather order) of length a2a_size * tokens; without cu_seqlens
    cached per shape: treat it as read-only.
    """
    if global_cu is None:
        return _cached(_a2a_reorder, tokens, a2a_size, cp_size, None, _device(device))
    return _a2a_reorder(tokens, a2a_size, cp_size, global_cu, device)


def _a2a_reorder(tokens: int, a2a_size: int, cp_size: int, global_cu: Optional[torch.Tensor],
                 device) -> torch.Tensor:
    a = a2a_size
    if global_cu is None:
        local_start = torch.zeros(1, dtype=torch.int64, device=device)
        chunk = torch.tensor([tokens // 2], dtype=torch.int64, device=device)
    else:
        cu = global_cu.to(torch.int64)
        local_start = cu[:-1] // cp_size
        chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)
        device = cu.device
    ranks = torch.arange(a, device=device).view(1, a)
    first = ranks * tokens + local_start.view(-1, 1)  # [seq, a]
    second = ranks.flip(1) * tokens + (local_start + chunk).view(-1, 1)
    seg_starts = torch.cat([first, second], dim=1)  # [seq, 2a]
    seg_lens = chunk.view(-1, 1).expand(-1, 2 * a)
    return segments_to_index(seg_starts.reshape(-1), seg_lens.reshape(-1), a * tokens)
