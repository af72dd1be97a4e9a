"""A small hybrid model (attention in zigzag, gated delta net and Mamba-2 in contiguous, src/cpkit/hybrid/model.py)
trains at cp 2 and 4 like cp 1: the loss of each of 3 SGD steps and, after the first, every
parameter's gradient (gloo; NCCL on GPUs).

fp32 throughout. Tolerances: the loss 1e-5 relative; gradients atol 2e-5, rtol 1e-4 (CP changes
the order of the merge and of the state fold, fp32 rounding on sums over some 100 tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import device, launch

LENS = [13, 5, 0, 21]
PATTERNS = [("AGMA", "chunkwise"), ("MAG", "headwise")]  # G gated delta net, M Mamba-2


def _batch(cp: int):
    from cpkit.sharding import pad_cu_seqlens

    cu = pad_cu_seqlens(LENS, cp).tolist()
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (cu[-1],), generator=gen)
    labels = torch.roll(tokens, -1)
    mask = torch.zeros(cu[-1])
    for (a, _), n in zip(zip(cu, cu[1:]), LENS):
        mask[a:a + max(n - 1, 0)] = 1.0  # real tokens with a next token in their sequence
    return cu, tokens, labels, mask


def _train(pattern: str, mode: str, steps: int = 3) -> dict:
    from cpkit.hybrid.model import HybridBatch, HybridLM
    from cpkit.sharding import thd_partition

    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    cu, tokens, labels, mask = (t if isinstance(t, list) else t.to(device()) for t in _batch(cp))
    count = mask.sum()
    results = {}
    for name, grp in (("cp1", None), ("cp", group)):
        model = HybridLM(pattern=pattern, linear_cp_mode=mode, device=device(), seed=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        idx = thd_partition(torch.tensor(cu), rank, cp).to(device()) if grp is not None else torch.arange(cu[-1], device=device())
        batch = HybridBatch.build(cu, grp, device())
        losses, grads = [], None
        for step in range(steps):
            opt.zero_grad()
            loss = model.loss_sum(tokens[idx], labels[idx], mask[idx], batch) / count
            loss.backward()
            if grp is not None:
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=grp)
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=grp)
            losses.append(float(loss))
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
        results[name] = (losses, grads)
    (l1, g1), (lc, gc) = results["cp1"], results["cp"]
    bad = [n for n in g1 if not torch.allclose(gc[n], g1[n], atol=2e-5, rtol=1e-4)]
    return {"losses": (l1, lc), "grad_mismatch": bad,
            "loss_ok": all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(l1, lc))}


@pytest.mark.parametrize("pattern,mode", PATTERNS, ids=[f"{p}-{m}" for p, m in PATTERNS])
@pytest.mark.parametrize("backend,world_size", [pytest.param("gloo", n, marks=pytest.mark.dist, id=f"gloo{n}")
                                                for n in (2, 4)])
def test_hybrid_model_trains_at_cp_like_cp1(backend, world_size, pattern, mode):
    results = launch(_train, world_size, backend=backend, timeout=300, args=(pattern, mode))
    for rank, result in enumerate(results):
        assert result["loss_ok"] and result["grad_mismatch"] == [], (rank, result)


def _every_pattern() -> dict:
    return {f"{p}-{m}": _train(p, m) for p, m in PATTERNS}


@pytest.mark.parametrize("world_size", [pytest.param(n, marks=getattr(pytest.mark, f"gpu{n}"), id=f"nccl{n}")
                                        for n in (2, 4)])
def test_hybrid_model_trains_at_cp_like_cp1_on_nccl(world_size):
    """Both patterns on NCCL in one launch."""
    for rank, result in enumerate(launch(_every_pattern, world_size, backend="nccl", timeout=300)):
        assert all(r["loss_ok"] and r["grad_mismatch"] == [] for r in result.values()), (rank, result)
