"""Adapters for torch's own attention kernels (the ATen ops behind scaled_dot_product_attention),
in the kernels' call shape (cpkit.attention.kernels, which chooses among them):

- `cpu`: torch's CPU flash kernel (exact softmax, native GQA).
- `cudnn`: `_scaled_dot_product_cudnn_attention`; un-expanded GQA KV only where
  `cudnn_native_gqa` shows, once per device and dtype, that it gives the expanded result.
- `flash`: `_flash_attention_forward` (native GQA), dense and varlen (cu_seqlens).
- `efficient`: `_efficient_attention_forward` (KV expanded for GQA; LSE padded to 32 queries).

Each takes and returns sequence-first tensors (dense [s, b, h, d], varlen [t, h, d]) and a
float32 LSE ([b, h, s] / [h, t]), one head dim for q, k and v; dropout is never used.
"""

from __future__ import annotations

import functools

import torch

from cpkit.attention.views import bhsd, bshd, expand_kv, from_bhsd, reduce_kv

__all__ = [
    "cpu_bwd", "cpu_fwd", "cudnn_bwd", "cudnn_fwd", "cudnn_native_gqa", "efficient_bwd",
    "efficient_fwd", "flash_bwd", "flash_fwd", "flash_varlen_bwd", "flash_varlen_fwd",
]

_aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _dummy_rng(device: torch.device) -> torch.Tensor:
    # Philox seed/offset are read only with dropout > 0; the ops still want tensors.
    return torch.zeros((), dtype=torch.int64, device=device)


def cpu_fwd(q, k, v, causal, scale):
    """torch's CPU flash forward: (out, float32 LSE [b, h, s])."""
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        bhsd(q), bhsd(k), bhsd(v), 0.0, causal, attn_mask=None, scale=scale
    )
    return from_bhsd(out), lse.float()


def cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    """torch's CPU flash backward: (dq, dk, dv)."""
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.contiguous(), 0.0, causal,
        attn_mask=None, scale=scale,
    )
    return from_bhsd(dq), from_bhsd(dk), from_bhsd(dv)


def flash_fwd(q, k, v, causal, scale):
    """Flash forward (CUDA, 16-bit, native GQA): (out, LSE [b, h, s])."""
    res = _aten._flash_attention_forward(
        bshd(q), bshd(k), bshd(v), None, None, q.shape[0], k.shape[0], 0.0, causal, False,
        scale=scale,
    )
    return bshd(res[0]), res[1]


def flash_bwd(dout, q, k, v, out, lse, causal, scale):
    """Flash backward: (dq, dk, dv)."""
    rng = _dummy_rng(q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        bshd(dout), bshd(q), bshd(k), bshd(v), bshd(out), lse.contiguous(), None, None,
        q.shape[0], k.shape[0], 0.0, causal, rng, rng, scale=scale,
    )
    return bshd(dq), bshd(dk), bshd(dv)


def cudnn_fwd(q, k, v, causal, scale, native_gqa=None):
    """cuDNN forward (CUDA, 16-bit): (out, LSE [b, h, s]); KV expanded for GQA unless
    `native_gqa` (default: cudnn_native_gqa of this device and dtype)."""
    if native_gqa is None:
        native_gqa = cudnn_native_gqa(q.device, q.dtype)
    if not native_gqa:
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    res = _aten._scaled_dot_product_cudnn_attention(
        bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, causal, False, scale=scale
    )
    s, b, h, _ = q.shape
    return from_bhsd(res[0]), res[1].reshape(b, h, s)


def cudnn_bwd(dout, q, k, v, out, lse, causal, scale, native_gqa=None):
    """cuDNN backward: (dq, dk, dv); GQA as in cudnn_fwd, grads summed back onto the KV heads."""
    if native_gqa is None:
        native_gqa = cudnn_native_gqa(q.device, q.dtype)
    kv_heads = k.shape[2]
    if not native_gqa:
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    rng = _dummy_rng(q.device)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.contiguous().unsqueeze(-1),
        rng, rng, None, None, None, q.shape[0], k.shape[0], 0.0, causal, scale=scale,
    )
    return from_bhsd(dq), reduce_kv(from_bhsd(dk), kv_heads), reduce_kv(from_bhsd(dv), kv_heads)


