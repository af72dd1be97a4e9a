"""Scenario of functional/test_bridge_hcp.py: hierarchical CP through Megatron-Bridge's own
initialization (its MPU path), then a training step of the small GPT with cpkit's attention on
the groups Bridge created, against the cp=1 reference.

Per case, on every rank (cp = the world size, tp = pp = 1):
1. Bridge's model config (`TransformerConfig.finalize`, `ConfigContainer._validate_cp_comm_type`)
   and `training/initialize.py::_initialize_distributed` with `use_decentralized_pg=False`, which
   calls `parallel_state.initialize_model_parallel(..., hierarchical_context_parallel_sizes=...)`
   and returns `ProcessGroupCollection.use_mpu_process_groups()`;
2. the collection's `hcp` holds two groups, and this rank's membership is MCore's definition of
   the levels, derived here from the sizes: level 0 (a2a) the `a` consecutive CP ranks holding
   this rank, level 1 (p2p) the CP ranks with this rank's position in its level-0 group; the
   same ranks as cpkit's decentralized groups for the same layout (`cpkit.parallel.groups`);
3. one SGD step of the small GPT (cpkit attention, a2a+p2p on those groups) gives the cp=1
   reference's loss before and after the step and its gradients: fp32 loss 1e-5 and gradients
   rtol = atol = 1e-5 (bf16 on NCCL: 5e-3 and 2e-2 of each gradient's scale). The reference is
   MCore's local attention for the GQA model and cpkit's attention at cp=1 (every group of size 1)
   for MLA and sliding window + sinks, which MCore's local attention does not run; cpkit's cp=1
   is checked against MCore and a plain reference in tests/test_attention_module.py.
Then `parallel_state.destroy_model_parallel()`, so the next case initializes afresh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["WORLD", "bridge_hcp_case", "cases", "expected_levels"]

WORLD = 4
HEADS, KV_HEADS = 8, 4  # KV heads divide over every a2a level used here (4, 2, 1)
TOL = {
    torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(loss=5e-3, rtol=2e-2, atol=2e-2),
}


def cases(backend: str, world_size: int) -> list[dict]:
    """GQA at [2,2], [1,4], [4,1]; MLA and sliding window + sinks at [2,2]; on 4 ranks only."""
    if world_size != WORLD:
        return []
    out = [dict(id=f"gqa-[{a},{p}]", model="gqa", hcp=[a, p]) for a, p in ((2, 2), (1, 4), (4, 1))]
    out += [dict(id=f"{model}-[2,2]", model=model, hcp=[2, 2]) for model in ("mla", "window-learnable-softmax")]
    return out


def expected_levels(rank: int, sizes: list[int]) -> tuple[list[int], list[int]]:
    """(level-0 ranks, level-1 ranks) of `rank` when cp = the world and tp = 1: level 0 the
    sizes[0] consecutive ranks holding it, level 1 every sizes[0]-th rank from its offset."""
    a, p = sizes
    start = rank - rank % a
    return list(range(start, start + a)), [rank % a + j * a for j in range(p)]


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def bridge_hcp_case(case):
    """One case (module docstring); returns this rank's levels, the losses and the largest
    gradient difference."""
    from megatron.core import parallel_state

    from cpkit.upstream.bridge import DistInit, bridge_model_config, bridge_modules
    from cpkit.parallel.groups import build_pg_collection
    from cpkit.parallel.layout import CPLayout
    from cpkit.mcore_cpu import install_mcore_cpu_shim
    from cpkit.process_device import device
    from cpkit.sharding import shard_batch
    from cpkit.testing.compare import assert_grads_close
    from cpkit.testing.models import FEATURE_MODELS, GPTConfig, build_gpt, eval_step, make_batch, named_gradients, train_step
    from cpkit.testing.reference import single_rank_pg_collection

    install_mcore_cpu_shim()
    bridge = bridge_modules()
    dev = device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    seq = 32 if dev.type == "cpu" else 4096
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = case["hcp"]
    extra = FEATURE_MODELS.get(case["model"], {})
    mla = bool(extra.get("multi_latent_attention"))
    kv_heads = None if mla else KV_HEADS

    # 1. Bridge's config checks and its MPU initialization
    model_config = bridge_model_config(
        bridge, num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=kv_heads,
        context_parallel_size=world, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=sizes,
        **extra)
    backend = dist.get_backend()
    try:
        pgc = bridge.initialize_distributed(model_config, DistInit(distributed_backend=backend), 1, None, None)

        # 2. the hierarchical groups and this rank's membership
        assert isinstance(pgc.hcp, list) and len(pgc.hcp) == 2, f"hcp = {pgc.hcp!r}"
        levels = [_ranks(g) for g in pgc.hcp]
        assert levels == list(expected_levels(rank, sizes)), f"rank {rank}: {levels} for sizes {sizes}"
        assert _ranks(pgc.cp) == list(range(world))
        layout = CPLayout(world_size=world, cp=world, cp_comm_type="a2a+p2p",
                          hierarchical_context_parallel_sizes=sizes, seq_length=seq,
                          num_attention_heads=HEADS, num_query_groups=HEADS if mla else KV_HEADS)
        ours = build_pg_collection(layout)
        assert [_ranks(g) for g in ours.hcp] == levels, "cpkit's decentralized hcp differs from Bridge's MPU hcp"

        # 3. one training step on Bridge's groups against cp=1
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=kv_heads,
                        seq_length=seq, dtype=dtype, extra=extra)
        batch = make_batch(cfg, batch_size=2, device=dev)
        ref_pgc = single_rank_pg_collection()
        local_ref = case["model"] == "gqa" and dtype == torch.float32
        ref = build_gpt(cfg, ref_pgc, attention="local" if local_ref else "cpkit", device=dev)
        ref_loss = train_step(ref, batch, ref_pgc)
        ref_grads = named_gradients(ref)
        ref_after = eval_step(ref, batch, ref_pgc)

        model = build_gpt(cfg, pgc, attention="cpkit", cp_comm_type="a2a+p2p", hierarchical_cp_sizes=sizes,
                          device=dev)
        local = shard_batch(batch, pgc.cp)
        loss = train_step(model, local, pgc)
        grads = named_gradients(model)
        after = eval_step(model, local, pgc)
    finally:
        parallel_state.destroy_model_parallel()

    tol = TOL[dtype]
    assert abs(loss - ref_loss) <= tol["loss"], f"loss {loss} vs cp=1 {ref_loss}"
    assert abs(after - ref_after) <= tol["loss"], f"loss after the step {after} vs cp=1 {ref_after}"
    if case["model"] == "window-learnable-softmax":  # the sinks are trained: their gradient is checked
        assert any(name.endswith("softmax_offset") for name in grads), sorted(grads)
    assert_grads_close(grads, ref_grads, rtol=tol["rtol"], atol=tol["atol"], scaled=dtype != torch.float32)
    worst = max(float((grads[n].float() - ref_grads[n].float()).abs().max()) for n in grads)
    return dict(levels=levels, loss=loss, ref_loss=ref_loss, after=after, ref_after=ref_after,
                max_grad_diff=worst, bridge_commit=bridge.commit)
