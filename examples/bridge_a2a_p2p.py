"""Hierarchical CP (a2a+p2p) configured in Megatron-Bridge's terms, initialized by Bridge's own
code, one training step checked against CP 1.

The Bridge fields (a recipe override sets the same ones):

    cfg.model.context_parallel_size = 4
    cfg.model.cp_comm_type = "a2a+p2p"
    cfg.model.hierarchical_context_parallel_sizes = [2, 2]   # [a2a level, p2p level], product = cp
    cfg.dist.use_decentralized_pg = False                    # Bridge's decentralized path refuses the sizes

What runs, on every rank: Bridge's model config checks (`TransformerConfig.finalize`,
`ConfigContainer._validate_cp_comm_type`) and cpkit's layout check (stricter: heads over the a2a
level, two positive levels, known comm types); Bridge's MPU initialization
(`training/initialize.py::_initialize_distributed`: `parallel_state.initialize_model_parallel(...,
hierarchical_context_parallel_sizes=...)`, then `ProcessGroupCollection.use_mpu_process_groups()`);
rank 0's HIERARCHICAL_CONTEXT_PARALLEL_GROUPS line (Bridge and MCore print none); one step of a
small MCore GPT with cpkit's CP attention on Bridge's groups, and the same step at CP 1: same loss,
same gradients. Bridge's files come from the checkout named by CPKIT_BRIDGE_SRC.

    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src python examples/bridge_a2a_p2p.py                        # spawns 4 gloo ranks
    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src torchrun --nproc-per-node 4 examples/bridge_a2a_p2p.py   # or torchrun starts them
"""

import os
import sys

import torch
import torch.distributed as dist

from cpkit.groups import HCP_LOG_PREFIX, describe_groups
from cpkit.layout import CPLayout
from cpkit.sharding import shard_batch
from cpkit.testing.bridge_hcp import DistInit, bridge_model_config, bridge_modules
from cpkit.testing.bridge_src import bridge_src
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.testing.models import GPTConfig, build_gpt, make_batch, named_gradients, train_step
from cpkit.testing.reference import single_rank_pg_collection

SEQ, HEADS, KV_HEADS = 32, 8, 4
HCP = [2, 2]  # [a2a size, p2p size]: a2a inside a node, p2p between nodes on a real cluster


def main() -> str:
    """One rank's part; torch.distributed is initialized (gloo). Returns rank 0's report."""
    from megatron.core import parallel_state

    install_mcore_cpu_shim()  # MCore calls CUDA in a few places; this lets it run on CPU
    world = dist.get_world_size()
    bridge = bridge_modules()

    # cfg.model: CP over every rank (tp = pp = 1); Bridge's checks, then cpkit's on the same values
    model_config = bridge_model_config(
        bridge, num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        context_parallel_size=world, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=HCP)
    CPLayout.from_transformer_config(model_config, world, seq_length=SEQ).validate()
    # cfg.dist: the MPU path
    pgs = bridge.initialize_distributed(model_config, DistInit(distributed_backend="gloo", use_decentralized_pg=False),
                                        1, None, None)
    try:
        groups = [line for line in describe_groups(pgs) if line.startswith(HCP_LOG_PREFIX)]  # rank 0's a2a, p2p
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                        seq_length=SEQ)
        batch = make_batch(cfg, batch_size=2, seed=0)
        model = build_gpt(cfg, pgs, attention="cpkit", cp_comm_type="a2a+p2p", hierarchical_cp_sizes=HCP,
                          device="cpu")
        cp_loss = train_step(model, shard_batch(batch, pgs.cp), pgs)
        cp_grads = named_gradients(model)
    finally:
        parallel_state.destroy_model_parallel()

    # CP 1: every group this rank alone, MCore's own attention, the whole batch
    one = single_rank_pg_collection()
    reference = build_gpt(cfg, one, attention="local", device="cpu")
    ref_loss = train_step(reference, batch, one)
    ref_grads = named_gradients(reference)
    assert abs(cp_loss - ref_loss) <= 1e-5, (cp_loss, ref_loss)
    for name, grad in ref_grads.items():  # fp32 on CPU
        torch.testing.assert_close(cp_grads[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    worst = max((cp_grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    return "\n".join([f"Megatron-Bridge {bridge.commit}: cp={world} a2a+p2p {HCP} on the MPU path"] + groups + [
        f"loss at cp 4 (a2a+p2p {HCP}, Bridge's groups): {cp_loss:.6f}; at cp 1: {ref_loss:.6f}; "
        f"largest gradient difference {worst:.1e}"])


if __name__ == "__main__":
    if bridge_src()[0] is None:
        sys.exit(bridge_src()[1])
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 4 ranks; a rank that fails or hangs past the timeout stops them all
        from cpkit.launch import launch

        print(launch(main, 4, timeout=300)[0])
