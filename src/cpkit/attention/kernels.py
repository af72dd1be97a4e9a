"""Single-device attention kernels that return the log-sum-exp, behind one small interface.

    attn_fwd(q, k, v, causal, scale, **varlen, sink=None) -> (out, lse)
    attn_bwd(dout, q, k, v, out, lse, causal, scale, **varlen) -> (dq, dk, dv)

Layouts are sequence-first, like MCore's: dense q [s, b, h, d], k [s_k, b, h_kv, d], v
[s_k, b, h_kv, d_v]; varlen (THD) q [t, h, d], k/v [t_k, h_kv, d / d_v] with `cu_seqlens_q/k`
(int32, [n + 1]) and `max_seqlen_q/k`. v may have its own head dim (MLA): the cuDNN frontend
and `math` take it as it is; the other kernels get zero-padded copies (exact) and the results
are cut back. `out` has q's shape with v's head dim and q's dtype; `lse` is float32, [b, h, s] dense or [h, t]
varlen (natural log of the softmax denominator of the scaled scores). `attn_bwd` takes the
FINAL output and LSE of the whole (merged) attention, so it can recompute one block's share of
the gradients; it returns grads in the dtypes of q, k, v. GQA: h % h_kv == 0, query head i uses
kv head i // (h / h_kv).

`causal` is the top-left (= bottom-right) causal mask of a square block: dense callers pass
s == s_k, varlen callers sequences of equal q and k lengths. Callers split anything else into
an unmasked part and a square causal part, so no kernel's corner convention matters.

`sink` [h] (attn_fwd only, for a block that is the whole attention): per-head sink logits in
the softmax denominator (`sink.py`); the cuDNN frontend folds them into its kernel, other kernels
get them applied to their output and LSE. The backward needs no sink: the final LSE holds it.

Kernels (no O(s^2) tensor except `math`):
- CPU: `cpu` = torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
  backward; exact softmax, native GQA); `math` = plain PyTorch, a reference.
- CUDA dense: `cudnn` (`_scaled_dot_product_cudnn_attention`; fastest on H100/H200), then
  `flash` (`_flash_attention_forward`, native GQA), then `efficient`
  (`_efficient_attention_forward`), tried in that order; a kernel that raises for a shape/dtype
  is skipped for that shape/dtype from then on (with one warning). fp32 starts at `efficient`.
  cuDNN gets un-expanded GQA KV only if a one-off probe shows it gives the expanded result.
- `cudnn_fe`: the cuDNN frontend's SDPA torch ops (`cudnn_fe.py`; `nvidia-cudnn-frontend`, the
  optional extra `cpkit[kernels]`): dense and THD, sinks, MLA head dims, backward from the
  final output and LSE. The default rule on CUDA in 16 bits, where it imports: dense blocks of
  one head dim try torch's `cudnn` first (the same engine, no extra dependency), then
  `cudnn_fe`; MLA blocks (d_v != d), THD blocks and sinks go to `cudnn_fe` first. Without the
  library: one warning, then the kernels above.
- CUDA varlen: `cudnn_fe` varlen, then `flash` varlen (cu_seqlens); otherwise a loop over
  sequences of the dense kernels.
- `kernel="cudnn"|"cudnn_fe"|"flash"|"efficient"|"math"` (`CPAttentionOptions.kernel`, default
  from CPKIT_ATTN_KERNEL) forces one CUDA kernel (no fallback; a missing cuDNN frontend warns
  once and lets cpkit choose), for benchmarking; on CPU only `math` is honoured.

Memory: sbhd <-> bshd/bhsd conversions are views (transpose/permute); flash's and efficient's
backward make dout/out contiguous internally (one copy each), GQA expansion for efficient (and
for cuDNN when not native) materializes [s, b, h, d] K/V per call.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Optional

import torch

from cpkit.attention import cudnn_fe
from cpkit.attention.options import CUDA_KERNELS, KERNEL_ENV
from cpkit.attention.sink import apply_sink

__all__ = [
    "KERNEL_ENV",
    "CUDA_KERNELS",
    "attn_fwd",
    "attn_bwd",
    "kernel_candidates",
    "reference_attention",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FAILED: set = set()  # (kernel, shape/dtype key) pairs that raised: not tried again
_aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# helpers


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat kv heads (dim -2) so that query head i sees kv head i // group."""
    group = heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the grads of expanded kv heads back onto the kv heads (dim -2)."""
    group = dx.shape[-2] // kv_heads
    return dx if group == 1 else dx.unflatten(-2, (kv_heads, group)).sum(-2)


@functools.lru_cache(maxsize=None)
def _dummy_rng(device: torch.device) -> torch.Tensor:
    # Philox seed/offset are read only with dropout > 0; the ops still want tensors.
    return torch.zeros((), dtype=torch.int64, device=device)


def _bshd(x):  # [s, b, h, d] -> [b, s, h, d] view
    return x.transpose(0, 1)


def _bhsd(x):  # [s, b, h, d] -> [b, h, s, d] view
    return x.permute(1, 2, 0, 3)


def _from_bhsd(x):  # [b, h, s, d] -> [s, b, h, d] view
    return x.permute(2, 0, 1, 3)


# ---------------------------------------------------------------------------------------------
# dense kernels: q [s, b, h, d], k/v [s_k, b, h_kv, d]


def _math_scores(q, k, causal, scale):
    s, b, h, d = q.shape
    kv_heads = k.shape[2]
    qf = _bhsd(q.float()).reshape(b, kv_heads, h // kv_heads, s, d)
    kf = _bhsd(k.float()).unsqueeze(2)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [b, hkv, g, s, s_k]
    if causal:
        mask = torch.ones(s, k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return qf, kf, scores


def _math_fwd(q, k, v, causal, scale):
    s, b, h, d = q.shape
    _, _, scores = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(p, _bhsd(v.float()).unsqueeze(2))  # [b, hkv, g, s, d]
    return _from_bhsd(out.reshape(b, h, s, -1)).to(q.dtype), lse.reshape(b, h, s)


def _math_bwd(dout, q, k, v, out, lse, causal, scale):
    s, b, h, d = q.shape
    kv_heads = k.shape[2]
    qf, kf, scores = _math_scores(q, k, causal, scale)
    g = h // kv_heads
    p = torch.exp(scores - lse.reshape(b, kv_heads, g, s).unsqueeze(-1))
    do = _bhsd(dout.float()).reshape(b, kv_heads, g, s, -1)
    of = _bhsd(out.float()).reshape(b, kv_heads, g, s, -1)
    vf = _bhsd(v.float()).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # [b, hkv, s_k, d]
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * of).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
    return (
        _from_bhsd(dq.reshape(b, h, s, -1)).to(q.dtype),
        _from_bhsd(dk).to(k.dtype),
        _from_bhsd(dv).to(v.dtype),
    )


def _cpu_fwd(q, k, v, causal, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=None, scale=scale
    )
    return _from_bhsd(out), lse.float()


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), 0.0, causal,
        attn_mask=None, scale=scale,
    )
    return _from_bhsd(dq), _from_bhsd(dk), _from_bhsd(dv)


def _flash_fwd(q, k, v, causal, scale):
    res = _aten._flash_attention_forward(
        _bshd(q), _bshd(k), _bshd(v), None, None, q.shape[0], k.shape[0], 0.0, causal, False,
        scale=scale,
    )
    return _bshd(res[0]), res[1]


def _flash_bwd(dout, q, k, v, out, lse, causal, scale):
    rng = _dummy_rng(q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        _bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse.contiguous(), None, None,
        q.shape[0], k.shape[0], 0.0, causal, rng, rng, scale=scale,
    )
    return _bshd(dq), _bshd(dk), _bshd(dv)


def _cudnn_fwd(q, k, v, causal, scale, native_gqa=None):
    if native_gqa is None:
        native_gqa = _cudnn_native_gqa(q.device, q.dtype)
    if not native_gqa:
        k, v = _expand_kv(k, q.shape[2]), _expand_kv(v, q.shape[2])
    res = _aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale
    )
    s, b, h, _ = q.shape
    return _from_bhsd(res[0]), res[1].reshape(b, h, s)


def _cudnn_bwd(dout, q, k, v, out, lse, causal, scale, native_gqa=None):
    if native_gqa is None:
        native_gqa = _cudnn_native_gqa(q.device, q.dtype)
    kv_heads = k.shape[2]
    if not native_gqa:
        k, v = _expand_kv(k, q.shape[2]), _expand_kv(v, q.shape[2])
    rng = _dummy_rng(q.device)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous().unsqueeze(-1),
        rng, rng, None, None, None, q.shape[0], k.shape[0], 0.0, causal, scale=scale,
    )
    return _from_bhsd(dq), _reduce_kv(_from_bhsd(dk), kv_heads), _reduce_kv(_from_bhsd(dv), kv_heads)


_EFFICIENT_MAX_DIM = 128


def _efficient_head_dim(q):
    # Refused above 128: its backward's dq was wrong at 192 (MLA 192/128 zero-padded; 17-55% of
    # dq off on H100, torch 2.11), found by functional/test_kernel_conformance.py.
    if q.shape[-1] > _EFFICIENT_MAX_DIM:
        raise NotImplementedError(f"cpkit attention: kernel 'efficient' takes head dims up to {_EFFICIENT_MAX_DIM}, "
                                  f"got {q.shape[-1]}; use 'flash', 'cudnn' or 'cudnn_fe' (or let cpkit choose)")


def _efficient_fwd(q, k, v, causal, scale):
    _efficient_head_dim(q)
    k, v = _expand_kv(k, q.shape[2]), _expand_kv(v, q.shape[2])
    res = _aten._efficient_attention_forward(
        _bshd(q), _bshd(k), _bshd(v), None, None, None, None, None, 0.0, 1 if causal else 0, True,
        scale=scale,
    )
    # The LSE comes padded to a multiple of 32 queries.
    return _bshd(res[0]), res[1][..., : q.shape[0]]


def _efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    _efficient_head_dim(q)
    kv_heads = k.shape[2]
    k, v = _expand_kv(k, q.shape[2]), _expand_kv(v, q.shape[2])
    s = q.shape[0]
    lse_padded = lse.new_zeros((*lse.shape[:-1], (s + 31) // 32 * 32))
    lse_padded[..., :s] = lse
    rng = _dummy_rng(q.device)
    dq, dk, dv, _ = _aten._efficient_attention_backward(
        _bshd(dout), _bshd(q), _bshd(k), _bshd(v), None, _bshd(out), None, None, s, k.shape[0],
        lse_padded, 0.0, rng, rng, 1 if causal else 0, False, scale=scale,
    )
    return _bshd(dq), _reduce_kv(_bshd(dk), kv_heads), _reduce_kv(_bshd(dv), kv_heads)


def _fe_fwd(q, k, v, causal, scale):
    return cudnn_fe.fwd(q, k, v, scale, causal=causal)


def _fe_bwd(dout, q, k, v, out, lse, causal, scale):
    return cudnn_fe.bwd(dout, q, k, v, out, lse, scale, causal=causal)


_DENSE: dict[str, tuple[Callable, Callable]] = {
    "cpu": (_cpu_fwd, _cpu_bwd),
    "cudnn_fe": (_fe_fwd, _fe_bwd),
    "math": (_math_fwd, _math_bwd),
    "cudnn": (_cudnn_fwd, _cudnn_bwd),
    "flash": (_flash_fwd, _flash_bwd),
    "efficient": (_efficient_fwd, _efficient_bwd),
}


@functools.lru_cache(maxsize=None)
def _cudnn_native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN attention gives, for un-expanded GQA KV, what it gives for expanded KV
    (forward and backward). Probed once per device and dtype on a small shape."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q, do = (torch.randn(128, 1, 4, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
        k, v = (torch.randn(128, 1, 2, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
        native = _cudnn_fwd(q, k, v, True, 0.125, native_gqa=True)
        expanded = _cudnn_fwd(q, k, v, True, 0.125, native_gqa=False)
        grads_n = _cudnn_bwd(do, q, k, v, native[0], native[1], True, 0.125, native_gqa=True)
        grads_e = _cudnn_bwd(do, q, k, v, expanded[0], expanded[1], True, 0.125, native_gqa=False)
        pairs = list(zip(native, expanded)) + list(zip(grads_n, grads_e))
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                   for a, b in pairs)
    except (RuntimeError, NotImplementedError):
        return False


# Kernels that take v with its own head dim; the others get zero-padded copies.
_NATIVE_V_DIM = ("cudnn_fe", "math")


def kernel_candidates(device: torch.device, dtype: torch.dtype, forced: Optional[str] = None,
                      fe: Optional[bool] = None, mla: bool = False) -> list[str]:
    """The dense kernels tried, in order, for `device` and `dtype` (see the module docstring);
    `forced` (one of CUDA_KERNELS) is the only one on CUDA, except a "cudnn_fe" that `fe` (whether
    the cuDNN frontend is usable; default: it imports) says is missing. `mla`: v has its own
    head dim. Raises ValueError for another name."""
    if forced and forced not in CUDA_KERNELS:
        raise ValueError(f"attention kernel {forced!r}: must be one of {', '.join(CUDA_KERNELS)}, or None "
                         "to let cpkit choose")
    if device.type != "cuda":
        return ["math"] if forced == "math" else ["cpu", "math"]
    fe = cudnn_fe.available() if fe is None else fe
    if forced and (forced != "cudnn_fe" or fe):
        return [forced]
    if dtype == torch.float32:
        return ["efficient", "math"]  # cuDNN and flash kernels are 16-bit only
    if not fe:
        return ["cudnn", "flash", "efficient"]
    return ["cudnn_fe", "cudnn", "flash", "efficient"] if mla else ["cudnn", "cudnn_fe", "flash", "efficient"]


def _same_head_dims(direction: int, fn: Callable, args: tuple):
    """`fn` (a kernel taking one head dim) on `args` with v, or q and k, zero-padded to the
    larger head dim (exact: zero value columns give zero output columns, zero q/k columns add
    nothing to the scores); the results cut back to the real head dims."""
    def pad(x, d):
        return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))

    if direction == 0:
        q, k, v, *rest = args
        d = max(q.shape[-1], v.shape[-1])
        out, lse = fn(pad(q, d), pad(k, d), pad(v, d), *rest)
        return out[..., :v.shape[-1]], lse
    dout, q, k, v, out, lse, *rest = args
    d = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = fn(pad(dout, d), pad(q, d), pad(k, d), pad(v, d), pad(out, d), lse, *rest)
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


def _call(direction: int, fn: Callable, name: str, args: tuple):
    """`fn(*args)`, through `_same_head_dims` where v's head dim differs and `name` needs one."""
    q, v = (args[0], args[2]) if direction == 0 else (args[1], args[3])
    if q.shape[-1] != v.shape[-1] and name not in _NATIVE_V_DIM:
        return _same_head_dims(direction, fn, args)
    return fn(*args)


