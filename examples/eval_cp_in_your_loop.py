"""Eval-time CP in your own training loop: train one step at CP 1 on 2 ranks (data parallel),
evaluate a validation sequence at CP 2 (each rank holds half of it), check that the training
groups are back, and compare with the same evaluation at CP 1.

    python examples/eval_cp_in_your_loop.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/eval_cp_in_your_loop.py  # or let torchrun start them
"""

import os

import torch
import torch.distributed as dist

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.eval_cp import build_eval_pg_collection, eval_cp_context
from cpkit.groups import build_pg_collection
from cpkit.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients
from cpkit.sharding import shard_batch
from cpkit.mcore_cpu import install_mcore_cpu_shim

SEQ, VOCAB, HEADS = 32, 128, 4


def build_gpt(pgs):
    """Your GPT: MCore's GPTModel with cpkit's CP attention, built at the training layout."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                               apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_block_spec_with_cp_attention(config), vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", pg_collection=pgs)


def make_batch(n: int, seed: int) -> dict:
    """n full sequences [n, SEQ]: tokens, labels (the next token), loss_mask, position_ids."""
    seq = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(n, SEQ),
            "position_ids": torch.arange(SEQ).expand(n, -1)}


def main() -> str:
    """One rank's part; torch.distributed is initialized (gloo). Returns rank 0's report."""
    install_mcore_cpu_shim()  # MCore calls CUDA in a few places; this lets it run on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = CPLayout(world_size=world, cp=1, seq_length=SEQ, num_attention_heads=HEADS)
    train_pgs = build_pg_collection(layout)
    eval_pgs = build_eval_pg_collection(layout, 2, train_pgs=train_pgs)  # once, on every rank
    model = build_gpt(train_pgs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # Train one step at CP 1: one sequence per rank. The loss comes from the logits
    # (forward_loss): model(..., labels=...) needs MCore's global groups, which this path has not.
    train = make_batch(world, seed=0)
    local = {k: v[rank:rank + 1] for k, v in train.items()}
    loss = forward_loss(model, local, train_pgs, total_tokens=train["loss_mask"].sum().item())
    loss.backward()
    reduce_gradients(model, train_pgs)  # sum over dp x cp, as MCore's DDP would
    optimizer.step()
    optimizer.zero_grad()
    train_loss = global_loss(loss, train_pgs)

    # Evaluate at CP 2, then at CP 1 (outside the block the model is the training one again).
    val = make_batch(1, seed=1)
    tokens = val["loss_mask"].sum().item()
    attention = model.decoder.layers[0].self_attention.core_attention
    train_cp_group = attention.cp_group
    model.eval()
    with torch.no_grad():
        with eval_cp_context(model, eval_pgs) as rebinding:
            assert rebinding.active and attention.cp_group is eval_pgs.cp
            half = shard_batch(val, eval_pgs.cp)  # this rank's half of the sequence
            eval_loss = global_loss(forward_loss(model, half, eval_pgs, total_tokens=tokens), eval_pgs)
        assert not rebinding.active and attention.cp_group is train_cp_group  # restored, object for object
        cp1_loss = forward_loss(model, val, train_pgs, total_tokens=tokens).item()  # each rank: all of it
    model.train()
    assert abs(eval_loss - cp1_loss) <= 1e-5, (eval_loss, cp1_loss)
    return (f"train loss (cp 1, 2 ranks): {train_loss:.6f}\n"
            f"eval loss at cp 2: {eval_loss:.6f}; at cp 1: {cp1_loss:.6f}\n"
            f"rebound {len(rebinding.rebound)} attributes, e.g. {rebinding.rebound[0]}; restored: {not rebinding.active}")


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
