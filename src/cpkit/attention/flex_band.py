"""Band-masked attention blocks on CUDA through FlexAttention (`torch.nn.attention.flex_attention`).

The block's band (`band.BandMask`) becomes a FlexAttention block mask, built from the tiles'
position ranges (`block_tiles`), so compute and memory follow the band: tiles wholly outside
it are never computed, tiles wholly inside run without the mask, and no [s_q, s_k] tensor exists.

    fwd(q, k, v, band, scale) -> (out, lse)           like band.band_fwd
    bwd(q, k, v, band, scale, dout, out, lse) -> (dq, dk, dv), given the FINAL out and LSE

FlexAttention's backward knows only its own block's output and LSE, while a CP block's share of
the gradients is taken with the final (merged) ones. So `bwd` recomputes the block (o_b, lse_b)
and back-propagates its share of the merge: out = sum_b w_b o_b with w_b = exp(lse_b - lse),
hence dL/do_b = w_b dout and dL/dlse_b = w_b <dout, o_b - out> (FlexAttention differentiates
its LSE). The recompute costs one extra band-sized forward per block in the backward.

A shape or dtype FlexAttention cannot run (a head dim it lacks a kernel for, a missing Triton)
warns once and `try_run` returns None, and the caller uses exact math for it from then on.
"""

from __future__ import annotations

import types
import warnings
from typing import Optional

import torch

__all__ = ["wanted", "try_run", "fwd", "bwd", "share_of_merge_grads", "block_tiles"]

TILE = 128  # FlexAttention's default block size
_FAILED: set = set()  # shape/dtype keys FlexAttention raised for: exact math from then on


def wanted(q: torch.Tensor, kernel: Optional[str]) -> bool:
    """Whether a band block on `q`'s device goes to FlexAttention: CUDA, unless `kernel` forces
    math, and a torch that has FlexAttention."""
    return q.is_cuda and kernel != "math" and _flex_module() is not None


try:  # resolved once at import: the compiled wrappers below read a plain module global
    from torch.nn.attention import flex_attention as _FLEX
except ImportError:  # a torch without FlexAttention
    _FLEX = None


def _flex_module():
    """torch's FlexAttention module, or None where this torch has none."""
    return _FLEX


# Kernels specialised to their shapes are the fastest (a dynamic-shape kernel was 1.3x slower
# on H200), but every new shape compiles again (seconds). So the first STATIC_SHAPES shapes
# get their own kernels and every later one (packed batches of ever-new lengths) shares one
# dynamic-shape kernel. Two wrapper functions: dynamo keeps its compile cache per code object
# (and `_run_compiled` never lets it run one uncompiled past its recompile limit).
# Dynamo traces the wrappers: they call nothing behind a functools.lru_cache (dynamo would trace
# through the cache and warn of silent incorrectness), only the module global _FLEX.
STATIC_SHAPES = 4
_STATIC_KEYS: set = set()
_COMPILED: dict = {}  # dynamic (bool) -> the compiled wrapper


def _flex_static(*args, **kwargs):
    return _FLEX.flex_attention(*args, **kwargs)


def _flex_dynamic(*args, **kwargs):
    return _FLEX.flex_attention(*args, **kwargs)


def _compiled(dynamic: bool, fresh: bool = False):
    """The compiled wrapper (outside any traced code: a plain dict, built once); `fresh`: a new
    one in place of the old (`_run_compiled` says when)."""
    if fresh or dynamic not in _COMPILED:
        base = _flex_dynamic if dynamic else _flex_static
        # dynamo keeps compiled variants per code object: a copy of the code starts with none
        own = types.FunctionType(base.__code__.replace(), base.__globals__, base.__name__)
        _COMPILED[dynamic] = torch.compile(own, dynamic=dynamic)
    return _COMPILED[dynamic]


def _run_compiled(attention, call):
    """call(attention) where dynamo raises at its recompile limit rather than run the call
    uncompiled: FlexAttention uncompiled is its unfused path, which materialises the [s_q, s_k]
    scores and warns once per process. A wrapper collects variants beyond its keys (grad mode:
    the forward and the backward's recompute of one shape are two; strides, where a caller hands
    other layouts than `_dense_rows` makes), so in a long run it can reach the limit; a fresh
    wrapper of its kind then takes over."""
    dynamic = next((d for d, fn in _COMPILED.items() if fn is attention), None)
    if dynamic is None:  # uncompiled FlexAttention (CPU)
        return call(attention)
    config, exc = torch._dynamo.config, torch._dynamo.exc
    fail = "fail_on_recompile_limit_hit" if hasattr(config, "fail_on_recompile_limit_hit") else "fail_on_cache_limit_hit"
    limit_hit = getattr(exc, "FailOnRecompileLimitHit", None) or getattr(exc, "FailOnCacheLimitHit")
    with config.patch({fail: True, "suppress_errors": False}):
        try:
            return call(attention)
        except limit_hit:
            return call(_compiled(dynamic, fresh=True))


