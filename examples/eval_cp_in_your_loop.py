"""Eval-time CP in your own training loop: train one step at CP 1 on N ranks (data parallel),
evaluate a validation set at CP 2 (each eval data-parallel replica, a pair of ranks, takes its
own share of the samples, as a validation sampler sized by the eval DP would, and each rank of the
pair holds half of every sequence), check that the training groups are back, and compare the
global eval loss with the same samples evaluated at CP 1. N is 2, 4 or 8.

    python examples/eval_cp_in_your_loop.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 8 examples/eval_cp_in_your_loop.py  # or 2 or 4; torchrun starts them
    torchrun --nproc-per-node 4 examples/eval_cp_in_your_loop.py  # on a GPU host: nccl, cuda:LOCAL_RANK

Under torchrun with a GPU for each LOCAL_RANK every rank runs NCCL on cuda:LOCAL_RANK and MCore
on CUDA; otherwise gloo on CPU (cpkit.devices.init_rank). Rank 0 prints each rank's backend and
device, which samples each eval replica took, what was checked, and the losses.
"""

import os

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.eval_cp import build_eval_pg_collection, eval_cp_context, eval_shard_for
from cpkit.groups import build_pg_collection
from cpkit.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients
from cpkit.sharding import shard_batch

SEQ, VOCAB, HEADS = 32, 128, 4
EVAL_CP = 2
NUM_VAL = 8  # validation samples: every eval replica gets NUM_VAL / eval dp of them
WORLD_SIZES = (2, 4, 8)  # eval dp = N / EVAL_CP replicas
DTYPE = torch.float32  # on CPU and on GPU
# Tolerance per dtype against CP 1: CP only reorders the attention sums (LSE merge of partial
# blocks, on CPU exact math, on GPU PyTorch's fused fp32 SDPA kernels; TF32 off, torch's default).
TOL = {torch.float32: dict(loss=1e-5)}


def build_gpt(pgs, device):
    """Your GPT: MCore's GPTModel with cpkit's CP attention, built at the training layout;
    weights from torch.manual_seed(0) on CPU, then moved to `device`."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                               apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                               params_dtype=DTYPE)
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


def main() -> str:
    """One rank's part (nccl on cuda:LOCAL_RANK under torchrun on a GPU host, else gloo on CPU).
    Returns rank 0's report."""
    rd = init_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(world, WORLD_SIZES, "examples/eval_cp_in_your_loop.py")
    ranks = describe_rank_devices(rd)
    layout = CPLayout(world_size=world, cp=1, seq_length=SEQ, num_attention_heads=HEADS)
    train_pgs = build_pg_collection(layout)
    eval_pgs = build_eval_pg_collection(layout, EVAL_CP, train_pgs=train_pgs)  # once, on every rank
    model = build_gpt(train_pgs, rd.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # Train one step at CP 1: one sequence per rank. The loss comes from the logits
    # (forward_loss): model(..., labels=...) needs MCore's global groups, which this path has not.
    train = make_batch(world, seed=0, device=rd.device)
    local = {k: v[rank:rank + 1] for k, v in train.items()}
    loss = forward_loss(model, local, train_pgs, total_tokens=train["loss_mask"].sum().item())
    loss.backward()
    reduce_gradients(model, train_pgs)  # sum over dp x cp, as MCore's DDP would
    optimizer.step()
    optimizer.zero_grad()
    train_loss = global_loss(loss, train_pgs)

    # Evaluate at CP 2, then at CP 1 (outside the block the model is the training one again).
    val = make_batch(NUM_VAL, seed=1, device=rd.device)
    tokens = val["loss_mask"].sum().item()  # over the whole validation set: the shares sum to the mean
    attention = model.decoder.layers[0].self_attention.core_attention
    train_cp_group = attention.cp_group
    model.eval()
    with torch.no_grad():
        with eval_cp_context(model, eval_pgs) as rebinding:
            assert rebinding.active and attention.cp_group is eval_pgs.cp
            # The validation sampler: this eval dp replica's own samples (eval_pgs.dp, not the
            # training dp), then this rank's half of each of them.
            mine = eval_shard_for(NUM_VAL, eval_pgs)
            shard = shard_batch({k: v[mine.start:mine.stop] for k, v in val.items()}, eval_pgs.cp)
            eval_loss = global_loss(forward_loss(model, shard, eval_pgs, total_tokens=tokens), eval_pgs)
        assert not rebinding.active and attention.cp_group is train_cp_group  # restored, object for object
        cp1_loss = forward_loss(model, val, train_pgs, total_tokens=tokens).item()  # each rank: all of it, alone
    model.train()
    replicas = [None] * world
    dist.all_gather_object(replicas, (eval_pgs.dp.rank(), f"{mine.start}-{mine.stop - 1}"))

    tol = TOL[DTYPE]
    assert abs(eval_loss - cp1_loss) <= tol["loss"], (eval_loss, cp1_loss)
    taken = "; ".join(f"replica {d}: {s}" for d, s in sorted(set(replicas)))
    return (f"ranks: {ranks}\n"
            f"train loss (cp 1, {world} ranks): {train_loss:.6f}\n"
            f"eval at cp {EVAL_CP} x dp {world // EVAL_CP}: samples {taken} (of {NUM_VAL})\n"
            f"checked: eval loss over the {NUM_VAL} samples at cp {EVAL_CP} against cp 1, {DTYPE}, "
            f"within {tol['loss']:g}; training groups restored\n"
            f"eval loss at cp {EVAL_CP}: {eval_loss:.6f}; at cp 1: {cp1_loss:.6f}\n"
            f"rebound {len(rebinding.rebound)} attributes, e.g. {rebinding.rebound[0]}; restored: {not rebinding.active}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 2 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.launch import launch

        print(launch(main, 2, timeout=300)[0])
