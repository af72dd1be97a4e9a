"""A pipeline communicator whose shape exchange works at pp = 2 with virtual-pipeline chunks.

Dynamic-CP micro-batches hold different token counts, so MCore's schedule sends each
activation's shape before the activation (`config.variable_seq_lengths`). MCore's
`P2PCommunicator._communicate_shapes` (0.16 and 0.19) posts one batch [send to prev, recv from
prev, send to next, recv from next] on the pp group. At pp = 2 prev and next are the same rank,
and messages between one pair of ranks on one group match in the order they are posted: when the
interleaved schedule sends an activation forward and a gradient backward in one call, the peer
receives the gradient's shape as the activation's and the reverse (seen as a THD length mismatch
in RoPE, `split_with_sizes expects split_sizes to sum exactly to ...`).

`PairSafeP2PCommunicator` sends the forward-direction shapes (to next, from prev) on the pp group
and the backward-direction ones (to prev, from next) on the default group, as MCore's own
`_p2p_ops` separates the two directions of its tensors at pp = 2; at other sizes it is MCore's.
`pipeline_communicator` also turns `batch_p2p_comm` off at pp = 2 with VPP (on a copy of the
config), so the tensors go through `_p2p_ops` and not through the same crossing batch.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from cpkit.parallel.group_info import group_device

__all__ = ["PairSafeP2PCommunicator", "pipeline_communicator"]


def _shape_buffer(device) -> torch.Tensor:
    return torch.empty((3,), dtype=torch.int64, device=device)


class PairSafeP2PCommunicator(P2PCommunicator):
    """MCore's P2PCommunicator with the two directions of the shape exchange kept apart at
    pp = 2 (see the module docstring)."""

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.pp_group.size() != 2 or getattr(self.config, "use_ring_exchange_p2p", False):
            return super()._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        device = group_device(self.pp_group)
        recv_prev_shape = _shape_buffer(device) if recv_prev else None
        recv_next_shape = _shape_buffer(device) if recv_next else None
        forward, backward = [], []
        if tensor_send_next is not None:
            shape = torch.tensor(tensor_send_next.size(), dtype=torch.int64, device=device)
            forward.append(dist.P2POp(dist.isend, shape, self.next_rank, self.pp_group))
        if recv_prev_shape is not None:
            forward.append(dist.P2POp(dist.irecv, recv_prev_shape, self.prev_rank, self.pp_group))
        world = dist.group.WORLD
        if tensor_send_prev is not None:
            shape = torch.tensor(tensor_send_prev.size(), dtype=torch.int64, device=device)
            backward.append(dist.P2POp(dist.isend, shape, self.prev_rank, world))
        if recv_next_shape is not None:
            backward.append(dist.P2POp(dist.irecv, recv_next_shape, self.next_rank, world))
        reqs = [req for ops in (forward, backward) if ops for req in dist.batch_isend_irecv(ops)]
        for req in reqs:
            req.wait()
        return _as_shape(recv_prev_shape), _as_shape(recv_next_shape)


def _as_shape(buffer: Optional[torch.Tensor]) -> list[int]:
    return [0, 0, 0] if buffer is None else buffer.tolist()  # MCore's value for "nothing received"


def pipeline_communicator(pp_group: Any, config: Any, *, interleaved: bool) -> Any:
    """The communicator for MCore's schedule under dynamic CP: a PairSafeP2PCommunicator on
    `pp_group`; at pp = 2 with virtual-pipeline chunks (`interleaved`) its config is a copy of
    `config` with batch_p2p_comm off (the model's config is left as it is)."""
    if interleaved and pp_group.size() == 2 and getattr(config, "batch_p2p_comm", False):
        config = copy.copy(config)
        config.batch_p2p_comm = False
    return PairSafeP2PCommunicator(pp_group=pp_group, config=config)
