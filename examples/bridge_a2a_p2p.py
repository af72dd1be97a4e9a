"""Hierarchical CP (a2a+p2p) configured in Megatron-Bridge's terms, initialized by Bridge's own
code, one training step checked against CP 1. On 4 ranks ([2, 2]) or 2 ([2, 1]).

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
small MCore GPT with cpkit's CP attention on Bridge's groups, and the same step at CP 1 (data
parallel, MCore's own attention): same loss, same gradients. Bridge's files come from the
checkout named by CPKIT_BRIDGE_SRC (cpkit.upstream.bridge).

    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src python examples/bridge_a2a_p2p.py                        # spawns 4 gloo ranks
    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src torchrun --nproc-per-node 4 examples/bridge_a2a_p2p.py   # or 2; torchrun

Under torchrun with a GPU for each LOCAL_RANK every rank runs NCCL on cuda:LOCAL_RANK (Bridge's
distributed_backend too) and MCore on CUDA; otherwise gloo on CPU (cpkit.devices.init_rank).
Rank 0 prints each rank's backend and device, the groups, what was checked, and the two losses.
"""

import os
import sys

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.upstream.bridge import DistInit, bridge_model_config, bridge_modules, bridge_src
from cpkit.compat import ensure_global_memory_buffer
from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.parallel.groups import HCP_LOG_PREFIX, build_pg_collection, describe_groups
from cpkit.parallel.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients
from cpkit.sharding import shard_batch

SEQ, VOCAB, HEADS, KV_HEADS = 32, 128, 8, 4
WORLD_SIZES = (2, 4)  # CP over every rank: [a2a 2, p2p N/2]
DTYPE = torch.float32  # on CPU and on GPU
# Tolerances per dtype against CP 1: CP only reorders the attention sums (LSE merge of partial
# blocks, on CPU exact math, on GPU PyTorch's fused fp32 SDPA kernels; TF32 off, torch's default).
TOL = {torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5)}


def build_gpt(config, pgs, device, cp_attention: bool):
    """Your GPT for `config` (Bridge's TransformerConfig, or MCore's for the reference): cpkit's
    block spec (ContextParallelAttention as core attention) or MCore's local spec. Weights from
    torch.manual_seed(0) on CPU, the same at every layout, then moved to `device`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention

    spec = get_gpt_block_spec_with_cp_attention(config) if cp_attention else get_gpt_layer_local_spec()
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     pg_collection=pgs)
    return model.to(device)


MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
             apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
             params_dtype=DTYPE)


def make_batch(n: int, seed: int, device) -> dict:
    """n full sequences [n, SEQ]: tokens, labels (the next token), loss_mask, position_ids."""
    seq = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(n, SEQ),
             "position_ids": torch.arange(SEQ).expand(n, -1)}
    return {k: v.to(device) for k, v in batch.items()}


def train_step(model, local_batch: dict, pgs, total_tokens: float) -> tuple[float, dict]:
    """Forward, backward, gradients summed over dp x cp: (global loss, gradients by name)."""
    loss = forward_loss(model, local_batch, pgs, total_tokens=total_tokens)  # loss from the logits
    loss.backward()
    reduce_gradients(model, pgs)
    return global_loss(loss, pgs), {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> str:
    """One rank's part (nccl on cuda:LOCAL_RANK under torchrun on a GPU host, else gloo on CPU).
    Returns rank 0's report."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    rd = init_rank(memory_buffer=False)  # Bridge's MPU initialization creates MCore's buffer
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(world, WORLD_SIZES, "examples/bridge_a2a_p2p.py")
    ranks = describe_rank_devices(rd)
    hcp = [2, world // 2]  # [a2a size, p2p size]: a2a inside a node, p2p between nodes on a real cluster
    bridge = bridge_modules()
    batch = make_batch(world, seed=0, device=rd.device)
    tokens = batch["loss_mask"].sum().item()

    # cfg.model: CP over every rank (tp = pp = 1); Bridge's checks, then cpkit's on the same values
    model_config = bridge_model_config(bridge, **MODEL, context_parallel_size=world, cp_comm_type="a2a+p2p",
                                       hierarchical_context_parallel_sizes=hcp)
    CPLayout.from_transformer_config(model_config, world, seq_length=SEQ).validate()
    # cfg.dist: the MPU path, on this rank's backend
    pgs = bridge.initialize_distributed(
        model_config, DistInit(distributed_backend=rd.backend, use_decentralized_pg=False), 1, None, None)
    try:
        groups = [line for line in describe_groups(pgs) if line.startswith(HCP_LOG_PREFIX)]  # rank 0's a2a, p2p
        model = build_gpt(model_config, pgs, rd.device, cp_attention=True)
        cp_loss, cp_grads = train_step(model, shard_batch(batch, pgs.cp), pgs, tokens)
    finally:
        parallel_state.destroy_model_parallel()  # drops MCore's global memory buffer with the groups
    # The cp=1 reference runs MCore's local attention on the decentralized path, which takes its
    # scratch space from that buffer and never creates it (CUDA and the CPU shim alike)
    ensure_global_memory_buffer()

    # CP 1, data parallel, MCore's own attention: rank r holds all of sequence r.
    dp_pgs = build_pg_collection(CPLayout(world_size=world, cp=1, seq_length=SEQ, num_attention_heads=HEADS,
                                          num_query_groups=KV_HEADS))
    reference = build_gpt(TransformerConfig(**MODEL), dp_pgs, rd.device, cp_attention=False)
    dp_loss, dp_grads = train_step(reference, {k: v[rank:rank + 1] for k, v in batch.items()}, dp_pgs, tokens)

    tol = TOL[DTYPE]
    assert abs(cp_loss - dp_loss) <= tol["loss"], (
        f"loss at cp {world} (a2a+p2p {hcp}, Bridge's groups) {cp_loss:.6f} differs from cp 1 {dp_loss:.6f} "
        f"by more than {tol['loss']:g}")
    assert sorted(cp_grads) == sorted(dp_grads), sorted(set(cp_grads) ^ set(dp_grads))
    for name, grad in dp_grads.items():
        torch.testing.assert_close(cp_grads[name], grad, rtol=tol["rtol"], atol=tol["atol"],
                                   msg=lambda m, n=name: f"{n}: {m}")
    worst = max((cp_grads[n] - g).abs().max().item() for n, g in dp_grads.items())
    return "\n".join([f"ranks: {ranks}", f"Megatron-Bridge {bridge.commit}: cp={world} a2a+p2p {hcp} on the MPU path"]
                     + groups + [
        f"checked: loss and {len(dp_grads)} gradients at cp {world} (a2a+p2p {hcp}, Bridge's groups) against cp 1 "
        f"(MCore's attention), {DTYPE}, loss within {tol['loss']:g}, gradients rtol {tol['rtol']:g} "
        f"atol {tol['atol']:g}",
        f"loss at cp {world} (a2a+p2p {hcp}, Bridge's groups): {cp_loss:.6f}; at cp 1: {dp_loss:.6f}; "
        f"largest gradient difference {worst:.1e}"])


if __name__ == "__main__":
    if bridge_src()[0] is None:
        sys.exit(bridge_src()[1])
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 4 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.harness.launch import launch

        print(launch(main, 4, timeout=300)[0])
