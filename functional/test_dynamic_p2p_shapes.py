"""MCore's pipeline communicator crosses the two shapes it exchanges with one peer; cpkit's
pair-safe one does not.

At pp = 2 with virtual-pipeline chunks the interleaved schedule calls
`send_forward_backward_recv_forward_backward`, which sends an activation to the next stage and
a gradient to the previous one; at pp = 2 both are the same rank. With
`variable_seq_lengths=True` the shapes go first, through
`megatron/core/pipeline_parallel/p2p_communication.py::P2PCommunicator._communicate_shapes`,
which posts [send prev, recv prev, send next, recv next] in one batch; messages between one pair
of ranks on one group match in posting order, so each rank receives its peer's gradient shape as
the activation's and the reverse. That is a strict xfail here, the smallest case: one call, two
ranks, an activation of shape (2, 1, 1) and a gradient of shape (1, 2, 1). When upstream fixes
it, the xfail fails the run: remove the mark and keep the test.

The two shapes hold the same number of elements, so the tensors themselves still arrive whole
and only their shapes show the crossing; `batch_p2p_comm` is off (as
`src/cpkit/dynamic/p2p.py::pipeline_communicator` sets it at pp = 2 with VPP), so the tensors go
through MCore's `_p2p_ops`, which keeps the two directions apart: only the shape exchange is
under test. The same call through `pipeline_communicator` (a `PairSafeP2PCommunicator`) must
deliver every shape and value as sent. Both cases run in one launch of 2 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.dynamic.p2p import PairSafeP2PCommunicator, pipeline_communicator
from cpkit.testing import device, dist_params, grid_result
from cpkit.mcore_cpu import install_mcore_cpu_shim

UPSTREAM = "megatron/core/pipeline_parallel/p2p_communication.py::P2PCommunicator._communicate_shapes"
ACTIVATION = (2, 1, 1)  # sent to the next stage
GRADIENT = (1, 2, 1)  # sent to the previous stage: the same element count, another shape


class ShapesCrossed(AssertionError):
    """A rank received its peer's activation with the gradient's shape and the reverse."""


def _fill(rank: int, direction: str) -> float:
    return float(100 * rank + (1 if direction == "activation" else 2))


def _cases(backend: str, world_size: int) -> list[dict]:
    return [{"id": "mcore"}, {"id": "pair-safe"}]


def exchange_case(case) -> dict:
    """One send_forward_backward_recv_forward_backward between the 2 stages of a pp group: what
    this rank received from its previous and its next stage, as (shape, distinct values)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    install_mcore_cpu_shim()
    dev = device()
    pp_group = dist.new_group([0, 1])
    config = ModelParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                 variable_seq_lengths=True, pipeline_dtype=torch.float32)
    if case["id"] == "mcore":
        config.batch_p2p_comm = False
        communicator = P2PCommunicator(pp_group=pp_group, config=config)
    else:
        communicator = pipeline_communicator(pp_group, config, interleaved=True)
        assert isinstance(communicator, PairSafeP2PCommunicator)
        assert not communicator.config.batch_p2p_comm
    rank = dist.get_rank()
    activation = torch.full(ACTIVATION, _fill(rank, "activation"), device=dev)
    gradient = torch.full(GRADIENT, _fill(rank, "gradient"), device=dev)
    from_prev, from_next = communicator.send_forward_backward_recv_forward_backward(
        activation, gradient, recv_prev=True, recv_next=True, tensor_shape=ACTIVATION)
    return {name: (tuple(t.shape), sorted(set(t.detach().flatten().tolist())))
            for name, t in (("from_prev", from_prev), ("from_next", from_next))}


def _check_received(result) -> None:
    """Every rank received its peer's activation from prev and its gradient from next, shapes
    and values as sent; ShapesCrossed when exactly the two shapes are swapped."""
    result.check()
    assert sorted(result.values) == [0, 1], f"every rank must report: {result.values}"
    for rank, got in result.values.items():
        peer = 1 - rank
        want = {"from_prev": (ACTIVATION, [_fill(peer, "activation")]),
                "from_next": (GRADIENT, [_fill(peer, "gradient")])}
        crossed = {"from_prev": (GRADIENT, want["from_prev"][1]), "from_next": (ACTIVATION, want["from_next"][1])}
        if got == crossed:
            raise ShapesCrossed(f"rank {rank} received shapes {got}, its peer sent {want}")
        assert got == want, f"rank {rank} received {got}, its peer sent {want}"


@pytest.mark.xfail(strict=True, raises=ShapesCrossed, reason=(
    f"{UPSTREAM} posts [send prev, recv prev, send next, recv next] in one batch, so at pp = 2 "
    "the activation's and the gradient's shapes arrive swapped (megatron-core 0.16.1 and 0.19.2). "
    "If this passes, upstream fixed it: remove this xfail."))
@pytest.mark.parametrize("backend,world_size", dist_params(world_sizes=(2,)))
def test_mcore_p2p_communicator_delivers_the_shapes_sent(backend, world_size):
    """MCore's P2PCommunicator at pp = 2: the activation's and the gradient's shapes as sent."""
    _check_received(grid_result(exchange_case, _cases, backend, world_size, "mcore", timeout=120.0))


@pytest.mark.parametrize("backend,world_size", dist_params(world_sizes=(2,)))
def test_pair_safe_communicator_delivers_the_shapes_sent(backend, world_size):
    """cpkit's PairSafeP2PCommunicator at pp = 2: every shape and value as sent."""
    _check_received(grid_result(exchange_case, _cases, backend, world_size, "pair-safe", timeout=120.0))
