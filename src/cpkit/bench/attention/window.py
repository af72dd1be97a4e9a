"""`python -m cpkit.bench window`: sliding-window attention compute per CP rank, on one device.

For a causal window of `--window` tokens over `--seq` tokens at CP size `--cp` (b=1), times the
attention forward + backward that ONE rank computes (median of `--iters` after `--warmup`),
with each band kernel: FlexAttention (`flex_band.py`) and the cuDNN frontend (`cudnn_fe.py`,
extra `cpkit[kernels]`; its rows hold an error where it is not installed):

- `p2p, window`: the busiest rank's live ring blocks (`band.Band.block`; blocks wholly outside
  the window skipped), each forward then backward;
- `p2p, no window`: the same rank's ring blocks of plain causal attention (the dense kernels),
  what the window saves;
- `all_gather, window`: that rank's queries against every key (gathered, natural order);
- `a2a+p2p [2, cp/2], window`: half the heads per rank after the a2a level, the busiest rank's
  live blocks of a ring of cp/2 ranks over twice the local tokens;
- `a2a, window`: after the all-to-all a rank holds every token and heads/cp heads: one block
  over the whole sequence (sbhd; with the cuDNN frontend also THD, one packed sequence);
- `a2a, window + sink`: the same through the ring's one-block path (`p2p.ring_forward` /
  `ring_backward`, what a2a runs per head chunk) with a learnable sink, and without it: the
  sink's cost (`sink.sink_grad` included);
- `a2a, window, MLA`: q/k head dim `--mla-qk-dim`, v `--mla-v-dim` (DeepSeek's 192/128), as
  many kv heads as query heads: v zero-padded to the q/k head dim (what all_gather sends)
  vs v as it is;
- `TE a2a, window`: Transformer Engine's DotProductAttention with `window_size` on the same
  per-rank shape (when TE imports; its fused attention is cuDNN's SDPA too).

A row fails (its cell holds the error) rather than time a fallback: the cuDNN frontend's
refusal warnings are errors here. Communication is not in these numbers (p2p passes KV around
the ring in cp-1 steps, a2a does four all-to-alls); on one device they cannot be measured.
Prints a table, writes JSON with the targets' ratios (`targets`).
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings

import torch

from cpkit.attention import cudnn_fe, flex_band
from cpkit.attention.band import Band, Window, band_bwd, band_fwd
from cpkit.attention.chunks import local_seq
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.attention.p2p import ring_backward, ring_forward
from cpkit.attention.sink import sink_grad
from cpkit.bench.common import (add_common_args, format_table, machine_info, median,
                                short_error, time_fn, write_json)

__all__ = ["main"]

NAME = "window"
KERNELS = ("flex", "cudnn_fe")


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype, device, v_dim=None):
    q = torch.randn(tokens, 1, heads, dim, dtype=dtype, device=device)
    k = torch.randn(tokens, 1, kv_heads, dim, dtype=dtype, device=device)
    v = torch.randn(tokens, 1, kv_heads, v_dim or dim, dtype=dtype, device=device)
    return q, k, v


def _band_kernel(kernel: str, device):
    """(fwd, bwd) of band blocks on `kernel`: "flex" is FlexAttention on CUDA (exact math on
    CPU, a smoke run); "cudnn_fe" the cuDNN frontend (RuntimeError where it is not installed)."""
    if kernel == "cudnn_fe":
        if device.type != "cuda" or not cudnn_fe.available():
            raise RuntimeError(f"nvidia-cudnn-frontend not importable on {device.type}: {cudnn_fe.INSTALL_HINT}")
        return (lambda q, k, v, b, s: band_fwd(q, k, v, b, s, "cudnn_fe"),
                lambda do, q, k, v, o, l, b, s: band_bwd(do, q, k, v, o, l, b, s, "cudnn_fe"))
    if device.type == "cuda":
        return (lambda q, k, v, b, s: flex_band.fwd(q, k, v, b, s),
                lambda do, q, k, v, o, l, b, s: flex_band.bwd(q, k, v, b, s, do, o, l))
    return (lambda q, k, v, b, s: band_fwd(q, k, v, b, s, "math"),
            lambda do, q, k, v, o, l, b, s: band_bwd(do, q, k, v, o, l, b, s, "math"))


def _band_step(kernel: str, make_band, sources, q, k, v, scale: float):
    """Forward then backward of every live block (the block's own output stands in for the
    merged one: the time is the same); the Band is built per step, as per attention call.
    `sources`: the ranks whose blocks are computed, or None for all_gather's one block of the
    local queries against every key in natural order."""
    fwd, bwd = _band_kernel(kernel, q.device)

    def step():
        band = make_band()
        if sources is None:
            blocks = [band.natural_mask(k.shape[0])]
        else:
            blocks = [b for b in (band.block(src) for src in sources) if b is not None]
        outs = [fwd(q, k, v, b, scale) for b in blocks]
        for b, (o, lse) in zip(blocks, outs):
            bwd(o, q, k, v, o, lse, b, scale)
    return step


def _ring_step(kernel: str, make_band, q, k, v, scale: float, sink=None):
    """The ring's one-block path (a2a's per-chunk step, `ring_forward` / `ring_backward` without
    a ring) with an optional sink, its gradient included."""
    _band_kernel(kernel, q.device)  # the same availability check
    # Any forced kernel but "cudnn_fe" leaves band blocks to FlexAttention on CUDA (math on CPU).
    forced = "cudnn_fe" if kernel == "cudnn_fe" else ("cudnn" if q.device.type == "cuda" else "math")
    seq = local_seq(q.shape[0], 1)

    def step():
        band = make_band()
        out, lse, kv = ring_forward(q, k, v, None, True, scale, seq, forced, band, sink)
        ring_backward(out, q, kv, out, lse, None, True, scale, seq, forced, band)
        if sink is not None:
            sink_grad(out, out, lse, sink)
    return step


def _thd_step(kernel: str, window: int, q, k, v, scale: float):
    """a2a's block as THD: the whole sequence as one packed sequence (cu_seqlens)."""
    cu = torch.tensor([0, q.shape[0]], device=q.device)
    seq = local_seq(q.shape[0], 1, cu, q.shape[0])
    return _band_step(kernel, lambda: Band(Window(window - 1, None), True, seq, 0, q.device), [0],
                      *(x[:, 0] for x in (q, k, v)), scale)


