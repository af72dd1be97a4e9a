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

This module chooses the kernel and runs it; each backend's adapter lives in its own module:
torch's kernels in `sdpa_kernels.py`, the cuDNN frontend in `cudnn_fe.py`, `math` in
`math_kernel.py` (FlexAttention serves the band blocks, `flex_band.py`).

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

import warnings
from typing import Callable, Optional

import torch

from cpkit.attention import cudnn_fe, sdpa_kernels
from cpkit.attention.math_kernel import math_bwd, math_fwd, reference_attention
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

_FAILED: set = set()  # (kernel, shape/dtype key) pairs that raised: not tried again


def _fe_fwd(q, k, v, causal, scale):
    return cudnn_fe.fwd(q, k, v, scale, causal=causal)


def _fe_bwd(dout, q, k, v, out, lse, causal, scale):
    return cudnn_fe.bwd(dout, q, k, v, out, lse, scale, causal=causal)


# The dense adapters by kernel name: torch's own kernels (sdpa_kernels.py), the cuDNN frontend
# (cudnn_fe.py), exact math (math_kernel.py).
_DENSE: dict[str, tuple[Callable, Callable]] = {
    "cpu": (sdpa_kernels.cpu_fwd, sdpa_kernels.cpu_bwd),
    "cudnn_fe": (_fe_fwd, _fe_bwd),
    "math": (math_fwd, math_bwd),
    "cudnn": (sdpa_kernels.cudnn_fwd, sdpa_kernels.cudnn_bwd),
    "flash": (sdpa_kernels.flash_fwd, sdpa_kernels.flash_bwd),
    "efficient": (sdpa_kernels.efficient_fwd, sdpa_kernels.efficient_bwd),
}
_math_fwd, _math_bwd = math_fwd, math_bwd  # the names tests/test_cudnn_fe.py compares against


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
            return _call(direction, (sdpa_kernels.flash_varlen_fwd, sdpa_kernels.flash_varlen_bwd)[direction], "flash",
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