def _shape_key(q, k, v, band) -> tuple:
    return (q.shape, k.shape, v.shape, q.dtype, band.window, band.causal, band.q[1] is None)


def _attention(q, k, v, band):
    """The FlexAttention callable for this call: uncompiled on CPU (its reference, for the unit
    tests), else a shape-specialised kernel for the first STATIC_SHAPES shapes, then one
    dynamic-shape kernel."""
    if q.device.type != "cuda":
        return _flex_module().flex_attention
    key = _shape_key(q, k, v, band)
    if key not in _STATIC_KEYS and len(_STATIC_KEYS) < STATIC_SHAPES:
        _STATIC_KEYS.add(key)
    return _compiled(key not in _STATIC_KEYS)


def _key(q, k, v) -> tuple:
    return (q.dtype, q.shape[-1], v.shape[-1], q.shape[-2] != k.shape[-2], q.dim())


def try_run(fn, q, k, v, band, scale, *rest):
    """`fn(q, k, v, band, scale, *rest)`, or None (one warning) when FlexAttention cannot run
    this shape/dtype; out-of-memory is raised, not hidden."""
    key = _key(q, k, v)
    if key in _FAILED:
        return None
    try:
        return fn(q, k, v, band, scale, *rest)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # Triton/Inductor errors have no common base class
        _FAILED.add(key)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        warnings.warn(f"cpkit attention: FlexAttention failed for {key}; exact math with a dense "
                      f"band mask from now on: {first}")
        return None


def _to_bhsd(x: torch.Tensor) -> torch.Tensor:
    # sbhd [s, b, h, d] -> [b, h, s, d]; THD [t, h, d] -> [1, h, t, d] (views)
    return x.permute(1, 2, 0, 3) if x.dim() == 4 else x.permute(1, 0, 2).unsqueeze(0)


def _from_bhsd(x: torch.Tensor, thd: bool) -> torch.Tensor:
    return x[0].permute(1, 0, 2) if thd else x.permute(2, 0, 1, 3)


def _lse_to_bhs(lse: torch.Tensor, thd: bool) -> torch.Tensor:
    return lse.unsqueeze(0) if thd else lse  # [h, t] -> [1, h, t]


