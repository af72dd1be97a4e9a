"""CP attention in your own GPT: put cpkit's core attention into MCore's layer spec, train one
step at CP 2 on 2 ranks (each rank holds half of every sequence) and check it against the same
step at CP 1 (data parallel, one sequence per rank): same loss, same gradients.

    python examples/cp_attention_in_your_gpt.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/cp_attention_in_your_gpt.py  # or let torchrun start them
"""

import os

import torch
import torch.distributed as dist

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.groups import build_pg_collection
from cpkit.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients
from cpkit.sharding import shard_batch
from cpkit.mcore_cpu import install_mcore_cpu_shim

SEQ, VOCAB, HEADS = 32, 128, 4


def build_gpt(pgs, cp: int):
    """Your GPT with the one change CP needs: cpkit's block spec (MCore's local layer spec with
    ContextParallelAttention as core attention) and context_parallel_size / cp_comm_type."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, context_parallel_size=cp,
                               cp_comm_type="p2p", use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
                               masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_block_spec_with_cp_attention(config), vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", pg_collection=pgs)


def make_batch(n: int, seed: int) -> dict:
    """n full sequences [n, SEQ]: tokens, labels (the next token), loss_mask, position_ids."""
    seq = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(n, SEQ),
            "position_ids": torch.arange(SEQ).expand(n, -1)}


def train_step(model, local_batch: dict, pgs, total_tokens: float) -> tuple[float, dict]:
    """Forward, backward, gradients summed over dp x cp: (global loss, gradients by name)."""
    loss = forward_loss(model, local_batch, pgs, total_tokens=total_tokens)  # loss from the logits
    loss.backward()
    reduce_gradients(model, pgs)
    return global_loss(loss, pgs), {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> str:
    """One rank's part; torch.distributed is initialized (gloo). Returns rank 0's report."""
    install_mcore_cpu_shim()  # MCore calls CUDA in a few places; this lets it run on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(world, seed=0)
    tokens = batch["loss_mask"].sum().item()

    # CP 2: every rank holds its half of every sequence (chunks r and 2*cp-1-r, load-balanced).
    cp_pgs = build_pg_collection(CPLayout(world_size=world, cp=world, seq_length=SEQ, num_attention_heads=HEADS))
    cp_loss, cp_grads = train_step(build_gpt(cp_pgs, cp=world), shard_batch(batch, cp_pgs.cp), cp_pgs, tokens)

    # CP 1, data parallel: rank r holds all of sequence r.
    dp_pgs = build_pg_collection(CPLayout(world_size=world, cp=1, seq_length=SEQ, num_attention_heads=HEADS))
    dp_loss, dp_grads = train_step(build_gpt(dp_pgs, cp=1), {k: v[rank:rank + 1] for k, v in batch.items()},
                                   dp_pgs, tokens)

    assert abs(cp_loss - dp_loss) <= 1e-5, (cp_loss, dp_loss)
    for name, grad in dp_grads.items():  # fp32 on CPU
        torch.testing.assert_close(cp_grads[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    worst = max((cp_grads[n] - g).abs().max().item() for n, g in dp_grads.items())
    return f"loss at cp 2: {cp_loss:.6f}; at cp 1: {dp_loss:.6f}; largest gradient difference {worst:.1e}"


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 2 ranks; a rank that fails or hangs past the timeout stops them all
        from cpkit.launch import launch

        print(launch(main, 2, timeout=300)[0])
