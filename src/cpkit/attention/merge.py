"""Online log-sum-exp merge of partial attention results, in fp32.

Attention of the same queries over disjoint key blocks gives partial outputs o_i and
log-sum-exps l_i; the attention over the union of the blocks is
    l = log(sum_i exp(l_i)),   o = sum_i exp(l_i - l) * o_i.
Layouts: outputs are sequence-first, [s, b, heads, dim] (sbhd) or [t, heads, dim] (THD); the
LSE is [b, heads, s] or [heads, t] (what the kernels return), always float32.
"""

from __future__ import annotations

import torch

__all__ = ["lse_as_out", "merge_", "merge"]


def lse_as_out(lse: torch.Tensor) -> torch.Tensor:
    """View an LSE ([b, h, s] or [h, t]) so that it broadcasts against its output
    ([s, b, h, d] or [t, h, d]): [s, b, h, 1] or [t, h, 1]. No copy."""
    return lse.movedim(-1, 0).unsqueeze(-1)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one partial result into the running one, in place.

    out: the running output (may be a view), float32 or a lower precision; lse: float32 running
    LSE (may be a view); block_out: the new partial output in any float dtype, block_lse: its
    float32 LSE. A lower-precision `out` is merged in fp32 and rounded once on the way back, so
    a single merge (a ring of 2) needs no fp32 copy of the output. Rows where both LSEs are -inf
    (no key seen yet) keep their running output (the kernels' zeros) instead of becoming NaN.
    """
    # exp(l_block - logaddexp(l, l_block)) is sigmoid(l_block - l): one kernel fewer per weight
    # (this merge runs in every ring step and, with short blocks, its launches are what costs).
    # Rows with no keys in either part have l = l_block = -inf: NaN, so w_new 0 and w_old 1.
    w_new = torch.sigmoid_(lse_as_out(block_lse) - lse_as_out(lse)).nan_to_num_(nan=0.0)
    w_old = 1.0 - w_new
    torch.logaddexp(lse, block_lse, out=lse)
    if out.dtype == torch.float32:
        out.mul_(w_old).addcmul_(block_out, w_new)
    else:
        out.copy_((out * w_old).addcmul_(block_out, w_new))


def merge(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a list of partial (output, LSE) pairs; returns (float32 output, float32 LSE)."""
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge: need matching non-empty lists, got {len(outs)} outputs, {len(lses)} LSEs")
    out = outs[0].float().clone()
    lse = lses[0].float().clone()
    for o, l in zip(outs[1:], lses[1:]):
        merge_(out, lse, o, l.float())
    return out, lse
