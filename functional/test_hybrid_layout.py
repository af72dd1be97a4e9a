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


def _relayout_case(fmt: str) -> dict:
    from cpkit.hybrid.layout import build_routes, relayout

    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    lens = LENGTHS[fmt](cp)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    total = cu[-1]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(total, 3, 5, generator=gen, dtype=torch.float64).to(device())
    weight = torch.randn(total, 3, 5, generator=gen, dtype=torch.float64).to(device())
    zig_idx = torch.tensor(reference_indices("zigzag", lens, cp, rank), dtype=torch.int64, device=device())
    con_idx = torch.tensor(reference_indices("contiguous", lens, cp, rank), dtype=torch.int64, device=device())
    routes = build_routes(cu, rank, cp, device=device())
    zig = x[zig_idx].clone().requires_grad_(True)
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
