"""Hierarchical CP (a2a+p2p) in your own GPT: CP N as a2a inside pairs of ranks and a p2p ring
across the pairs ([2, N/2]), one training step on N ranks, checked against the same step at CP 1
(data parallel, one sequence per rank): same loss, same gradients. N is 4 ([2, 2]) or 2 ([2, 1]).

    python examples/hierarchical_cp_in_your_gpt.py                       # spawns 4 gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/hierarchical_cp_in_your_gpt.py  # or 4; torchrun starts them
    torchrun --nproc-per-node 4 examples/hierarchical_cp_in_your_gpt.py  # on a GPU host: nccl, cuda:LOCAL_RANK

Under torchrun with a GPU for each LOCAL_RANK every rank runs NCCL on cuda:LOCAL_RANK and MCore
on CUDA; otherwise gloo on CPU (cpkit.devices.init_rank). Rank 0 prints each rank's backend and
device, its hierarchical groups, what was checked, and the two losses.
"""

import os

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.parallel.groups import HCP_LOG_PREFIX, build_pg_collection, describe_groups
from cpkit.parallel.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients
from cpkit.sharding import shard_batch

SEQ, VOCAB, HEADS = 32, 128, 4
WORLD_SIZES = (2, 4)  # CP over every rank: [a2a 2, p2p N/2]; a2a splits the 4 heads in two
DTYPE = torch.float32  # on CPU and on GPU
# Tolerances per dtype against CP 1: CP only reorders the attention sums (LSE merge of partial
# blocks, on CPU exact math, on GPU PyTorch's fused fp32 SDPA kernels; TF32 off, torch's default).
TOL = {torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5)}


def build_gpt(pgs, cp: int, device, cp_comm_type: str = "p2p", hierarchical_sizes=None):
    """Your GPT with cpkit's block spec (ContextParallelAttention as core attention) and the CP
    fields of the config; the hierarchical groups come from pgs.hcp. Weights from
    torch.manual_seed(0) on CPU, the same at every layout, then moved to `device`."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, context_parallel_size=cp,
                               cp_comm_type=cp_comm_type, hierarchical_context_parallel_sizes=hierarchical_sizes,
                               use_cpu_initialization=True, hidden_dropout=0.0, params_dtype=DTYPE,
                               attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
                               masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_block_spec_with_cp_attention(config), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", pg_collection=pgs)
    return model.to(device)


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
    rd = init_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(world, WORLD_SIZES, "examples/hierarchical_cp_in_your_gpt.py")
    ranks = describe_rank_devices(rd)
    hcp = [2, world // 2]  # [a2a size, p2p size]: a2a inside a node, p2p between nodes on a real cluster
    batch = make_batch(world, seed=0, device=rd.device)
    tokens = batch["loss_mask"].sum().item()

    # CP N = a2a 2 x p2p N/2: CPLayout checks the sizes (and the heads a2a splits) before any
    # group exists; build_pg_collection also builds the hierarchical groups (pgs.hcp).
    layout = CPLayout(world_size=world, cp=world, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=hcp,
                      seq_length=SEQ, num_attention_heads=HEADS)
    cp_pgs = build_pg_collection(layout)
    groups = [line for line in describe_groups(cp_pgs) if line.startswith(HCP_LOG_PREFIX)]  # rank 0's a2a, p2p
    model = build_gpt(cp_pgs, world, rd.device, cp_comm_type="a2a+p2p", hierarchical_sizes=hcp)
    cp_loss, cp_grads = train_step(model, shard_batch(batch, cp_pgs.cp), cp_pgs, tokens)

    # CP 1, data parallel: rank r holds all of sequence r.
    dp_pgs = build_pg_collection(CPLayout(world_size=world, cp=1, seq_length=SEQ, num_attention_heads=HEADS))
    dp_loss, dp_grads = train_step(build_gpt(dp_pgs, 1, rd.device), {k: v[rank:rank + 1] for k, v in batch.items()},
                                   dp_pgs, tokens)

    tol = TOL[DTYPE]
    assert abs(cp_loss - dp_loss) <= tol["loss"], (
        f"loss at cp {world} (a2a+p2p {hcp}) {cp_loss:.6f} differs from cp 1 {dp_loss:.6f} "
        f"by more than {tol['loss']:g}")
    for name, grad in dp_grads.items():
        torch.testing.assert_close(cp_grads[name], grad, rtol=tol["rtol"], atol=tol["atol"],
                                   msg=lambda m, n=name: f"{n}: {m}")
    worst = max((cp_grads[n] - g).abs().max().item() for n, g in dp_grads.items())
    return "\n".join([f"ranks: {ranks}"] + groups + [
        f"checked: loss and {len(dp_grads)} gradients at cp {world} (a2a+p2p {hcp}) against cp 1, {DTYPE}, "
        f"loss within {tol['loss']:g}, gradients rtol {tol['rtol']:g} atol {tol['atol']:g}",
        f"loss at cp {world} (a2a+p2p {hcp}): {cp_loss:.6f}; at cp 1: {dp_loss:.6f}; "
        f"largest gradient difference {worst:.1e}"])


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 4 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.harness.launch import launch

        print(launch(main, 4, timeout=300)[0])