def _edge_pad(x: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """`x` extended to `n` entries by repeating its last one (unchanged if None or long enough)."""
    if x is None or n <= x.numel():
        return x
    return torch.cat([x, x[-1:].expand(n - x.numel())])


def _tile_bounds(x: torch.Tensor, tiles: int):
    """Per tile of TILE entries of `x`: (min, max); the last, partial tile repeats x's last entry."""
    x = _edge_pad(x, tiles * TILE).view(tiles, TILE)
    return x.amin(1), x.amax(1)


def _mask_mod(band, tiles_q: int, tiles_k: int):
    """The band as a FlexAttention mask_mod(b, h, q, kv); positions in the last, partial tile
    read the last query's or key's, never out of bounds.

    A window that lets a query see keys after it (a two-sided window: lowest distance < 0) has its
    bounds folded into copies of the key positions (q - k >= lo  <=>  q >= k + lo), so the mask
    compares captured index tensors only: with the bounds as Python ints its dynamic-shape kernel
    failed to lower (torch 2.11, CUDA: 'ShapeAsConstantBuffer' object has no attribute 'dtype').
    Every other band keeps the int form, in which it compiles; folded, a causal window's short
    THD blocks in half precision found no kernel config (NoValidChoicesError)."""
    (q_idx, q_seg), (k_idx, k_seg) = ((_edge_pad(i, n * TILE), _edge_pad(g, n * TILE))
                                      for (i, g), n in ((band.q, tiles_q), (band.k, tiles_k)))
    lo, hi = band.distances()
    if lo is None or lo >= 0:
        if q_seg is None:
            return lambda b, h, i, j: band.allows(q_idx[i], k_idx[j])
        return lambda b, h, i, j: band.allows(q_idx[i], k_idx[j], q_seg[i], k_seg[j])
    k_lo = k_idx + lo
    k_hi = None if hi is None else k_idx + hi

    def mask_mod(b, h, i, j):
        q = q_idx[i]
        ok = q >= k_lo[j]
        if k_hi is not None:
            ok = ok & (q <= k_hi[j])
        return ok if q_seg is None else ok & (q_seg[i] == k_seg[j])

    return mask_mod


def _as_kv_blocks(tiles: torch.Tensor):
    """[q tiles, kv tiles] bool -> (count [1, 1, q], kv tile indices [1, 1, q, kv], those set first)."""
    order = torch.argsort((~tiles).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return tiles.sum(1, dtype=torch.int32)[None, None], order[None, None]


def block_tiles(band):
    """(partial, full): [q tiles, kv tiles] bool of the band's TILE x TILE tiles. A tile is
    full when every query in it sees every key (the kernel skips the mask there), partial when
    some query may see some key (the mask decides), else skipped. Decided from each tile's
    position and sequence-id ranges, O(tiles), never from an [s_q, s_k] mask."""
    (q_idx, q_seg), (k_idx, k_seg) = band.q, band.k
    nq, nk = (-(-n // TILE) for n in band.shape)
    q_lo, q_hi = _tile_bounds(q_idx, nq)
    k_lo, k_hi = _tile_bounds(k_idx, nk)
    d_min, d_max = q_lo[:, None] - k_hi[None, :], q_hi[:, None] - k_lo[None, :]
    live = torch.ones(nq, nk, dtype=torch.bool, device=q_idx.device)
    full = live.clone()
    lo, hi = band.distances()
    if lo is not None:
        live &= d_max >= lo
        full &= d_min >= lo
    if hi is not None:
        live &= d_min <= hi
        full &= d_max <= hi
    if q_seg is not None:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = _tile_bounds(q_seg, nq), _tile_bounds(k_seg, nk)
        live &= (qs_lo[:, None] <= ks_hi[None, :]) & (ks_lo[None, :] <= qs_hi[:, None])
        full &= (qs_lo == qs_hi)[:, None] & (ks_lo == ks_hi)[None, :] & (qs_lo[:, None] == ks_lo[None, :])
    return live & ~full, full


def _block_mask(band):
    """FlexAttention's BlockMask of `band`, built once per band (forward and backward share it)."""
    if "flex" not in band.kernel_cache:
        partial, full = block_tiles(band)
        nq, nk = partial.shape
        band.kernel_cache["flex"] = _flex_module().BlockMask.from_kv_blocks(
            *_as_kv_blocks(partial), *_as_kv_blocks(full), BLOCK_SIZE=TILE,
            mask_mod=_mask_mod(band, nq, nk), seq_lengths=band.shape)
    return band.kernel_cache["flex"]


def _flex_bhsd(q, k, v, band, scale):
    """(o [b, h, s, d_v], lse [b, h, s] float32) of q/k/v in [b, h, s, d]."""
    module = _flex_module()
    block_mask = _block_mask(band)
    gqa, attention = q.shape[1] != k.shape[1], _attention(q, k, v, band)
    # Never inductor's decoding kernel, which it picks for blocks of under 128 queries: on torch
    # 2.11 it found no kernel config for short THD blocks (NoValidChoicesError), specialised to
    # their shape or not, so which kernel such a block got depended on the shapes compiled
    # before it. The main kernel computes every length.
    options = {"FORCE_USE_FLEX_ATTENTION": True}
    if hasattr(module, "AuxRequest"):
        o, aux = _run_compiled(attention, lambda fn: fn(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options,
            return_aux=module.AuxRequest(lse=True)))
        return o, aux.lse.float()
    o, lse = _run_compiled(attention, lambda fn: fn(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options, return_lse=True))
    return o, lse.float()


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """x with dense rows in its own layout (sbhd or THD): a strided view (a2a's all-to-all buffer
    split by heads) is copied, a dense x is x. Dynamo specialises on strides, so without the copy
    the strided and dense forms of one shape compiled kernels of their own (seconds each, twice);
    a copy costs one pass over the block's inputs, and a2a's blocks reach FlexAttention only where
    cuDNN cannot take the band."""
    return x.contiguous()


def fwd(q, k, v, band, scale: float):
    """(out like q, float32 LSE [b, h, s] or [h, t]) of q over k/v within `band`."""
    thd = q.dim() == 3
    qb, kb, vb = (_to_bhsd(_dense_rows(x)) for x in (q, k, v))
    o, lse = _flex_bhsd(qb, kb, vb, band, scale)
    return _from_bhsd(o, thd).to(q.dtype), (lse[0] if thd else lse)


def share_of_merge_grads(block_fwd, q, k, v, dout, out, lse):
    """(dq, dk, dv) of one block whose differentiable forward `block_fwd(q, k, v)` returns
    (o_b, lse_b) in [b, h, s, d] / [b, h, s], given the FINAL dout, out [b, h, s, d] and lse
    [b, h, s] of the merged attention: the block's share of the merge, back-propagated."""
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o_b, lse_b = block_fwd(q, k, v)
        # A row that sees no key of this block (lse_b = -inf) has no share.
        w = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - lse), torch.zeros_like(lse_b))
        do = dout.float()
        grad_o = (w.unsqueeze(-1) * do).to(o_b.dtype)
        grad_lse = w * (do * (o_b.float() - out.float())).sum(-1)
        return torch.autograd.grad([o_b, lse_b], [q, k, v], [grad_o, grad_lse])


def bwd(q, k, v, band, scale: float, dout, out, lse):
    """(dq, dk, dv) in the dtypes of q, k, v of the block within `band`, given the FINAL out
    and LSE of the whole attention."""
    thd = q.dim() == 3
    qb, kb, vb, dob, ob = (_to_bhsd(_dense_rows(x)) for x in (q, k, v, dout, out))
    grads = share_of_merge_grads(lambda a, b, c: _flex_bhsd(a, b, c, band, scale), qb, kb, vb, dob, ob,
                                 _lse_to_bhs(lse, thd))
    return tuple(_from_bhsd(g, thd).to(x.dtype) for g, x in zip(grads, (q, k, v)))
