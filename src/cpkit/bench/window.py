"""`python -m cpkit.bench window`: sliding-window attention compute per CP rank, on one device.

For a causal window of `--window` tokens over `--seq` tokens at CP size `--cp` (b=1), times the
attention forward + backward that ONE rank computes (median of `--iters` after `--warmup`):

- `cpkit p2p, window`: the slowest rank's live ring blocks (`band.Band.block`; blocks wholly
  outside the window skipped), each through `band_fwd` / `band_bwd` (FlexAttention on CUDA);
- `cpkit p2p, no window`: the same rank's ring blocks of plain causal attention (the dense
  kernels), what the window saves;
- `cpkit a2a, window`: after the all-to-all a rank holds every token and heads/cp heads:
  `band_fwd` / `band_bwd` over the whole sequence;
- `TE a2a, window`: Transformer Engine's DotProductAttention with `window_size` on the same
  per-rank shape (when TE imports).

Communication is not in these numbers (p2p passes KV around the ring in cp-1 steps, a2a does
four all-to-alls); on one device they cannot be measured. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from cpkit.attention.band import Band, Window, band_bwd, band_fwd
from cpkit.attention.chunks import local_seq
from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.bench.common import (add_common_args, format_table, machine_info, median,
                                short_error, time_fn, write_json)

__all__ = ["main"]

NAME = "window"


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype, device):
    q = torch.randn(tokens, 1, heads, dim, dtype=dtype, device=device)
    k, v = (torch.randn(tokens, 1, kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
    return q, k, v


def _band_step(make_band, sources: list[int], q, k, v, scale: float):
    """Forward then backward of every live block (the block's own output stands in for the
    merged one: the time is the same); the Band is built per step, as per attention call."""
    def step():
        band = make_band()
        blocks = [band.block(src) for src in sources]
        outs = [band_fwd(q, k, v, b, scale) for b in blocks if b is not None]
        for b, (o, lse) in zip([b for b in blocks if b is not None], outs):
            band_bwd(o, q, k, v, o, lse, b, scale)
    return step


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


def main(argv=None) -> int:
    """Run the benchmark; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m cpkit.bench window", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072, help="total tokens (default 131072)")
    parser.add_argument("--cp", type=int, default=4, help="CP size (default 4)")
    parser.add_argument("--window", type=int, default=4096, help="causal window in tokens (default 4096)")
    parser.add_argument("--heads", type=int, default=64, help="query heads (default 64, gpt-oss)")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    add_common_args(parser, warmup=2, iters=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.window, args.heads, args.kv_heads, args.head_dim = 512, 32, 4, 2, 16
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cp, scale = args.cp, args.head_dim ** -0.5
    tokens = args.seq // cp
    seq = local_seq(tokens, cp)
    win = Window(args.window - 1, None)
    bands = [Band(win, True, seq, r, device) for r in range(cp)]
    busiest = max(range(cp), key=lambda r: _live_blocks(bands[r], cp))
    local = _qkv(tokens, args.heads, args.kv_heads, args.head_dim, dtype, device)
    heads_a2a, kv_a2a = args.heads // cp, max(args.kv_heads // cp, 1)
    whole = _qkv(args.seq, heads_a2a, kv_a2a, args.head_dim, dtype, device)
    rows = {
        f"cpkit p2p, window (rank {busiest}: {_live_blocks(bands[busiest], cp)} of {cp} blocks)":
            lambda: _band_step(lambda: Band(win, True, seq, busiest, device), list(range(cp)), *local, scale),
        f"cpkit p2p, no window (rank {busiest})": lambda: _dense_ring_step(busiest, cp, *local, scale),
        "cpkit a2a, window": lambda: _band_step(lambda: Band(win, True, local_seq(args.seq, 1), 0, device), [0],
                                                *whole, scale),
        "TE a2a, window": lambda: _te_step(args.seq, heads_a2a, kv_a2a, args.head_dim, args.window, dtype, device),
    }
    cells, results = {}, []
    for label, build in rows.items():
        try:
            times = time_fn(build(), warmup=args.warmup, iters=args.iters, device=device)
            ms = median(times)
            cells[(label, "fwd+bwd ms")] = f"{ms:.2f}"
            results.append({"case": label, "ms": ms, "times_ms": times})
        except Exception as exc:  # noqa: BLE001 - one failing cell must not end the table
            cells[(label, "fwd+bwd ms")] = short_error(exc)
            results.append({"case": label, "error": traceback.format_exc()})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    title = (f"sliding window {args.window} at {args.seq} tokens, cp={cp}, heads {args.heads}/{args.kv_heads}, "
             f"head dim {args.head_dim}, {str(dtype).split('.')[-1]}: one rank's attention compute "
             "(no communication)")
    print(title)
    print(format_table(list(rows), ["fwd+bwd ms"], cells, corner="case"))
    path = write_json(NAME, {"settings": vars(args), "machine": machine_info(), "title": title,
                             "results": results}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
