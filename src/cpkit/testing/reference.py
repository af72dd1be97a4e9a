"""Single-rank references inside a multi-rank test, and the inputs they share with the CP run."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpkit.compat import new_pg_collection

__all__ = ["attention_inputs", "per_sequence_reference", "sdpa_reference", "single_rank_pg_collection",
           "token_sample"]

_PG_FIELDS = ("tp", "pp", "mp", "cp", "dp", "tp_cp", "dp_cp", "tp_dp_cp", "embd", "pos_embd",
              "intra_dp_cp", "expt_dp", "intra_expt_dp", "expt_tp", "tp_ep", "tp_ep_pp", "ep")


def single_rank_pg_collection():
    """A ProcessGroupCollection in which every group is this rank alone (a cp=1, tp=1 reference).

    Collective over the default group: every rank creates every singleton group, in rank order.
    """
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            mine = group
    return new_pg_collection(**{name: mine for name in _PG_FIELDS})


def attention_inputs(lead: tuple, heads: int, kv_heads: int, head_dim: int, seed: int = 1234) -> list:
    """Full q, k, v and output gradient, float32 on CPU, the same on every rank for `seed`:
    q and dout [*lead, heads, head_dim], k and v [*lead, kv_heads, head_dim] (lead (s, b) for
    sbhd, (t,) for THD). Callers round them to the test dtype before use."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, heads, head_dim, generator=gen)
    k = torch.randn(*lead, kv_heads, head_dim, generator=gen)
    v = torch.randn(*lead, kv_heads, head_dim, generator=gen)
    dout = torch.randn(*lead, heads, head_dim, generator=gen)
    return [q, k, v, dout]


def sdpa_reference(q, k, v, causal: bool, cu=None):
    """Full (unsharded) attention through torch's scaled_dot_product_attention, in the inputs' dtype
    (unlike cpkit.attention.reference_attention, which is dense only and computes in fp32): sbhd
    q [s, b, h, d], k / v [s, b, h_kv, d] (GQA: k, v repeated to h heads), or THD [t, h, d] with one
    sequence per span of the cumulative offsets `cu` (each attended on its own). Returns q's layout."""
    rep = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)
    if cu is None:  # sbhd -> [b, h, s, d]
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal)
        return out.permute(2, 0, 1, 3)
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    return torch.cat(outs)


def token_sample(length: int, seed: int, vocab: int, device=None) -> dict:
    """One packed-sequence sample from `seed`: tokens, labels (the next token) and loss_mask, each [length]."""
    seq = torch.randint(0, vocab, (length + 1,), generator=torch.Generator().manual_seed(seed))
    return {"tokens": seq[:-1].to(device), "labels": seq[1:].to(device),
            "loss_mask": torch.ones(length, device=device)}


def per_sequence_reference(model, samples, pg_collection, *, total_tokens: float) -> float:
    """Forward and backward every sample (a `token_sample` dict) on its own as a batch of one, sbhd,
    loss normalized by `total_tokens`: returns the summed loss; the gradients accumulate in `model`.
    Talks over pg_collection's tp group only (as cpkit.loss.forward_loss); a single-rank one: none."""
    from cpkit.loss import forward_loss

    total = 0.0
    for s in samples:
        batch = {k: v.unsqueeze(0) for k, v in s.items()}
        batch["position_ids"] = torch.arange(s["tokens"].numel(), device=s["tokens"].device).unsqueeze(0)
        loss = forward_loss(model, batch, pg_collection, total_tokens=total_tokens)
        loss.backward()
        total += loss.item()
    return total