_EFFICIENT_MAX_DIM = 128


def _efficient_head_dim(q):
    # Refused above 128: its backward's dq was wrong at 192 (MLA 192/128 zero-padded; 17-55% of
    # dq off on H100, torch 2.11), found by functional/test_kernel_conformance.py.
    if q.shape[-1] > _EFFICIENT_MAX_DIM:
        raise NotImplementedError(f"cpkit attention: kernel 'efficient' takes head dims up to {_EFFICIENT_MAX_DIM}, "
                                  f"got {q.shape[-1]}; use 'flash', 'cudnn' or 'cudnn_fe' (or let cpkit choose)")


def efficient_fwd(q, k, v, causal, scale):
    """Memory-efficient forward (CUDA, any float dtype, head dims up to 128; KV expanded for GQA):
    (out, LSE [b, h, s])."""
    _efficient_head_dim(q)
    k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    res = _aten._efficient_attention_forward(
        bshd(q), bshd(k), bshd(v), None, None, None, None, None, 0.0, 1 if causal else 0, True,
        scale=scale,
    )
    # The LSE comes padded to a multiple of 32 queries.
    return bshd(res[0]), res[1][..., : q.shape[0]]


def efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    """Memory-efficient backward: (dq, dk, dv), grads summed back onto the KV heads."""
    _efficient_head_dim(q)
    kv_heads = k.shape[2]
    k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    s = q.shape[0]
    lse_padded = lse.new_zeros((*lse.shape[:-1], (s + 31) // 32 * 32))
    lse_padded[..., :s] = lse
    rng = _dummy_rng(q.device)
    dq, dk, dv, _ = _aten._efficient_attention_backward(
        bshd(dout), bshd(q), bshd(k), bshd(v), None, bshd(out), None, None, s, k.shape[0],
        lse_padded, 0.0, rng, rng, 1 if causal else 0, False, scale=scale,
    )
    return bshd(dq), reduce_kv(bshd(dk), kv_heads), reduce_kv(bshd(dv), kv_heads)


@functools.lru_cache(maxsize=None)
def cudnn_native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN attention gives, for un-expanded GQA KV, what it gives for expanded KV
    (forward and backward). Probed once per device and dtype on a small shape."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q, do = (torch.randn(128, 1, 4, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
        k, v = (torch.randn(128, 1, 2, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
        native = cudnn_fwd(q, k, v, True, 0.125, native_gqa=True)
        expanded = cudnn_fwd(q, k, v, True, 0.125, native_gqa=False)
        grads_n = cudnn_bwd(do, q, k, v, native[0], native[1], True, 0.125, native_gqa=True)
        grads_e = cudnn_bwd(do, q, k, v, expanded[0], expanded[1], True, 0.125, native_gqa=False)
        pairs = list(zip(native, expanded)) + list(zip(grads_n, grads_e))
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                   for a, b in pairs)
    except (RuntimeError, NotImplementedError):
        return False


def flash_varlen_fwd(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k):
    """Flash varlen forward: q [t, h, d], k/v [t_k, h_kv, d], cu_seqlens int32: (out, LSE [h, t])."""
    res = _aten._flash_attention_forward(
        q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, 0.0, causal, False,
        scale=scale,
    )
    return res[0], res[1]


def flash_varlen_bwd(dout, q, k, v, out, lse, causal, scale, cu_q, cu_k, max_q, max_k):
    """Flash varlen backward: (dq, dk, dv)."""
    rng = _dummy_rng(q.device)
    return _aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cu_q.to(torch.int32), cu_k.to(torch.int32), max_q,
        max_k, 0.0, causal, rng, rng, scale=scale,
    )
