"""One Triton kernel for the log-sum-exp merge on CUDA (`merge.merge_`'s opt-in fast path:
`CPAttentionOptions.fused_merge`, CPKIT_FUSED_MERGE=1; off by default, see `options.py`).

Why: the eager merge is four passes over the output (`out.float()`, `mul_`, `addcmul_`, and the
rounding back for a 16-bit output), each a full read and write of the [s, b, h, d] output. A
4x H100 profile of p2p at cp 4 put those elementwise kernels at 5.7-8.3 ms per step at 128K
against TE's 2.6-2.8 ms (TE fuses its merge with torch.compile). This kernel reads the running
output and the block's output once and writes the result once, in fp32 arithmetic, rounding
once to the output's dtype. It is the same math as the eager merge: l = logaddexp(l, l_b),
out = w_old * out + w_new * o_b, with a row that has seen no key in either part (both LSEs
-inf) left as it is.

Layouts as in `merge.py`: out / block_out [s, b, h, d] (or [t, h, d]), the LSEs [b, h, s] (or
[h, t]); any strides with a contiguous head dim, so a view (the second query chunk of a ring
block) merges in place. Triton is imported on first use: `available()` says whether it can run.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "supports", "fused_merge_"]


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(out_ptr, lse_ptr, blk_ptr, blse_ptr, rows, heads, batch,
                     o_s, o_b, o_h, b_s, b_b, b_h, l_s, l_b, l_h, m_s, m_b, m_h,
                     DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        live = r < rows
        h = r % heads
        b = (r // heads) % batch
        s = r // (heads * batch)
        lse_at = s * l_s + b * l_b + h * l_h
        old = tl.load(lse_ptr + lse_at, mask=live, other=float("-inf"))
        new = tl.load(blse_ptr + s * m_s + b * m_b + h * m_h, mask=live, other=float("-inf"))
        top = tl.maximum(old, new)
        top = tl.where(top == float("-inf"), 0.0, top)  # no key on either side: keep the row
        e_old = tl.exp(old - top)
        e_new = tl.exp(new - top)
        total = e_old + e_new
        seen = total > 0
        w_old = tl.where(seen, e_old / total, 1.0)
        w_new = tl.where(seen, e_new / total, 0.0)
        tl.store(lse_ptr + lse_at, tl.where(seen, top + tl.log(total), float("-inf")), mask=live)
        d = tl.arange(0, BLOCK_D)
        cols = live[:, None] & (d < DIM)[None, :]
        o_at = (s * o_s + b * o_b + h * o_h)[:, None] + d[None, :]
        b_at = (s * b_s + b * b_b + h * b_h)[:, None] + d[None, :]
        o = tl.load(out_ptr + o_at, mask=cols, other=0.0).to(tl.float32)
        blk = tl.load(blk_ptr + b_at, mask=cols, other=0.0).to(tl.float32)
        merged = o * w_old[:, None] + blk * w_new[:, None]
        tl.store(out_ptr + o_at, merged.to(out_ptr.dtype.element_ty), mask=cols)

    return triton, merge_kernel


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when Triton imports (it ships with CUDA builds of torch)."""
    try:
        _kernel()
    except Exception:  # noqa: BLE001 - ImportError, or a Triton that cannot build for this host
        return False
    return True


def _sbh(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of an output's (s, b, h) dims; THD [t, h, d] has no batch dim (stride 0)."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (t.stride(0), 0, t.stride(1))


def _lse_sbh(lse: torch.Tensor) -> tuple[int, int, int]:
    """Strides of an LSE's (s, b, h) dims: [b, h, s] or [h, t]."""
    return (lse.stride(2), lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (lse.stride(1), 0, lse.stride(0))


def supports(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CUDA, one shape, a contiguous head dim, float32
    LSEs, and Triton importable."""
    return (
        out.is_cuda and out.shape == block_out.shape and out.dim() in (3, 4)
        and lse.shape == block_lse.shape and lse.dim() == out.dim() - 1
        and lse.dtype == torch.float32 and block_lse.dtype == torch.float32
        and out.stride(-1) == 1 and block_out.stride(-1) == 1
        and out.numel() > 0 and available()
    )


def fused_merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """`merge.merge_` in one kernel (the caller checked `supports`)."""
    triton, kernel = _kernel()
    if out.dim() == 4:
        seq, batch, heads, dim = out.shape
    else:
        (seq, heads, dim), batch = out.shape, 1
    rows = seq * batch * heads
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, 4096 // block_d)  # ~4K elements a program: 32 rows of 128
    kernel[(triton.cdiv(rows, block_r),)](
        out, lse, block_out, block_lse, rows, heads, batch,
        *_sbh(out), *_sbh(block_out), *_lse_sbh(lse), *_lse_sbh(block_lse),
        DIM=dim, BLOCK_D=block_d, BLOCK_R=block_r,
    )
