"""Eval-time CP on 2 and 4 ranks: a GPT trained at one CP size evaluates at another.

Each case builds the training collection and the eval collection (cpkit.eval_cp.context.
build_eval_pg_collection, reusing the training tp/pp groups), a model and a control model from
the same seed, then per iteration:
- trains one step on both; the model's loss must equal the control's (which never switches);
- evaluates a fixed validation set at the training layout and, inside eval_cp_context, at the
  eval layout: the losses agree within the dtype's tolerance, and (first iteration) equal a
  single-rank evaluation of the same weights where tp = pp = 1;
- checks eval data ownership: every sample of the validation set is evaluated by exactly one
  eval dp replica (and by all CP/TP ranks of it), and the token count is that of the set;
- checks the restore: a forward at the training layout after the block is bitwise the one before.
After the iterations one more training step and every parameter must equal the control's.

In fp32 the attention and output projections are scaled up (`_sharpen`) so that a wrong RoPE
position or chunk order moves the loss ~2000x beyond the tolerance instead of ~10x.

Tolerances: fp32 (gloo) 1e-5 absolute on the loss, and bitwise equality for the training
losses and parameters of the switched and the never-switched run; bf16 (NCCL) 5e-3 on the loss,
and 5e-3 for training losses (GPU attention backward kernels need not be deterministic; the
restore itself is still checked bitwise by the forward probe). gpu4 adds TP2 CP 1->2 and TP1
PP2 CP 1->2, the latter through MCore's forward-only pipeline schedule (GPU only: MCore's p2p
buffers are CUDA tensors).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import device, dist_params, grid_params, grid_result, launch
from cpkit.testing.scenarios.eval_cp import cases, eval_cp_scenario


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(cases, scenario=eval_cp_scenario, timeout=600.0))
def test_eval_cp_matches_training_layout_and_restores(backend, world_size, case_id):
    """One eval-CP case: equal eval loss at both layouts, each sample once, exact restore."""
    grid_result(eval_cp_scenario, cases, backend, world_size, case_id).check()


def _reduced_eval_loss():
    """Rank r holds a loss sum of r + 1 over 2 (r + 1) tokens; the reduction sums both over the
    eval dp x cp group and gives every rank the global mean."""
    from cpkit.compat import new_pg_collection
    from cpkit.eval_cp.loop import reduce_eval_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    pgc = new_pg_collection(dp_cp=dist.new_group(list(range(world))))
    return reduce_eval_loss(torch.tensor(float(rank + 1), device=device()),
                            torch.tensor(2.0 * (rank + 1), device=device()), pgc)


@pytest.mark.parametrize("backend,world_size", dist_params((2,)))
def test_reduce_eval_loss_sums_over_the_dp_cp_group(backend, world_size):
    total = sum(range(1, world_size + 1))
    expected = (total / (2.0 * total), 2.0 * total)
    assert launch(_reduced_eval_loss, world_size, backend=backend, timeout=300) == [expected] * world_size