def _live_blocks(band: Band, cp: int) -> int:
    return sum(band.block(src) is not None for src in range(cp))


def _dense_ring_step(rank: int, cp: int, q, k, v, scale: float):
    """The causal ring's blocks of `rank` without a window: the diagonal block, then per
    earlier rank all queries against the first KV half, per later rank the second query half
    against all keys (the load-balanced chunking's block shapes)."""
    half = q.shape[0] // 2

    def step():
        parts = [(q, k, v, True)] + [(q, k[:half], v[:half], False)] * rank + [(q[half:], k, v, False)] * (cp - 1 - rank)
        for qq, kk, vv, causal in parts:
            o, lse = attn_fwd(qq, kk, vv, causal, scale)
            attn_bwd(o, qq, kk, vv, o, lse, causal, scale)
    return step


def _te_step(seq: int, heads: int, kv_heads: int, dim: int, window: int, dtype, device):
    import transformer_engine.pytorch as te

    attn = te.DotProductAttention(heads, dim, num_gqa_groups=kv_heads, attn_mask_type="causal",
                                  window_size=(window - 1, 0), qkv_format="sbhd")
    q, k, v = (x.requires_grad_() for x in _qkv(seq, heads, kv_heads, dim, dtype, device))

    def step():
        out = attn(q, k, v)
        out.backward(torch.ones_like(out))
    return step


