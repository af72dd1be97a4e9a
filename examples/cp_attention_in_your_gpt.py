"""CP attention in your own GPT: put cpkit's core attention into MCore's layer spec, train one
step at CP N on N ranks (each rank holds 1/N of every sequence) and check it against the same
step at CP 1 (data parallel, one sequence per rank): same loss, same gradients. N is 2 or 4.

    python examples/cp_attention_in_your_gpt.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/cp_attention_in_your_gpt.py  # or 4; torchrun starts them
    torchrun --nproc-per-node 4 examples/cp_attention_in_your_gpt.py  # on a GPU host: nccl, cuda:LOCAL_RANK

Under torchrun with a GPU for each LOCAL_RANK every rank runs NCCL on cuda:LOCAL_RANK and MCore
on CUDA; otherwise gloo on CPU (cpkit.devices.init_rank). Rank 0 prints each rank's backend and
device, what was checked, and the two losses.
"""

import os

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients
from cpkit.sharding import shard_batch

SEQ, VOCAB, HEADS = 32, 128, 4
WORLD_SIZES = (2, 4)  # CP over every rank; SEQ splits into 2*cp chunks
DTYPE = torch.float32  # on CPU and on GPU
# Tolerances per dtype against CP 1: CP only reorders the attention sums (LSE merge of partial
# blocks, on CPU exact math, on GPU PyTorch's fused fp32 SDPA kernels; TF32 off, torch's default).
TOL = {torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5)}


def build_gpt(pgs, cp: int, device):
    """Your GPT with the one change CP needs: cpkit's block spec (MCore's local layer spec with
    ContextParallelAttention as core attention) and context_parallel_size / cp_comm_type.
    Weights from torch.manual_seed(0) on CPU, the same at every layout, then moved to `device`."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, context_parallel_size=cp,
                               cp_comm_type="p2p", use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
                               masked_softmax_fusion=False, gradient_accumulation_fusion=False, params_dtype=DTYPE)
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
    check_world_size(world, WORLD_SIZES, "examples/cp_attention_in_your_gpt.py")
    ranks = describe_rank_devices(rd)
    batch = make_batch(world, seed=0, device=rd.device)
    tokens = batch["loss_mask"].sum().item()

    # CP N: every rank holds its 1/N of every sequence (chunks r and 2*cp-1-r, load-balanced).
    cp_pgs = build_pg_collection(CPLayout(world_size=world, cp=world, seq_length=SEQ, num_attention_heads=HEADS))
    cp_loss, cp_grads = train_step(build_gpt(cp_pgs, world, rd.device), shard_batch(batch, cp_pgs.cp), cp_pgs,
                                   tokens)

    # CP 1, data parallel: rank r holds all of sequence r.
    dp_pgs = build_pg_collection(CPLayout(world_size=world, cp=1, seq_length=SEQ, num_attention_heads=HEADS))
    dp_loss, dp_grads = train_step(build_gpt(dp_pgs, 1, rd.device), {k: v[rank:rank + 1] for k, v in batch.items()},
                                   dp_pgs, tokens)

    tol = TOL[DTYPE]
    assert abs(cp_loss - dp_loss) <= tol["loss"], (
        f"loss at cp {world} {cp_loss:.6f} differs from cp 1 {dp_loss:.6f} by more than {tol['loss']:g}")
    for name, grad in dp_grads.items():
        torch.testing.assert_close(cp_grads[name], grad, rtol=tol["rtol"], atol=tol["atol"],
                                   msg=lambda m, n=name: f"{n}: {m}")
    worst = max((cp_grads[n] - g).abs().max().item() for n, g in dp_grads.items())
    return (f"ranks: {ranks}\n"
            f"checked: loss and {len(dp_grads)} gradients at cp {world} against cp 1, {DTYPE}, "
            f"loss within {tol['loss']:g}, gradients rtol {tol['rtol']:g} atol {tol['atol']:g}\n"
            f"loss at cp {world}: {cp_loss:.6f}; at cp 1: {dp_loss:.6f}; largest gradient difference {worst:.1e}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 2 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.harness.launch import launch

        print(launch(main, 2, timeout=300)[0])
