"""Hierarchical CP (a2a+p2p) configured in Megatron-Bridge's terms, trained for a few steps.

The Bridge fields (a recipe override sets the same ones):

    cfg.model.context_parallel_size = 4
    cfg.model.cp_comm_type = "a2a+p2p"
    cfg.model.hierarchical_context_parallel_sizes = [2, 2]   # [a2a level, p2p level], product = cp
    cfg.dist.use_decentralized_pg = False                    # Bridge's decentralized path refuses the sizes

What runs, on every rank: Bridge's model config checks (`TransformerConfig.finalize`,
`ConfigContainer._validate_cp_comm_type`) and cpkit's layout check (stricter: heads over the a2a
level, two positive levels, known comm types), then Bridge's MPU initialization
(`training/initialize.py::_initialize_distributed`: `parallel_state.initialize_model_parallel(...,
hierarchical_context_parallel_sizes=...)`, then `ProcessGroupCollection.use_mpu_process_groups()`),
then the HIERARCHICAL_CONTEXT_PARALLEL_GROUPS line of rank 0's groups (cpkit.groups.describe_groups),
a small MCore GPT with cpkit's CP attention on those groups, `--steps` SGD steps, the loss
printed by rank 0. Bridge's files come from the checkout named by CPKIT_BRIDGE_SRC.

Launch on 4 CPU processes (gloo), or on 4 GPUs with `--backend nccl`:

    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src torchrun --standalone --nproc_per_node 4 examples/bridge_a2a_p2p.py --backend gloo
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-comm-type", default="a2a+p2p", help="cfg.model.cp_comm_type")
    parser.add_argument("--hierarchical-cp-sizes", default="2,2",
                        help="cfg.model.hierarchical_context_parallel_sizes, comma separated")
    parser.add_argument("--seq-length", type=int, default=64, help="full sequence length (before CP)")
    parser.add_argument("--steps", type=int, default=2, help="training steps")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl", help="torch.distributed backend")
    return parser.parse_args(argv)


def main(argv=None) -> list[float]:
    """Run the example on this rank (torch.distributed from torchrun's environment, unless
    already initialized); returns the losses of the steps."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cpkit.groups import HCP_LOG_PREFIX, describe_groups
    from cpkit.layout import CPLayout
    from cpkit.sharding import shard_batch
    from cpkit.testing.bridge_hcp import DistInit, bridge_model_config, bridge_modules
    from cpkit.testing.cpu_shim import install_mcore_cpu_shim
    from cpkit.testing.models import GPTConfig, build_gpt, make_batch, train_step

    args = parse_args(argv)
    sizes = [int(s) for s in args.hierarchical_cp_sizes.split(",")] if args.hierarchical_cp_sizes else None
    if not dist.is_initialized():
        # Bridge's own init of torch.distributed reads helpers of Megatron-LM's training package;
        # the process group is the same either way, so it is created here.
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(args.backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    if dev.type == "cpu":
        install_mcore_cpu_shim()

    bridge = bridge_modules()
    # cfg.model: CP over every rank (tp = pp = 1), as the Bridge fields above
    model_config = bridge_model_config(
        bridge, num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
        context_parallel_size=world, cp_comm_type=args.cp_comm_type,
        hierarchical_context_parallel_sizes=sizes)
    CPLayout.from_transformer_config(model_config, world, seq_length=args.seq_length).validate()
    # cfg.dist
    dist_config = DistInit(distributed_backend=args.backend, use_decentralized_pg=False)
    pg_collection = bridge.initialize_distributed(model_config, dist_config, 1, None, None)
    try:
        if rank == 0:  # the line to look for: Bridge and MCore log none for hierarchical groups
            print(f"Megatron-Bridge {bridge.commit}: cp={world} {args.cp_comm_type} sizes={sizes}", flush=True)
            print(*[line for line in describe_groups(pg_collection) if line.startswith(HCP_LOG_PREFIX)],
                  sep="\n", flush=True)
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                        seq_length=args.seq_length, dtype=dtype)
        model = build_gpt(cfg, pg_collection, attention="cpkit", cp_comm_type=args.cp_comm_type,
                          hierarchical_cp_sizes=sizes, device=dev)
        losses = []
        for step in range(args.steps):
            batch = shard_batch(make_batch(cfg, batch_size=2, seed=step, device=dev), pg_collection.cp)
            losses.append(train_step(model, batch, pg_collection))
            if rank == 0:
                print(f"step {step + 1} loss {losses[-1]:.6f}", flush=True)
    finally:
        parallel_state.destroy_model_parallel()
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
    import torch.distributed as dist

    dist.destroy_process_group()
