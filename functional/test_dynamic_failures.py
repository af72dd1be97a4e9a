"""Dynamic CP never hangs when one rank cannot prepare its data: every rank raises together."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.dynamic import build_group_registry, schedule
from cpkit.dynamic.runtime import dynamic_cp_step
from cpkit.testing.models import GPTConfig, build_gpt
from cpkit.testing import run_cases
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.testing.reference import single_rank_pg_collection

CFG = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=32)


def failing_sample_case(bad_rank):
    install_mcore_cpu_shim()
    world = dist.get_world_size()
    lens = [8, 12, 6, 10]
    plan = schedule(lens, dp_cp_size=world, max_seq_len_per_rank=16)
    registry = build_group_registry([list(range(world))], dist.get_rank())
    pgc = single_rank_pg_collection()
    pgc.dp_cp = dist.group.WORLD
    model = build_gpt(CFG, pgc, attention="cpkit")

    def get_sample(i):
        if dist.get_rank() == bad_rank:
            raise KeyError(f"sample {i} missing on this rank")
        seq = torch.randint(0, CFG.vocab_size, (lens[i] + 1,), generator=torch.Generator().manual_seed(i))
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(lens[i])}

    try:
        dynamic_cp_step(model, plan, registry, get_sample, pg_collection=pgc)
    except Exception as exc:  # noqa: BLE001 - the outcome is what this case reports
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.dist
def test_a_rank_that_cannot_prepare_its_data_makes_every_rank_raise():
    result = run_cases(failing_sample_case, [1], 2, timeout=180, pg_timeout=60)["1"].check()
    assert result.values[1][0] == "KeyError"  # the failing rank keeps its own error
    assert result.values[0] == ("RuntimeError", "dynamic_cp_step: 1 other rank(s) of the DPxCP group failed "
                                "to prepare their micro-batches (get_sample or packing); see their errors")
    assert result.seconds < 50  # raised at once, not after the 60 s collective timeout
