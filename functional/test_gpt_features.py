"""Small MCore GPTs with the attention features of long-context models, under CP, give the cp=1
loss and gradients:

- MLA: MCore's MultiLatentAttention layer (local spec, `multi_latent_attention=True`) with
  cpkit's core attention; q/k head dim 24 (16 + 8 RoPE dims), v head dim 16;
- sliding window + learnable softmax (gpt-oss's attention): window_size (8, 0) on every other
  layer (window_attn_skip_freq=2) and a learnable sink logit per head.

Each case trains one step of the model at cp = world size with every comm type against the same
model at cp=1 (every group of size 1, cpkit attention; cp=1 itself is checked against MCore's
DotProductAttention and a plain reference in tests/test_attention_module.py and
functional/test_attention_features.py). Loss before and after the SGD step within 1e-5 (fp32),
every gradient (the sink logits' included) rtol = atol = 1e-5; bf16 on NCCL as in
functional/test_gpt.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.sharding import shard_batch
from cpkit.testing import device, grid_params, grid_result
from cpkit.testing.compare import assert_grads_close
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.testing.models import FEATURE_MODELS, GPTConfig, build_gpt, eval_step, make_batch, named_gradients, train_step
from cpkit.testing.reference import single_rank_pg_collection

TOL = {
    torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(loss=5e-3, rtol=2e-2, atol=2e-2),
}
HEADS, KV_HEADS = 8, 4

MODELS = FEATURE_MODELS


def _cases(backend: str, world_size: int) -> list[dict]:
    hcp = [2, world_size // 2]
    comms = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", hcp)]
    return [dict(id=f"{model}-cp{world_size}-{comm}", model=model, comm=comm, hcp=h)
            for model in MODELS for comm, h in comms]


def gpt_feature_case(case):
    install_mcore_cpu_shim()
    dev = device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    world = dist.get_world_size()
    seq = 32 if dev.type == "cpu" else 4096
    mla = case["model"] == "mla"
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS,
                    num_query_groups=None if mla else KV_HEADS, seq_length=seq, dtype=dtype,
                    extra=MODELS[case["model"]])
    layout = CPLayout(world_size=world, tp=1, cp=world, cp_comm_type=case["comm"],
                      hierarchical_context_parallel_sizes=case["hcp"], seq_length=seq,
                      num_attention_heads=HEADS, num_query_groups=HEADS if mla else KV_HEADS)
    pgc = build_pg_collection(layout)
    ref_pgc = single_rank_pg_collection()
    batch = make_batch(cfg, batch_size=2, device=dev)

    ref = build_gpt(cfg, ref_pgc, attention="cpkit", device=dev)
    ref_loss = train_step(ref, batch, ref_pgc)
    ref_grads = named_gradients(ref)
    ref_after = eval_step(ref, batch, ref_pgc)

    model = build_gpt(cfg, pgc, attention="cpkit", cp_comm_type=case["comm"],
                      hierarchical_cp_sizes=case["hcp"], device=dev)
    local = shard_batch(batch, get_pg(pgc, "cp"))
    loss = train_step(model, local, pgc)
    grads = named_gradients(model)
    after = eval_step(model, local, pgc)

    tol = TOL[dtype]
    assert abs(loss - ref_loss) <= tol["loss"], f"loss {loss} vs cp=1 {ref_loss}"
    assert abs(after - ref_after) <= tol["loss"], f"loss after the step {after} vs cp=1 {ref_after}"
    if not mla:  # the sinks are trained: their gradient is part of the check
        assert any(name.endswith("softmax_offset") for name in grads), sorted(grads)
    assert_grads_close(grads, ref_grads, rtol=tol["rtol"], atol=tol["atol"], scaled=dtype != torch.float32)
    return loss, ref_loss


@pytest.mark.parametrize("backend,world_size,case_id", grid_params(_cases, scenario=gpt_feature_case, timeout=600.0))
def test_feature_gpt_matches_cp1(backend, world_size, case_id):
    grid_result(gpt_feature_case, _cases, backend, world_size, case_id).check()