def _run(direction: int, names: list[str], key: tuple, args: tuple, forced: bool):
    errors = []
    for name in names:
        if (name, key) in _FAILED:
            continue
        try:
            return _call(direction, _DENSE[name][direction], name, args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - RuntimeError (NotImplementedError included); the
            # cuDNN frontend's refusals also come as ValueError or its own error class
            if forced or not (isinstance(exc, RuntimeError) or name == "cudnn_fe"):
                raise
            errors.append(f"{name}: {exc}")
            _FAILED.add((name, key))
            warnings.warn(f"cpkit attention: kernel {name!r} failed for {key}, trying the next one: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    raise RuntimeError("cpkit attention: no kernel ran for " + repr(key) + ":\n" + "\n".join(errors))


def _dense(direction: int, q, k, v, args: tuple, causal: bool, kernel: Optional[str]):
    mla = q.shape[-1] != v.shape[-1]
    names = kernel_candidates(q.device, q.dtype, kernel, fe=_fe_wanted(q, kernel, mla), mla=mla)
    key = (q.device.type, q.dtype, q.shape[-1], v.shape[-1], causal, q.shape[-2] != k.shape[-2])
    return _run(direction, names, key, args, bool(kernel) and q.device.type == "cuda")


# ---------------------------------------------------------------------------------------------
# varlen (THD): q [t, h, d], k/v [t_k, h_kv, d]


def _flash_varlen_fwd(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k):
    res = _aten._flash_attention_forward(
        q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, 0.0, causal, False,
        scale=scale,
    )
    return res[0], res[1]


def _flash_varlen_bwd(dout, q, k, v, out, lse, causal, scale, cu_q, cu_k, max_q, max_k):
    rng = _dummy_rng(q.device)
    return _aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cu_q.to(torch.int32), cu_k.to(torch.int32), max_q,
        max_k, 0.0, causal, rng, rng, scale=scale,
    )


def _fe_wanted(q, kernel: Optional[str], needed: bool) -> bool:
    """Whether the cuDNN frontend is a candidate; asks `cudnn_fe.usable` (which warns once when
    the library is missing) only where the block needs it (`needed`) or `kernel` forces it."""
    if kernel == "cudnn_fe" or needed:
        return cudnn_fe.usable(q, kernel)
    return cudnn_fe.available() and cudnn_fe.usable(q, kernel)


def _fe_varlen_fwd(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, sink=None):
    return cudnn_fe.varlen_fwd(q, k, v, scale, cu_q, cu_k, max_q, max_k, causal=causal, sink=sink)


def _fe_varlen_bwd(dout, q, k, v, out, lse, causal, scale, cu_q, cu_k, max_q, max_k):
    return cudnn_fe.varlen_bwd(dout, q, k, v, out, lse, scale, cu_q, cu_k, max_q, max_k, causal=causal)


def _use_flash_varlen(q, kernel: Optional[str]) -> bool:
    return (
        q.device.type == "cuda"
        and q.dtype != torch.float32
        and kernel in (None, "flash", "cudnn", "efficient")
        and ("flash_varlen", q.dtype, q.shape[-1]) not in _FAILED
    )


def _varlen(direction: int, q, args: tuple, max_seqlens: tuple, kernel: Optional[str]):
    """Varlen forward (direction 0) or backward (1) of `args` (as _loop_fwd / _loop_bwd take them):
    flash varlen where usable, given `max_seqlens` (q, k); after a RuntimeError it is marked failed
    for this dtype and head dim (with a warning) and not tried again. Otherwise one dense kernel call
    per sequence."""
    if _fe_wanted(q, kernel, needed=True):
        key = ("varlen", direction, q.dtype, q.shape[-1], args[2 + direction].shape[-1])
        got = cudnn_fe.try_run((_fe_varlen_fwd, _fe_varlen_bwd)[direction], key, *args, *max_seqlens)
        if got is not None:
            return got
    if _use_flash_varlen(q, kernel):
        try:
            return _call(direction, (_flash_varlen_fwd, _flash_varlen_bwd)[direction], "flash",
                         (*args, *max_seqlens))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            _FAILED.add(("flash_varlen", q.dtype, q.shape[-1]))
            warnings.warn(f"cpkit attention: flash varlen {('forward', 'backward')[direction]} failed, "
                          f"looping over sequences: {exc}")
    return (_loop_fwd, _loop_bwd)[direction](*args, kernel=kernel)


def _loop_fwd(q, k, v, causal, scale, cu_q, cu_k, kernel=None):
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for (qs, qe), (ks, ke) in zip(_ranges(cu_q), _ranges(cu_k)):
        if qe > qs and ke > ks:
            o, l = attn_fwd(q[qs:qe].unsqueeze(1), k[ks:ke].unsqueeze(1), v[ks:ke].unsqueeze(1), causal, scale,
                            kernel=kernel)
            out[qs:qe] = o.squeeze(1)
            lse[:, qs:qe] = l.squeeze(0)
    return out, lse


def _loop_bwd(dout, q, k, v, out, lse, causal, scale, cu_q, cu_k, kernel=None):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qs, qe), (ks, ke) in zip(_ranges(cu_q), _ranges(cu_k)):
        if qe > qs and ke > ks:
            g = attn_bwd(
                dout[qs:qe].unsqueeze(1), q[qs:qe].unsqueeze(1), k[ks:ke].unsqueeze(1),
                v[ks:ke].unsqueeze(1), out[qs:qe].unsqueeze(1), lse[:, qs:qe].unsqueeze(0), causal, scale,
                kernel=kernel,
            )
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = (x.squeeze(1) for x in g)
    return dq, dk, dv


