"""Single-rank references inside a multi-rank test, and the inputs they share with the CP run."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpkit.compat import new_pg_collection

__all__ = ["attention_inputs", "masked_block_reference", "masked_sink_reference", "per_sequence_reference", "reference_shard",
           "sdpa_reference", "single_rank_pg_collection", "token_sample"]

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


def reference_shard(x: torch.Tensor, cp_rank: int, cp_size: int, cu=None, seq_dim: int = 0) -> torch.Tensor:
    """Rank `cp_rank`'s tokens of a full reference tensor, spelled out without cpkit.sharding (a
    reference must not share the code under test): each sequence (all of `x` along `seq_dim`,
    or each span of the THD offsets `cu`) cut into 2*cp_size equal chunks, chunk r then chunk
    2*cp_size-1-r, sequence after sequence. Raises ValueError for a length not divisible by 2*cp."""
    total = x.shape[seq_dim]
    spans = [(0, total)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    parts = []
    for start, end in spans:
        if (end - start) % (2 * cp_size):
            raise ValueError(f"reference_shard: sequence [{start}, {end}) is not divisible by 2*cp = {2 * cp_size}")
        chunks = x.narrow(seq_dim, start, end - start).chunk(2 * cp_size, dim=seq_dim) if end > start else ()
        parts += [chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]] if chunks else []
    return torch.cat(parts, dim=seq_dim) if parts else x.narrow(seq_dim, 0, 0)


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


def masked_sink_reference(q, k, v, *, causal: bool, scale: float, window=None, sink=None, cu=None):
    """Plain float32 attention through autograd with every feature spelled out, for checking CP
    attention: q [s, b, h, dqk] (or THD [t, h, dqk] with global offsets `cu`), k [.., h_kv, dqk],
    v [.., h_kv, dv] (MLA when dv != dqk); `window` (left, right), -1 unbounded; `sink` [h]:
    an extra logit per head in each row's softmax, its probability dropped (MCore's off-by-one /
    learnable softmax). Materializes the scores; returns the output [.., h, dv] in float32."""
    thd = q.dim() == 3
    if thd:
        q, k, v = (x.unsqueeze(1) for x in (q, k, v))
    s, h = q.shape[0], q.shape[2]
    group = h // k.shape[2]
    k, v = (x.float().repeat_interleave(group, dim=2) for x in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q.float(), k) * scale
    pos = torch.arange(s, device=q.device)
    diff = pos.view(-1, 1) - pos.view(1, -1)
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= diff >= 0
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= diff <= left
        if right >= 0 and not causal:
            allowed &= diff >= -right
    if cu is not None:
        seq_id = torch.searchsorted(cu.to(q.device, torch.int64), pos, right=True)
        allowed &= seq_id.view(-1, 1) == seq_id.view(1, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        column = sink.float().view(1, h, 1, 1).expand(scores.shape[0], h, s, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.squeeze(1) if thd else out


def masked_block_reference(q, k, v, dout, sink, allowed, *, scale: float):
    """One attention block in exact float32 for checking kernels: [b, h, s, d] tensors (kv heads
    expanded here) under the boolean `allowed` [s_q, s_k] (written by the caller from positions
    and sequence ids), `sink` [h] an extra logit per head without a value (or None); returns
    (out, lse, dq, dk, dv, dsink or None) through autograd. Rows that see nothing: zero output,
    LSE -inf, no NaN in the backward."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    sink = None if sink is None else sink.detach().float().requires_grad_()
    g = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale).masked_fill(~allowed.to(q.device), float("-inf"))
    logits = scores if sink is None else torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    lse = torch.logsumexp(logits, -1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.exp(scores - finite.unsqueeze(-1)) @ v.repeat_interleave(g, 1)
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    grads = torch.autograd.grad(out, inputs, dout.float())
    return (out.detach(), lse.detach(), *grads[:3], grads[3] if sink is not None else None)
