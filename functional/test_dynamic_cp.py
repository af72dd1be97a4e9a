"""Dynamic CP on 4 ranks gives the loss and gradients of a cp=1 run of the same samples.

One global batch of 9 packed sequences of mixed lengths (8 to 54 tokens; x16 on GPU) is
scheduled over the DPxCP group of 4 ranks with max_seq_len_per_rank=24 (x16): the plan runs the
longest sample on all 4 ranks, others on pairs and on single ranks, so local CP sizes 1, 2 and 4
all occur in one global batch (asserted). The model is built for the static layout dp=4, cp=1;
cpkit.dynamic.runtime.dynamic_cp_step switches the CP group per micro-batch.

Reference: the same weights on one rank, every sequence on its own (sbhd, cp=1; MCore's local
attention in fp32, cpkit's at cp=1 in bf16), loss = sum of all token losses / all tokens,
gradients accumulated over the sequences; each sequence's positions are arange(its length), taken
from nothing in cpkit.sharding. Cases: the scheduled plan with the p2p, all_gather and a2a comm
types, a hand-built plan in which ranks sit idle in some micro-batches (they must still join the
reductions; a hang would end the launch at its timeout), and the scheduled plan on a GPT with
learned absolute position embeddings: MCore computes RoPE positions itself from cu_seqlens and
the CP group, so only that model reads the position_ids the runtime builds
(`src/cpkit/sharding.py::thd_position_ids`) and catches a wrong one.

Tolerances: fp32 (gloo) 1e-5 absolute on the loss, gradients rtol=atol=1e-5; bf16 (NCCL)
5e-3 on the loss, gradients rtol=atol=2e-2 relative to each reference gradient's largest entry
(bf16 keeps 8 mantissa bits; the dynamic run sums the same terms in another order and over
several ranks, so errors of a few 1e-3 of the scale per element are expected).
"""

from __future__ import annotations

import pytest

from cpkit.testing import grid_params, grid_result
from cpkit.testing.scenarios.dynamic_cp import WORLD, cases, dynamic_case


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(cases, scenario=dynamic_case, timeout=240.0, world_sizes=(WORLD,)))
def test_dynamic_cp_matches_cp1(backend, world_size, case_id):
    """Dynamic CP (local CP sizes 1, 2, 4 in one global batch): the cp=1 loss and gradients."""
    grid_result(dynamic_case, cases, backend, world_size, case_id, timeout=240.0).check()
