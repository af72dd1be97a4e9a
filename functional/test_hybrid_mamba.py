"""A Mamba-2 mixer under CP equals CP 1, in both of Megatron-LM's modes, on 2, 3 and 4 ranks
(gloo; NCCL on GPUs), sbhd and THD.

The reference runs the same layer's parameters at CP 1 with a token-by-token float64 SSD
recurrence and a tap-by-tap causal conv (src/cpkit/testing/recurrent_reference.py), which share
no code with the chunked CP path. Compared: the output rows of each rank and the gradients of
its input rows and of every parameter (in_proj's z, x, B, C and dt rows, the conv weight and
bias, dt_bias, A_log, D, the norm and out_proj), summed over the ranks. chunkwise reads the
contiguous layout; headwise reads either layout. The layer has 4 heads in 2 groups of B and C:
headwise at cp 2 gives each rank one group, at cp 4 each group goes to 2 ranks (MCore's
repetition), and at cp 3 headwise is refused (heads and groups do not divide), so only
chunkwise runs there.

Every case of a world size runs in one launch (start-up is most of a case's time on CPU).
Tolerance: float64 throughout, atol = rtol = 1e-9 (the chunked form and the token loop differ
only by rounding, about 1e-14 here).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import device, launch
from functional.test_hybrid_gdn import LENGTHS, layer_problems

MODES = [("chunkwise", "contiguous"), ("headwise", "contiguous"), ("headwise", "zigzag")]
HEADS, GROUPS = 4, 2


def _layer(seed: int = 3):
    from cpkit.hybrid.mamba import Mamba2Mixer, Mamba2Shape

    torch.manual_seed(seed)
    layer = Mamba2Mixer(Mamba2Shape(hidden=16, heads=HEADS, head_dim=3, state=5, groups=GROUPS),
                        dtype=torch.float64, device=device(), chunk_size=4)
    with torch.no_grad():  # off MCore's init, so that every term is felt: steps near 1, slow decay, D and norm not 1
        layer.dt_bias.normal_(0.0, 0.5)
        layer.A_log.uniform_(-1.0, 0.5)
        layer.D.normal_()
        layer.norm_weight.normal_(1.0, 0.3)
    return layer


def _reference_core():
    from cpkit.testing.recurrent_reference import causal_conv1d_reference, ssd_reference

    return types.SimpleNamespace(
        conv=causal_conv1d_reference,
        scan=lambda x, dt, A, B, C, D, dt_bias: ssd_reference(x, dt, A, B, C, D=D, dt_bias=dt_bias,
                                                              dt_softplus=True)[0])


def cases_at(cp: int) -> list[tuple[str, str, str]]:
    """(fmt, mode, layout) of every case a world size runs: headwise where heads and groups divide."""
    fits = HEADS % cp == 0 and (GROUPS % cp == 0 or cp % GROUPS == 0)
    return [(fmt, mode, layout) for fmt in sorted(LENGTHS) for mode, layout in MODES if mode == "chunkwise" or fits]


def _mamba_case(fmt: str, mode: str, layout: str, group) -> list[str]:
    return layer_problems(_layer, _reference_core, fmt, mode, layout, group)


def _every_mamba_case() -> dict:
    group = dist.new_group(list(range(dist.get_world_size())))
    return {"-".join(case): _mamba_case(*case, group) for case in cases_at(dist.get_world_size())}


# The largest ring first: a fault in the state fold shows from 3 ranks on, and -x stops at the first.
GLOO = [pytest.param("gloo", n, marks=pytest.mark.dist, id=f"gloo{n}") for n in (4, 3, 2)]
NCCL = [pytest.param(n, marks=getattr(pytest.mark, f"gpu{n}"), id=f"nccl{n}") for n in (2, 4)]


def _check(results: list, world_size: int) -> None:
    expected = {"-".join(case) for case in cases_at(world_size)}
    for rank, result in enumerate(results):
        assert set(result) == expected and all(v == [] for v in result.values()), (rank, result)


@pytest.mark.parametrize("backend,world_size", GLOO)
def test_mamba_mixer_under_cp_equals_cp1_outputs_and_every_gradient(backend, world_size):
    """Every case of the world size (sbhd and THD; chunkwise, headwise on both layouts where it fits)."""
    _check(launch(_every_mamba_case, world_size, backend=backend, timeout=300), world_size)


@pytest.mark.parametrize("world_size", NCCL)
def test_mamba_mixer_under_cp_equals_cp1_on_nccl(world_size):
    """The same cases on NCCL, in one launch (one NCCL start-up for all six)."""
    _check(launch(_every_mamba_case, world_size, backend="nccl", timeout=300), world_size)
