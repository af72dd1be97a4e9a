"""Dynamic CP in your own training loop: schedule one global batch of packed sequences of mixed
lengths over the DPxCP ranks (each sequence gets the CP size it needs), run it with the CP group
switched per micro-batch, take the optimizer step, and check the loss against each sequence run
alone at CP 1.

    python examples/dynamic_cp_in_your_loop.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/dynamic_cp_in_your_loop.py  # or let torchrun start them
"""

import os

import torch
import torch.distributed as dist

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.dynamic import build_group_registry, schedule
from cpkit.dynamic.cost import CostModel, ModelDims
from cpkit.dynamic.runtime import dynamic_cp_step
from cpkit.groups import build_pg_collection
from cpkit.layout import CPLayout
from cpkit.loss import forward_loss
from cpkit.mcore_cpu import install_mcore_cpu_shim

LENS = [44, 12, 10, 14, 8, 16, 6]  # one global batch: tokens per sequence
MAX_TOKENS_PER_RANK = 24  # the 44-token sequence needs CP 2, the others fit one rank
VOCAB, HEADS = 128, 4


def build_gpt(pgs):
    """Your GPT with cpkit's CP attention, built for the static layout (here dp=2, cp=1)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                               apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_block_spec_with_cp_attention(config), vocab_size=VOCAB,
                    max_sequence_length=2 * max(LENS), position_embedding_type="rope", pg_collection=pgs)


def get_sample(i: int) -> dict:
    """Sample i of the global batch, unpadded: tokens, labels (the next token), loss_mask, each [LENS[i]]."""
    seq = torch.randint(0, VOCAB, (LENS[i] + 1,), generator=torch.Generator().manual_seed(i))
    return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(LENS[i])}


def main() -> str:
    """One rank's part; torch.distributed is initialized (gloo). Returns rank 0's report."""
    install_mcore_cpu_shim()  # MCore calls CUDA in a few places; this lets it run on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    pgs = build_pg_collection(CPLayout(world_size=world, cp=1, num_attention_heads=HEADS))
    registry = build_group_registry([list(range(world))], rank)  # every aligned CP group, once
    model = build_gpt(pgs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # The scheduler times plans for your model's sizes (the default is a 4096-wide model).
    dims = ModelDims(hidden_size=64, num_heads=HEADS, num_kv_heads=HEADS, head_dim=16, num_layers=2)
    plan = schedule(LENS, dp_cp_size=world, max_seq_len_per_rank=MAX_TOKENS_PER_RANK, cost_model=CostModel(dims))

    # Reference before the step: each sequence alone at CP 1, positions 0..len-1.
    with torch.no_grad():
        reference = sum(forward_loss(model, {**{k: v.unsqueeze(0) for k, v in get_sample(i).items()},
                                             "position_ids": torch.arange(n).unsqueeze(0)},
                                     pgs, total_tokens=float(sum(LENS))).item() for i, n in enumerate(LENS))

    # One training step: every micro-batch on its own CP group, gradients summed over DPxCP.
    model.zero_grad(set_to_none=True)
    result = dynamic_cp_step(model, plan, registry, get_sample, pg_collection=pgs)
    optimizer.step()

    assert abs(result.loss - reference) <= 1e-5, (result.loss, reference)
    sizes = sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})
    return (f"plan: {len(plan.microbatches)} micro-batches, CP sizes {sizes}; "
            f"rank 0 ran CP sizes {list(result.cp_sizes)} (None: idle)\n"
            f"loss with dynamic CP: {result.loss:.6f}; each sequence alone at cp 1: {reference:.6f}")


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
