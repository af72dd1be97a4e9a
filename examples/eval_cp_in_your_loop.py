"""Eval-time CP in your own training loop: train one step at CP 1 on N ranks (data parallel),
evaluate a validation set with cpkit.eval_cp.loop.evaluate at every eval CP that N allows (2; 2 and
4 on 4 ranks; 2, 4 and 8 on 8), each inside eval_cp_context, which restores the training groups
after it, and check each eval loss against the same samples evaluated at CP 1. evaluate gives
each eval data-parallel replica its own share of the samples (eval_shard_for on the eval
collection), each rank of a replica its CP slice of every sequence, and sums the loss over the
eval dp x cp group. N is 2, 4 or 8.

    python examples/eval_cp_in_your_loop.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 8 examples/eval_cp_in_your_loop.py  # or 2 or 4; torchrun starts them
    torchrun --nproc-per-node 4 examples/eval_cp_in_your_loop.py  # on a GPU host: nccl, cuda:LOCAL_RANK

Under torchrun with a GPU for each LOCAL_RANK every rank runs NCCL on cuda:LOCAL_RANK and MCore
on CUDA; otherwise gloo on CPU (cpkit.devices.init_rank). Rank 0 prints each rank's backend and
device, which samples each eval replica took at each eval CP, what was checked, and the losses.
"""

import os

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.eval_cp.context import build_eval_pg_collection, eval_cp_context
from cpkit.eval_cp.loop import evaluate
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.loss import forward_loss, global_loss, reduce_gradients

SEQ, VOCAB, HEADS = 32, 128, 4
EVAL_CPS = (2, 4, 8)  # evaluated at each that divides N (eval dp = N / eval cp); SEQ splits into 2*cp chunks
NUM_VAL = 8  # validation samples: every eval replica gets NUM_VAL / eval dp of them
WORLD_SIZES = (2, 4, 8)
DTYPE = torch.float32  # on CPU and on GPU
# Tolerance per dtype against CP 1: CP only reorders the attention sums (LSE merge of partial
# blocks, on CPU exact math, on GPU PyTorch's fused fp32 SDPA kernels; TF32 off, torch's default)
# and evaluate adds the per-token losses in float64. A bf16 model would be held to an fp32 CP-1
# reference, not to itself at CP 1 (two bf16 runs can each be far from fp32).
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
    eval_cps = [cp for cp in EVAL_CPS if world % cp == 0]
    eval_pgs = {cp: build_eval_pg_collection(layout, cp, train_pgs=train_pgs) for cp in eval_cps}  # once, on every rank
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

    # Evaluate at each eval CP: evaluate takes this eval dp replica's samples (the eval
    # collection's dp, not the training dp), this rank's CP slice of each, and sums the loss
    # over eval dp x cp.
    val = make_batch(NUM_VAL, seed=1, device=rd.device)
    attention = model.decoder.layers[0].self_attention.core_attention
    train_cp_group = attention.cp_group
    results, taken = {}, {}
    for cp, pgs in eval_pgs.items():
        with eval_cp_context(model, pgs) as rebinding:
            assert rebinding.active and attention.cp_group is pgs.cp
            results[cp] = evaluate(model, val, pgs, micro_batch_size=1)
        # Restored, object for object: the training groups themselves, not copies of them.
        restored = not rebinding.active and attention.cp_group is train_cp_group and model.pg_collection is train_pgs
        assert restored, f"after the eval at cp {cp} the model does not hold the training groups again"
        mine, replicas = results[cp].samples, [None] * world
        dist.all_gather_object(replicas, (pgs.dp.rank(), f"{mine.start}-{mine.stop - 1}"))
        taken[cp] = "; ".join(f"replica {d}: {s}" for d, s in sorted(set(replicas)))

    # The reference, outside the blocks (the model is the training one again): every rank
    # evaluates the whole validation set alone at CP 1, with neither evaluate nor a collective.
    tokens = val["loss_mask"].sum().item()
    model.eval()
    with torch.no_grad():
        cp1_loss = forward_loss(model, val, train_pgs, total_tokens=tokens).item()
    model.train()

    tol = TOL[DTYPE]
    for cp, result in results.items():
        assert abs(result.loss - cp1_loss) <= tol["loss"], (
            f"eval loss at cp {cp} {result.loss:.6f} differs from cp 1 {cp1_loss:.6f} by "
            f"{abs(result.loss - cp1_loss):.1e} > {tol['loss']:g}")
        assert result.num_tokens == tokens, (
            f"eval at cp {cp} counted {result.num_tokens:g} tokens of the validation set's {tokens:g}: "
            "a sample evaluated twice or not at all")
    at = ", ".join(str(cp) for cp in results)
    return "\n".join([f"ranks: {ranks}", f"train loss (cp 1, {world} ranks): {train_loss:.6f}"]
                     + [f"eval at cp {cp} x dp {world // cp}: samples {taken[cp]} (of {NUM_VAL})" for cp in results]
                     + [f"checked: eval loss over the {NUM_VAL} samples (cpkit.eval_cp.loop.evaluate) at cp {at} against "
                        f"cp 1, {DTYPE}, within {tol['loss']:g}; each sample once; training groups restored after each",
                        "eval loss " + "; ".join(f"at cp {cp}: {r.loss:.6f}" for cp, r in results.items())
                        + f"; at cp 1: {cp1_loss:.6f}",
                        f"rebound {len(rebinding.rebound)} attributes, e.g. {rebinding.rebound[0]}; "
                        f"restored: {not rebinding.active}"])


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 2 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.harness.launch import launch

        print(launch(main, 2, timeout=300)[0])