def _ranges(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


# ---------------------------------------------------------------------------------------------
# public interface


def _check(q, k, v, causal, varlen):
    dims = 3 if varlen else 4
    what = "[t, heads, dim] with cu_seqlens" if varlen else "[s, b, heads, dim]"
    if q.dim() != dims or k.dim() != dims or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"attention kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
            f"expected {what} and v.shape == k.shape but for v's head dim"
        )
    if q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2] or (not varlen and q.shape[1] != k.shape[1]):
        raise ValueError(
            f"attention kernel: q {tuple(q.shape)} vs k {tuple(k.shape)}: head dims and batch must "
            "match and q heads must be a multiple of kv heads"
        )
    if causal and not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"attention kernel: causal needs a square block, got s_q={q.shape[0]} s_k={k.shape[0]}; "
            "split it into an unmasked and a square causal part"
        )


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    kernel: Optional[str] = None,
    sink: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k/v; returns (out like q with v's head dim, float32 LSE [b, h, s] or
    [h, t]).

    Dense: q [s, b, h, d], k [s_k, b, h_kv, d], v [s_k, b, h_kv, d_v]. Varlen (cu_seqlens_q
    given): q [t, h, d], k/v [t_k, h_kv, d / d_v], `cu_seqlens_q/k` int32 offsets (same count of
    sequences), `max_seqlen_q/k` upper bounds of the sequence lengths. `kernel`: force one CUDA
    kernel (CUDA_KERNELS; None lets cpkit choose). `sink` [h]: sink logits, for a block that is
    the whole attention (out and LSE include them; out is float32 where they were applied
    outside the kernel). Raises ValueError for inconsistent shapes or an unknown kernel.
    """
    varlen = cu_seqlens_q is not None
    _check(q, k, v, causal, varlen)
    if sink is not None:
        got = _fe_with_sink(q, k, v, causal, scale, sink, kernel, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k)
        if got is not None:
            return got
        out, lse = attn_fwd(q, k, v, causal, scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, kernel=kernel)
        return apply_sink(out, lse, sink)
    if varlen:
        return _varlen(0, q, (q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k),
                       (max_seqlen_q, max_seqlen_k), kernel)
    if q.shape[0] == 0 or k.shape[0] == 0:
        lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), float("-inf"), device=q.device)
        return q.new_zeros((*q.shape[:-1], v.shape[-1])), lse
    return _dense(0, q, k, v, (q, k, v, causal, scale), causal, kernel)


def _fe_with_sink(q, k, v, causal, scale, sink, kernel, cu_q, cu_k, max_q, max_k):
    """The cuDNN frontend's forward with the sink folded in, or None where it is not usable."""
    if not _fe_wanted(q, kernel, needed=True) or q.shape[0] == 0 or k.shape[0] == 0:
        return None
    key = ("sink", q.dim(), q.dtype, q.shape[-1], v.shape[-1], causal)
    if cu_q is not None:
        return cudnn_fe.try_run(_fe_varlen_fwd, key, q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, sink)
    return cudnn_fe.try_run(cudnn_fe.fwd, key, q, k, v, scale, causal=causal, sink=sink)


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    kernel: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv; dtypes of q, k, v) of this block, given the final `out` and `lse`.

    Shapes and `kernel` as in `attn_fwd`; `dout` and `out` like q, `lse` float32 like attn_fwd's.
    """
    varlen = cu_seqlens_q is not None
    _check(q, k, v, causal, varlen)
    # A block that was the whole attention with a sink applied outside the kernel has a float32
    # output; the kernels read `out` and `dout` in q's dtype (flash refuses, cuDNN and efficient
    # read the wrong bytes: NaN dq).
    out, dout = out.to(q.dtype), dout.to(q.dtype)
    if varlen:
        return _varlen(1, q, (dout, q, k, v, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k),
                       (max_seqlen_q, max_seqlen_k), kernel)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _dense(1, q, k, v, (dout, q, k, v, out, lse, causal, scale), causal, kernel)


def reference_attention(q, k, v, causal: bool, scale: Optional[float] = None) -> torch.Tensor:
    """Plain-PyTorch attention through autograd (materializes the scores): the test reference.

    Dense q [s, b, h, d], k/v [s, b, h_kv, d]; computed in float32, returned in q.dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    h = q.shape[-2]
    qf, kf, vf = q.float(), _expand_kv(k, h).float(), _expand_kv(v, h).float()
    scores = torch.einsum("sbhd,tbhd->bhst", qf, kf) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, -1), vf).to(q.dtype)
