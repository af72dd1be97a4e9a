"""Communication shared by the CP attention variants: the KV ring, all-gather, reduce-scatter
and all-to-all over an explicitly passed process group (gloo or NCCL).

All helpers take the group as an argument; nothing here keeps a group at module level.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpkit.parallel.group_info import group_size  # noqa: F401 - part of this module's API

__all__ = [
    "RingComm",
    "group_size",
    "group_rank",
    "all_gather_seq",
    "reduce_scatter_seq",
    "all_to_all_async",
]

# torch >= 2.12 renamed the "into tensor" collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in `group`; 0 for None (no CP)."""
    return 0 if group is None else dist.get_rank(group)


class RingComm:
    """Send to the next rank of `group` and receive from the previous one, asynchronously.

    `exchange(send, recv)` posts an isend/irecv pair and returns a handle whose `wait()`
    completes both; the caller computes in between, so the transfer overlaps compute (NCCL runs
    P2P on its own stream; gloo in background threads).
    `batched` posts them as one batch_isend_irecv call or as separate calls (default None:
    batched for a ring of 2, separate for more; `CPAttentionOptions.ring_batched`). Every rank of the ring must post the same sequence of exchanges. Peers are
    passed as global ranks, which both torch 2.11 and 2.13 accept for subgroups.
    """

    def __init__(self, group: dist.ProcessGroup, batched: Optional[bool] = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.batched = self.size <= 2 if batched is None else batched
        self.rank = dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False) -> "_Pending":
        """Start sending `send` to the next rank and receiving `recv` from the previous one, or
        the other way round with `reverse`. Both must be contiguous (the ring packs each step
        into one buffer, so there is one send and one receive) and of one shape and dtype: every
        rank posts the same exchange, so the peer's message is the size of this rank's (NCCL needs
        the sizes to match; gloo takes a shorter message into a longer buffer without a word)."""
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("RingComm.exchange: send and receive buffers must be contiguous")
        if send.shape != recv.shape or send.dtype != recv.dtype:
            raise ValueError(f"RingComm.exchange: send {tuple(send.shape)} {send.dtype} and receive "
                             f"{tuple(recv.shape)} {recv.dtype} must match (every rank of the ring "
                             "sends what it receives)")
        to, source = (self.prev_peer, self.next_peer) if reverse else (self.next_peer, self.prev_peer)
        # Even ranks send first, odd ranks receive first (as TE does): unbatched, NCCL sets up a
        # peer pair's communicator on its first use, and this order lets every pair meet.
        ops = [(dist.isend, send, to), (dist.irecv, recv, source)]
        if self.rank % 2:
            ops.reverse()
        if self.batched:
            works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, self.group) for op, t, peer in ops])
        else:
            works = [op(t, peer, self.group) for op, t, peer in ops]
        return _Pending(works, [send])


class _Pending:
    """Handles of one posted exchange; `wait()` once before reading the received tensor (it
    returns `result`, the receive buffer, where the poster gives one)."""

    def __init__(self, works, sends, result: Optional[torch.Tensor] = None):
        self._works = works
        self._sends = sends  # keeps the sent tensors alive until the transfer is done
        self._result = result

    def wait(self) -> Optional[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sends = [], []
        return self._result


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0 (rank order): [size * x.shape[0], ...]."""
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `x` over the ranks and return this rank's 1/size slice of dim 0."""
    x = x.contiguous()
    size = group_size(group)
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out


def all_to_all_async(x: torch.Tensor, group: dist.ProcessGroup) -> _Pending:
    """Start an all-to-all over dim 0 (x is [size, ...] with x[j] for rank j); the handle's
    `wait()` returns [size, ...] with entry j received from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x, group=group, async_op=True)
    return _Pending([work], [x], out)
