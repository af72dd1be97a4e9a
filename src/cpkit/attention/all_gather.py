"""`all_gather`: gather the KV of all CP ranks once, then attend locally.

The gathered shards arrive in rank order (zigzag); one index copy puts them in natural
sequence order. With a causal mask each of the two local query chunks (global chunk c) attends
to the KV prefix before chunk c (no mask) and to chunk c itself (causal), merged by LSE; without
a mask all local queries attend to all KV. Backward gathers KV again (nothing of size cp x local
is kept between forward and backward), accumulates dKV for the whole sequence in the input
dtype (as TE does; dQ stays local, in fp32) and reduce-scatters it back to the owners.

Tensors are sequence-first: q [s, b, h, d] / [t, h, d], k/v with h_kv heads.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpkit.attention.band import Band, band_bwd, band_fwd
from cpkit.attention.chunks import LocalSeq, gathered_to_natural
from cpkit.attention.comm import all_gather_seq, group_rank, reduce_scatter_seq
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.attention.merge import merge_
from cpkit.attention.options import CPAttentionOptions
from cpkit.attention.sink import apply_sink, sink_grad
from cpkit.sharding import segments_to_index

__all__ = ["all_gather_attention"]


class _Blocks:
    """Where, in the natural-order KV, the causal blocks of local query chunk j lie."""

    def __init__(self, seq: LocalSeq, rank: int, total: int):
        self.seq, self.rank, self.total = seq, rank, total

    def chunk_id(self, j: int) -> int:
        return self.rank if j == 0 else 2 * self.seq.size - 1 - self.rank

    def _rows(self, first_chunk: int, n_chunks: int):
        """Natural-order rows of chunks [first_chunk, first_chunk + n_chunks) of every sequence."""
        seq = self.seq
        if not seq.varlen:
            chunk = self.total // (2 * seq.size)
            return slice(first_chunk * chunk, (first_chunk + n_chunks) * chunk)
        cu = seq.global_cu
        chunk = (cu[1:] - cu[:-1]) // (2 * seq.size)
        return segments_to_index(cu[:-1] + first_chunk * chunk, chunk * n_chunks,
                                 n_chunks * seq.tokens // 2)

    def take(self, kv: torch.Tensor, rows) -> torch.Tensor:
        return kv[rows] if isinstance(rows, slice) else kv.index_select(0, rows)

    def add_(self, acc: torch.Tensor, rows, value: torch.Tensor) -> None:
        if isinstance(rows, slice):
            acc[rows].add_(value)
        else:
            acc.index_add_(0, rows, value.to(acc.dtype))

    def parts(self, j: int):
        """[(rows, causal, kernel kwargs)] of the KV blocks query chunk j attends to."""
        c = self.chunk_id(j)
        parts = [(self._rows(c, 1), True, self.seq.kw("half", "half"))]
        if c > 0:
            parts.append((self._rows(0, c), False, self.seq.kw("half", "half", k_chunks=c)))
        return parts

    def full_kw(self) -> dict:
        seq = self.seq
        if not seq.varlen:
            return {}
        return dict(cu_seqlens_q=seq.local_cu, cu_seqlens_k=seq.global_cu.to(torch.int32),
                    max_seqlen_q=seq.max_len, max_seqlen_k=seq.max_len * seq.size)


def _gather_kv(k, v, group, natural_rows):
    """All-gather [t, 2, ..., h_kv, d] KV and put it in natural order; returns (kv, K, V)."""
    gathered = all_gather_seq(torch.stack([k, v], dim=1), group)
    kv = torch.empty_like(gathered)
    kv.index_copy_(0, natural_rows, gathered)
    return kv, kv[:, 0], kv[:, 1]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, group, causal, scale, seq, kernel, window):
        natural_rows = gathered_to_natural(seq, device=q.device)
        _, K, V = _gather_kv(k, v, group, natural_rows)
        blocks = _Blocks(seq, group_rank(group), K.shape[0])
        out = torch.empty_like(q, dtype=torch.float32)
        band = None if window is None else Band(window, causal, seq, group_rank(group), q.device, ring=False)
        if band is not None:  # sliding window: the local queries against all keys, band-masked
            o, lse = band_fwd(q, K, V, band.natural_mask(K.shape[0]), scale, kernel)
            out.copy_(o)
        elif not causal:
            o, lse = attn_fwd(q, K, V, False, scale, kernel=kernel, **blocks.full_kw())
            out.copy_(o)
            lse = lse.float().contiguous()
        else:
            # [b, h, s] or [h, t]
            lse = torch.empty((*q.shape[1:-1], q.shape[0]), dtype=torch.float32, device=q.device)
            for j in (0, 1):
                qj = seq.take(q, j)
                o_j = l_j = None
                for rows, block_causal, kw in blocks.parts(j):
                    o, l = attn_fwd(qj, blocks.take(K, rows), blocks.take(V, rows), block_causal, scale,
                                    kernel=kernel, **kw)
                    if o_j is None:
                        o_j, l_j = o.float(), l.float().contiguous()
                    else:
                        merge_(o_j, l_j, o, l)
                _put(seq, out, lse, j, o_j, l_j)
        if sink is not None:  # once, after the last merge
            out, lse = apply_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, natural_rows, sink)
        ctx.setup = (group, causal, scale, seq, kernel, band)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, natural_rows, sink = ctx.saved_tensors
        group, causal, scale, seq, kernel, band = ctx.setup
        # cuDNN wants dout and out in one layout; both sequence-first contiguous here.
        dout, out = dout.contiguous(), out.contiguous()
        kv, K, V = _gather_kv(k, v, group, natural_rows)
        blocks = _Blocks(seq, group_rank(group), K.shape[0])
        # dKV of the whole sequence in the input dtype, as TE does: the reduce-scatter below is
        # exposed (nothing left to overlap it with), and fp32 would double its bytes.
        dkv = torch.zeros_like(kv)
        dK, dV = dkv[:, 0], dkv[:, 1]
        if band is not None:
            mask = band.natural_mask(K.shape[0])
            dq, dk_b, dv_b = band_bwd(dout, q, K, V, out, lse, mask, scale, kernel)
            dK.add_(dk_b)
            dV.add_(dv_b)
            dq = dq.float()
        elif not causal:
            dq, dk_b, dv_b = attn_bwd(dout, q, K, V, out, lse, False, scale, kernel=kernel, **blocks.full_kw())
            dK.add_(dk_b)
            dV.add_(dv_b)
            dq = dq.float()
        else:
            dq = torch.zeros_like(q, dtype=torch.float32)
            for j in (0, 1):
                args = [seq.take(dout, j), seq.take(q, j)]
                oj, lj = seq.take(out, j), seq.take(lse, j, dim=-1)
                for rows, block_causal, kw in blocks.parts(j):
                    dq_b, dk_b, dv_b = attn_bwd(*args, blocks.take(K, rows), blocks.take(V, rows), oj, lj,
                                                block_causal, scale, kernel=kernel, **kw)
                    seq.add_(dq, j, dq_b)
                    blocks.add_(dK, rows, dk_b)
                    blocks.add_(dV, rows, dv_b)
        # Back to the gathered (rank) order, then each rank keeps the sum of its own rows.
        dkv_local = reduce_scatter_seq(dkv.index_select(0, natural_rows), group)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_grad(dout, out, lse, sink).to(sink.dtype)
        return dq.to(q.dtype), dkv_local[:, 0], dkv_local[:, 1], dsink, None, None, None, None, None, None


def _put(seq: LocalSeq, out, lse, j, o_j, l_j) -> None:
    """Write query chunk j's output and LSE into the full local tensors."""
    if not seq.varlen:
        half = seq.tokens // 2
        out.narrow(0, j * half, half).copy_(o_j)
        lse.narrow(-1, j * half, half).copy_(l_j)
    else:
        out.index_copy_(0, seq.index[j], o_j)
        lse.index_copy_(-1, seq.index[j], l_j)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                         causal: bool, scale: float, seq: LocalSeq,
                         options: CPAttentionOptions, window=None,
                         sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-gather CP attention of this rank's shard; differentiable.

    q [s, b, h, d] or [t, h, d] (THD: `seq` carries the global cu_seqlens), k/v with h_kv heads,
    in the 2-chunk layout of `group`. Collectives: one all-gather of KV in forward, one
    all-gather and one reduce-scatter (dKV, input dtype) in backward. `options.kernel` picks the
    kernel. `window` (`band.Window`): sliding window, the local queries against all gathered
    keys under the band mask; `sink` [h]: sink logits, applied once at the end. Returns the
    output like q.
    """
    return _AllGatherAttention.apply(q, k, v, sink, group, causal, scale, seq, options.kernel, window)