def _rows(args, device, dtype):
    """{label: builder of the timed step} of every row."""
    cp, scale, window = args.cp, args.head_dim ** -0.5, args.window
    tokens = args.seq // cp
    seq = local_seq(tokens, cp)
    win = Window(window - 1, None)
    bands = [Band(win, True, seq, r, device) for r in range(cp)]
    busiest = max(range(cp), key=lambda r: _live_blocks(bands[r], cp))
    live = _live_blocks(bands[busiest], cp)
    local = _qkv(tokens, args.heads, args.kv_heads, args.head_dim, dtype, device)
    heads_a2a, kv_a2a = args.heads // cp, max(args.kv_heads // cp, 1)
    whole = _qkv(args.seq, heads_a2a, kv_a2a, args.head_dim, dtype, device)
    mla_heads = args.mla_heads or heads_a2a
    mla = _qkv(args.seq, mla_heads, mla_heads, args.mla_qk_dim, dtype, device, v_dim=args.mla_v_dim)
    mla_padded = (*mla[:2], torch.nn.functional.pad(mla[2], (0, args.mla_qk_dim - args.mla_v_dim)))
    sink = torch.linspace(-1.0, 1.0, heads_a2a, device=device)

    def whole_band():
        return Band(win, True, local_seq(args.seq, 1), 0, device)

    rows = {}
    for kernel in KERNELS:
        rows[f"p2p, window, {kernel} (rank {busiest}: {live} of {cp} blocks)"] = (
            lambda kernel=kernel: _band_step(kernel, lambda: Band(win, True, seq, busiest, device), list(range(cp)),
                                             *local, scale))
    rows[f"p2p, no window (rank {busiest}, dense kernels)"] = lambda: _dense_ring_step(busiest, cp, *local, scale)
    gathered = _qkv(args.seq, 1, args.kv_heads, args.head_dim, dtype, device)[1:]
    for kernel in KERNELS:
        rows[f"all_gather, window, {kernel} (rank {busiest})"] = (
            lambda kernel=kernel: _band_step(kernel, lambda: Band(win, True, seq, busiest, device, ring=False), None,
                                             local[0], *gathered, scale))
    if cp % 2 == 0 and cp > 2:  # a2a+p2p [2, cp/2]: the a2a level halves the heads, a ring of cp/2 ranks
        hier_seq = local_seq(2 * tokens, cp // 2)
        hier = _qkv(2 * tokens, args.heads // 2, max(args.kv_heads // 2, 1), args.head_dim, dtype, device)
        hier_bands = [Band(win, True, hier_seq, r, device) for r in range(cp // 2)]
        hier_rank = max(range(cp // 2), key=lambda r: _live_blocks(hier_bands[r], cp // 2))
        for kernel in KERNELS:
            rows[f"a2a+p2p [2, {cp // 2}], window, {kernel} (ring rank {hier_rank})"] = (
                lambda kernel=kernel: _band_step(kernel, lambda: Band(win, True, hier_seq, hier_rank, device),
                                                 list(range(cp // 2)), *hier, scale))
    for kernel in KERNELS:
        rows[f"a2a, window, {kernel}"] = (
            lambda kernel=kernel: _band_step(kernel, whole_band, [0], *whole, scale))
    rows["a2a, window, cudnn_fe, THD"] = lambda: _thd_step("cudnn_fe", window, *whole, scale)
    for kernel in KERNELS:
        rows[f"a2a, window, {kernel}, ring path"] = (
            lambda kernel=kernel: _ring_step(kernel, whole_band, *whole, scale))
        rows[f"a2a, window + sink, {kernel}, ring path"] = (
            lambda kernel=kernel: _ring_step(kernel, whole_band, *whole, scale, sink))
    mla_scale = args.mla_qk_dim ** -0.5
    for kernel in KERNELS:
        rows[f"a2a, window, MLA v padded, {kernel}"] = (
            lambda kernel=kernel: _band_step(kernel, whole_band, [0], *mla_padded, mla_scale))
        rows[f"a2a, window, MLA, {kernel}"] = (
            lambda kernel=kernel: _band_step(kernel, whole_band, [0], *mla, mla_scale))
    rows["TE a2a, window"] = lambda: _te_step(args.seq, heads_a2a, kv_a2a, args.head_dim, window, dtype, device)
    return rows, busiest


def _targets(ms: dict, busiest_p2p: str, te_ms: float, te_source: str) -> dict:
    """The issue's targets as measured ratios (None where a row failed)."""
    def ratio(a, b):
        return None if a is None or b is None else a / b
    fe = ms.get("a2a, window, cudnn_fe")
    return {
        "te_ms": te_ms, "te_source": te_source,
        "a2a_window_vs_te (<= 1.0)": ratio(fe, te_ms),
        "p2p_busiest_vs_te_a2a (<= 1.3)": ratio(ms.get(busiest_p2p), te_ms),
        "sink_over_no_sink (< 1.05)": ratio(ms.get("a2a, window + sink, cudnn_fe, ring path"),
                                            ms.get("a2a, window, cudnn_fe, ring path")),
        "mla_native_vs_padded (<= 1.0)": ratio(ms.get("a2a, window, MLA, cudnn_fe"),
                                               ms.get("a2a, window, MLA v padded, cudnn_fe")),
    }


# TE's last measured a2a window time at the default shape, for the targets when TE is absent.
TE_RECORDED_MS = 19.95
TE_RECORDED_SOURCE = "evidence/2026-11-23-1xH200-e310f65 (1x H200, TE 2.20.2, measured)"


def main(argv=None) -> int:
    """Run the benchmark; returns 0."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench window", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072, help="total tokens (default 131072)")
    parser.add_argument("--cp", type=int, default=4, help="CP size (default 4)")
    parser.add_argument("--window", type=int, default=4096, help="causal window in tokens (default 4096)")
    parser.add_argument("--heads", type=int, default=64, help="query heads (default 64, gpt-oss)")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    parser.add_argument("--mla-qk-dim", type=int, default=192, help="MLA q/k head dim (default 192)")
    parser.add_argument("--mla-v-dim", type=int, default=128, help="MLA v head dim (default 128)")
    parser.add_argument("--mla-heads", type=int, default=0, help="MLA heads per rank (default heads / cp)")
    add_common_args(parser, warmup=2, iters=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.window, args.heads, args.kv_heads, args.head_dim = 512, 32, 4, 2, 16
        args.mla_qk_dim, args.mla_v_dim = 24, 16
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, busiest = _rows(args, device, dtype)
    cells, results, ms = {}, [], {}
    for label, build in rows.items():
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*cuDNN frontend refused.*")
                times = time_fn(build(), warmup=args.warmup, iters=args.iters, device=device)
            ms[label] = median(times)
            cells[(label, "fwd+bwd ms")] = f"{ms[label]:.2f}"
            results.append({"case": label, "ms": ms[label], "times_ms": times})
        except Exception as exc:  # noqa: BLE001 - one failing cell must not end the table
            cells[(label, "fwd+bwd ms")] = short_error(exc)
            results.append({"case": label, "error": traceback.format_exc()})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    te_ms = ms.get("TE a2a, window")
    source = "measured in this run" if te_ms is not None else TE_RECORDED_SOURCE
    p2p_fe = next(label for label in rows if label.startswith("p2p, window, cudnn_fe"))
    targets = _targets(ms, p2p_fe, te_ms if te_ms is not None else TE_RECORDED_MS, source)
    title = (f"sliding window {args.window} at {args.seq} tokens, cp={args.cp}, heads {args.heads}/{args.kv_heads}, "
             f"head dim {args.head_dim} (MLA {args.mla_qk_dim}/{args.mla_v_dim}), {str(dtype).split('.')[-1]}: "
             "one rank's attention compute (no communication), measured")
    print(title)
    print(format_table(list(rows), ["fwd+bwd ms"], cells, corner="case"))
    print("targets (measured ratios; TE: " + source + "):")
    for name, value in targets.items():
        if not name.startswith("te_"):
            print(f"  {name}: {'-' if value is None else round(value, 3)}")
    path = write_json(NAME, {"settings": vars(args), "machine": machine_info(), "title": title,
                             "busiest_rank": busiest, "results": results, "targets": targets}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
