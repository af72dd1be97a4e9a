"""The zigzag <-> contiguous relayout on 2, 3 and 4 ranks (gloo; NCCL on GPUs): one all-to-all
per transition, exact in both directions and in the gradient.

Each rank shards one global tensor in zigzag (the attention's layout), moves it to contiguous
with `relayout` and back. The contiguous rows must equal a fresh shard of the global tensor by
indices written from the definition (tests/test_hybrid_layout.py::reference_indices, not the
code under test), the round trip must be bitwise the start, and the gradient of a position-
weighted sum through the relayout must land, bitwise, on the rows that carried each position.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import device, launch
from tests.test_hybrid_layout import reference_indices

# (name, per-cp lengths): sbhd is one sequence; THD packs an empty sequence and one of exactly 2*cp
LENGTHS = {"sbhd": lambda cp: [24 * cp], "thd": lambda cp: [6 * cp, 0, 2 * cp, 10 * cp]}


def layout_case_inputs(lens: list[int], seed: int, features: tuple[int, ...]):
    """This rank's inputs of a layout case over every rank of the world: (rank, cp, group, cu,
    x, weight, zig_idx, con_idx, zig). x and weight are the global float64 [total, *features]
    activations and gradient weights (the same on every rank), zig_idx / con_idx this rank's
    global rows in zigzag and contiguous order (from the reference, not the code under test),
    zig its zigzag shard of x, a leaf that takes gradients."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    gen = torch.Generator().manual_seed(seed)
    x, weight = (torch.randn(cu[-1], *features, generator=gen, dtype=torch.float64).to(device()) for _ in range(2))
    zig_idx, con_idx = (torch.tensor(reference_indices(mode, lens, cp, rank), dtype=torch.int64, device=device())
                        for mode in ("zigzag", "contiguous"))
    return rank, cp, group, cu, x, weight, zig_idx, con_idx, x[zig_idx].clone().requires_grad_(True)


def _relayout_case(fmt: str) -> dict:
    from cpkit.hybrid.layout import build_routes, relayout

    lens = LENGTHS[fmt](dist.get_world_size())
    rank, cp, group, cu, x, weight, zig_idx, con_idx, zig = layout_case_inputs(lens, 7, (3, 5))
    total = cu[-1]
    routes = build_routes(cu, rank, cp, device=device())
    con = relayout(zig, routes, "contiguous", group)
    back = relayout(con, routes, "zigzag", group)
    (con * weight[con_idx]).sum().backward()
    # the 1-D token form ([1, t], seq_dim 1) moves the same way
    tokens = relayout(torch.arange(total, device=device())[zig_idx].unsqueeze(0), routes, "contiguous", group, seq_dim=1)
    return {"contiguous": torch.equal(con.detach(), x[con_idx]), "round_trip": torch.equal(back.detach(), zig.detach()),
            "grad": torch.equal(zig.grad, weight[zig_idx]), "tokens": tokens.squeeze(0).tolist() == con_idx.tolist()}


EXACT = {"contiguous": True, "round_trip": True, "grad": True, "tokens": True}


@pytest.mark.parametrize("fmt", sorted(LENGTHS))
@pytest.mark.parametrize("backend,world_size", [pytest.param("gloo", n, marks=pytest.mark.dist, id=f"gloo{n}")
                                                for n in (2, 3, 4)])
def test_relayout_is_exact_both_ways_and_in_the_gradient(backend, world_size, fmt):
    results = launch(_relayout_case, world_size, backend=backend, timeout=300, args=(fmt,))
    for rank, result in enumerate(results):
        assert result == EXACT, (rank, result)


def _every_format() -> dict:
    return {fmt: _relayout_case(fmt) for fmt in sorted(LENGTHS)}


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=getattr(pytest.mark, f"gpu{n}"), id=f"nccl{n}")
                                        for n in (2, 4)])
def test_relayout_is_exact_on_nccl(world_size):
    """Both formats on NCCL in one launch."""
    for rank, result in enumerate(launch(_every_format, world_size, backend="nccl", timeout=300)):
        assert all(r == EXACT for r in result.values()), (rank, result)
