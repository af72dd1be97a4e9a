"""CP for a hybrid model in your own loop: attention layers in zigzag (cpkit's attention),
gated delta net layers in contiguous (chunkwise state passing), one relayout on each side of the
recurrent layers; train one step at CP N on N ranks and check it against CP 1: same loss, same
gradients. N is 2 or 4.

    python examples/hybrid_cp_in_your_loop.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 4 examples/hybrid_cp_in_your_loop.py  # on a GPU host: nccl, cuda:LOCAL_RANK

Rank 0 prints each rank's backend and device, what was checked, and the two losses.
"""

import os

import torch
import torch.distributed as dist

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # before megatron-core is imported: its "Transformer Engine and Apex are not installed" notices

from cpkit.devices import check_world_size, describe_rank_devices, init_rank
from cpkit.hybrid.model import HybridBatch, HybridLM
from cpkit.sharding import pad_cu_seqlens, thd_partition

LENS = [29, 7, 40, 12]  # a packed batch (THD); each sequence padded to a multiple of 2*cp
PATTERN, MODE = "AGA", "chunkwise"  # attention, gated delta net, attention
WORLD_SIZES = (2, 4)
# fp32 against CP 1: CP reorders the attention's LSE merge and the recurrent state's fold.
TOL = dict(loss=1e-5, rtol=1e-4, atol=2e-5)


def step(model, tokens, labels, mask, batch, count, group):
    """One forward and backward; loss and gradients summed over the CP ranks."""
    loss = model.loss_sum(tokens, labels, mask, batch) / count
    loss.backward()
    loss = loss.detach().clone()
    if group is not None:
        dist.all_reduce(loss, group=group)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> str:
    rd = init_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(world, WORLD_SIZES, "examples/hybrid_cp_in_your_loop.py")
    ranks = describe_rank_devices(rd)
    cu = pad_cu_seqlens(LENS, world).tolist()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (cu[-1],), generator=gen).to(rd.device)
    labels = torch.roll(tokens, -1)
    mask = torch.zeros(cu[-1], device=rd.device)
    for a, n in zip(cu, LENS):
        mask[a:a + n - 1] = 1.0  # real tokens that have a next token in their sequence
    count = mask.sum()

    # CP N: rank r holds chunks r and 2N-1-r of every sequence (zigzag); routes built once per batch.
    group = dist.new_group(list(range(world)))
    idx = thd_partition(torch.tensor(cu), rank, world).to(rd.device)
    model = HybridLM(pattern=PATTERN, linear_cp_mode=MODE, device=rd.device, seed=0)
    cp_loss, cp_grads = step(model, tokens[idx], labels[idx], mask[idx], HybridBatch.build(cu, group, rd.device),
                             count, group)

    # CP 1: the whole batch on every rank.
    ref = HybridLM(pattern=PATTERN, linear_cp_mode=MODE, device=rd.device, seed=0)
    ref_loss, ref_grads = step(ref, tokens, labels, mask, HybridBatch.build(cu, None, rd.device), count, None)

    assert abs(cp_loss - ref_loss) <= TOL["loss"] * abs(ref_loss), (
        f"loss at cp {world} {cp_loss:.6f} differs from cp 1 {ref_loss:.6f}")
    for name, grad in ref_grads.items():
        torch.testing.assert_close(cp_grads[name], grad, rtol=TOL["rtol"], atol=TOL["atol"],
                                   msg=lambda m, n=name: f"{n}: {m}")
    worst = max((cp_grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    return (f"ranks: {ranks}\n"
            f"checked: loss and {len(ref_grads)} gradients at cp {world} against cp 1, torch.float32, "
            f"loss within {TOL['loss']:g} relative, gradients rtol {TOL['rtol']:g} atol {TOL['atol']:g}\n"
            f"loss at cp {world} ({PATTERN}: attention in zigzag, GDN {MODE} in contiguous): {cp_loss:.6f}; "
            f"at cp 1: {ref_loss:.6f}; largest gradient difference {worst:.1e}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: nccl where each LOCAL_RANK has a GPU, else gloo
        report = main()
        if dist.get_rank() == 0:
            print(report)
        dist.destroy_process_group()
    else:  # spawn 2 gloo ranks on CPU; a rank that fails or hangs past the timeout stops them all
        from cpkit.harness.launch import launch

        print(launch(main, 2, timeout=300)[0])
