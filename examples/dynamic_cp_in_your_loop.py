"""Dynamic CP in your own training loop: schedule one global batch of packed sequences of mixed
lengths over the DPxCP ranks (each sequence gets the CP size it needs), run it with the CP group
switched per micro-batch, take the optimizer step, and check the loss and gradients against each
sequence run alone at CP 1. On 2 or 4 ranks.

    python examples/dynamic_cp_in_your_loop.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 2 examples/dynamic_cp_in_your_loop.py  # or 4; torchrun starts them
    torchrun --nproc-per-node 4 examples/dynamic_cp_in_your_loop.py  # on a GPU host: nccl, cuda:LOCAL_RANK

Under torchrun with a GPU for each LOCAL_RANK every rank runs NCCL on cuda:LOCAL_RANK and MCore
on CUDA; otherwise gloo on CPU (cpkit.devices.init_rank). Rank 0 prints each rank's backend and
device, the plan, what was checked, and the two losses.
"""

import os

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.attention.spec import get_gpt_block_spec_with_cp_attention
from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.dynamic import build_group_registry, schedule
from cpkit.dynamic.cost import CostModel, ModelDims
from cpkit.dynamic.runtime import dynamic_cp_step
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.loss import forward_loss

LENS = [44, 12, 10, 14, 8, 16, 6]  # one global batch: tokens per sequence
MAX_TOKENS_PER_RANK = 24  # the 44-token sequence needs CP 2, the others fit one rank
VOCAB, HEADS = 128, 4
WORLD_SIZES = (2, 4)  # the DPxCP ranks the scheduler spreads the batch over
DTYPE = torch.float32  # on CPU and on GPU
# Tolerance per dtype against each sequence alone at CP 1: CP and packing only reorder the
# attention sums (on CPU exact math, on GPU PyTorch's fused fp32 SDPA kernels; TF32 off).
TOL = {torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5)}


def build_gpt(pgs, device):
    """Your GPT with cpkit's CP attention, built for the static layout (here dp=N, cp=1);
    weights from torch.manual_seed(0) on CPU, then moved to `device`."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                               apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                               params_dtype=DTYPE)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_block_spec_with_cp_attention(config), vocab_size=VOCAB,
                     max_sequence_length=2 * max(LENS), position_embedding_type="rope", pg_collection=pgs)
    return model.to(device)


def get_sample(i: int) -> dict:
    """Sample i of the global batch, unpadded: tokens, labels (the next token), loss_mask, each [LENS[i]]
    (on CPU: dynamic_cp_step moves what a rank runs to the model's device)."""
    seq = torch.randint(0, VOCAB, (LENS[i] + 1,), generator=torch.Generator().manual_seed(i))
    return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(LENS[i])}


def main() -> str:
    """One rank's part (nccl on cuda:LOCAL_RANK under torchrun on a GPU host, else gloo on CPU).
    Returns rank 0's report."""
    rd = init_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(world, WORLD_SIZES, "examples/dynamic_cp_in_your_loop.py")
    ranks = describe_rank_devices(rd)
    pgs = build_pg_collection(CPLayout(world_size=world, cp=1, num_attention_heads=HEADS))
    registry = build_group_registry([list(range(world))], rank)  # every aligned CP group, once
    model = build_gpt(pgs, rd.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # The scheduler times plans for your model's sizes (the default is a 4096-wide model).
    dims = ModelDims(hidden_size=64, num_heads=HEADS, num_kv_heads=HEADS, head_dim=16, num_layers=2)
    plan = schedule(LENS, dp_cp_size=world, max_seq_len_per_rank=MAX_TOKENS_PER_RANK, cost_model=CostModel(dims))

    # Reference before the step, on every rank: each sequence alone at CP 1, positions 0..len-1.
    model.zero_grad(set_to_none=True)
    reference = 0.0
    for i, n in enumerate(LENS):
        sample = {k: v.unsqueeze(0).to(rd.device) for k, v in get_sample(i).items()}
        sample["position_ids"] = torch.arange(n, device=rd.device).unsqueeze(0)
        loss = forward_loss(model, sample, pgs, total_tokens=float(sum(LENS)))
        loss.backward()
        reference += loss.item()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # One training step: every micro-batch on its own CP group, gradients summed over DPxCP.
    model.zero_grad(set_to_none=True)
    result = dynamic_cp_step(model, plan, registry, get_sample, pg_collection=pgs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()

    tol = TOL[DTYPE]
    assert abs(result.loss - reference) <= tol["loss"], (
        f"loss with dynamic CP {result.loss:.6f} differs from each sequence alone at cp 1 {reference:.6f} "
        f"by more than {tol['loss']:g}")
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=tol["rtol"], atol=tol["atol"],
                                   msg=lambda m, n=name: f"{n}: {m}")
    worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    sizes = sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})
    return (f"ranks: {ranks}\n"
            f"plan: {len(plan.microbatches)} micro-batches, CP sizes {sizes}; "
            f"rank 0 ran CP sizes {list(result.cp_sizes)} (None: idle)\n"
            f"checked: loss and {len(ref_grads)} gradients of {len(LENS)} sequences over {world} ranks against "
            f"each sequence alone at cp 1, {DTYPE}, loss within {tol['loss']:g}, "
            f"gradients rtol {tol['rtol']:g} atol {tol['atol']:g}\n"
            f"loss with dynamic CP: {result.loss:.6f}; each sequence alone at cp 1: {reference:.6f}; "
            f"largest gradient difference {worst:.1e}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 2 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.harness.launch import launch

        print(launch(main, 2, timeout=300)[0])
