"""`python -m cpkit.bench calibrate`: measure the speeds the step-time model reads; write its JSON.

On one GPU: causal attention (cuDNN/flash SDPA, forward + backward) vs sequence length, 128 to
128K tokens, one sequence per call and packed (32K tokens of equal sequences per call), and a layer's linear layers (QKV, output projection, MLP; forward + backward) vs
tokens. With two or more GPUs (NCCL): the ring step of cpkit's p2p attention, one exchange with
the next and previous rank, vs bytes, at cp=2 and cp=4 (as many as there are GPUs), batched
(one batch_isend_irecv) and unbatched (separate isend/irecv); the link points the model fits are
those of the largest cp in the mode cpkit's ring uses there by default (batched for a ring of 2,
separate calls for more: src/cpkit/attention/comm.py), the others are kept in the file. With one
GPU the link points of the calibration given by --base (default: the shipped one) are kept, and
the file says so.

The output (`--out`, default bench-results/calibration.json) is the format cpkit.dynamic.cost
reads: pass it with `CPKIT_CALIBRATION=FILE`, `cpkit schedule --calibration FILE`, or copy it over
src/cpkit/dynamic/calibration_h200.json to ship it. `--device cpu` runs a small smoke version
(CPU kernels, gloo ring) that checks the pipeline, not a calibration to use. A calibration held
to a measurement: `python -m cpkit.bench replay --write-calibration FILE` measures the model's
rates with the kernels the replay times (the ring's diagonal and off-diagonal calls, the
layer's GEMMs) and records how far the model then was from the replay.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cpkit.bench.common import DEFAULT_RESULTS_DIR, machine_info, median, source_commit, time_fn

__all__ = ["main", "measure_attention", "measure_gemm", "measure_packed_attention", "measure_ring"]

NAME = "calibration"
LENGTHS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
TOKENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BYTES = [1 << k for k in range(16, 29, 2)]  # 64 KiB .. 256 MiB
QUICK = dict(lengths=[128, 256, 512], tokens=[128, 256], nbytes=[1 << 12, 1 << 16])


def measure_attention(lengths, heads, kv_heads, head_dim, device, warmup, iters) -> list[list[float]]:
    """[[L, TFLOP/s]] of causal SDPA fwd+bwd (FLOPs 3.5 * 2 * h * L^2 * d)."""
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    points = []
    for L in lengths:
        q = torch.randn(1, heads, L, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, L, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, L, head_dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(1, heads, L, head_dim, device=device, dtype=dtype)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        ms = median(time_fn(step, warmup=warmup, iters=iters, device=device))
        points.append([L, 3.5 * 2 * heads * L * L * head_dim / (ms * 1e-3) / 1e12])
        del q, k, v, grad
    return points


def measure_packed_attention(lengths, tokens_per_call, heads, kv_heads, head_dim, device, warmup,
                             iters) -> list[list[float]]:
    """[[L, TFLOP/s]] of causal SDPA fwd+bwd over tokens_per_call // L sequences of L in one call
    (a batch of equal lengths: what a varlen call over a packed micro-batch of them runs)."""
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    points = []
    for L in lengths:
        if L >= tokens_per_call:
            continue  # one sequence fills the call: the single-sequence rate
        b = tokens_per_call // L
        q = torch.randn(b, heads, L, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, kv_heads, L, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, kv_heads, L, head_dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(b, heads, L, head_dim, device=device, dtype=dtype)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        ms = median(time_fn(step, warmup=warmup, iters=iters, device=device))
        points.append([L, b * 3.5 * 2 * heads * L * L * head_dim / (ms * 1e-3) / 1e12])
        del q, k, v, grad
    return points


def measure_gemm(tokens, hidden, heads, kv_heads, head_dim, device, warmup, iters) -> list[list[float]]:
    """[[T, TFLOP/s]] of one layer's linear layers fwd+bwd on T tokens (6 x params x T FLOPs)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden),
              (hidden, 4 * hidden), (4 * hidden, hidden)]
    weights = [(torch.randn(a, b, device=device, dtype=dtype) / a ** 0.5).requires_grad_()
               for a, b in shapes]
    params = sum(a * b for a, b in shapes)
    points = []
    for T in tokens:
        x = torch.randn(T, hidden, device=device, dtype=dtype, requires_grad=True)

        def step():
            qkv = x @ weights[0]
            out = qkv[:, :heads * head_dim] @ weights[1]
            y = torch.nn.functional.gelu(out @ weights[2]) @ weights[3]
            y.sum().backward()

        ms = median(time_fn(step, warmup=warmup, iters=iters, device=device))
        points.append([T, 6.0 * params * T / (ms * 1e-3) / 1e12])
    return points


def measure_ring(nbytes, cps, warmup, iters) -> dict:
    """Per rank (run under cpkit.harness.launch.launch): {"cp<k>_<mode>": [[bytes, seconds]]} of one
    ring exchange (send to the next rank of the group, receive from the previous)."""
    from cpkit.process_device import device as rank_device

    dev = rank_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for cp in cps:
        group = dist.new_group(list(range(cp)))  # every rank calls new_group, in one order
        if rank >= cp:
            dist.barrier()
            continue
        nxt, prv = (rank + 1) % cp, (rank - 1) % cp
        for batched in (True, False):
            points = []
            for b in nbytes:
                send = torch.empty(b // 2, dtype=torch.bfloat16, device=dev)
                recv = torch.empty_like(send)

                def step():
                    if batched:
                        ops = [dist.P2POp(dist.isend, send, nxt, group),
                               dist.P2POp(dist.irecv, recv, prv, group)]
                        reqs = dist.batch_isend_irecv(ops)
                    else:
                        reqs = [dist.isend(send, nxt, group), dist.irecv(recv, prv, group)]
                    for r in reqs:
                        r.wait()

                ms = median(time_fn(step, warmup=warmup, iters=iters, device=dev,
                                    barrier=lambda: dist.barrier(group)))
                points.append([b, ms * 1e-3])
            out[f"cp{cp}_{'batched' if batched else 'unbatched'}"] = points
        dist.barrier()
    del world
    return out


def main(argv=None) -> int:
    """Measure, write the calibration JSON, print a summary. Returns the exit code."""
    from cpkit.dynamic.cost import load_calibration
    from cpkit.harness.launch import launch

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench calibrate",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="a few small sizes (smoke test)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ring-ranks", type=int, default=None,
                   help="GPUs for the ring (default: all, at most 4; 1 skips it)")
    p.add_argument("--base", default=None, help="calibration whose link points are kept when "
                                                "the ring is not measured (default: shipped)")
    p.add_argument("--out", default=None, help=f"default {DEFAULT_RESULTS_DIR}/{NAME}.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device; use --device cpu for a smoke run",
              file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    lengths = QUICK["lengths"] if args.quick else LENGTHS
    tokens = QUICK["tokens"] if args.quick else TOKENS
    nbytes = QUICK["nbytes"] if args.quick else BYTES
    att = measure_attention(lengths, args.heads, args.kv_heads, args.head_dim, dev,
                            args.warmup, args.iters)
    per_call = 1024 if args.quick else 32768
    packed = measure_packed_attention(lengths, per_call, args.heads, args.kv_heads, args.head_dim,
                                      dev, args.warmup, args.iters)
    gemm = measure_gemm(tokens, args.hidden, args.heads, args.kv_heads, args.head_dim, dev,
                        args.warmup, args.iters)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    ranks = min(4, gpus) if args.ring_ranks is None else args.ring_ranks
    info = machine_info()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    origin = f"python -m cpkit.bench calibrate, {when}, commit {source_commit()}"
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (smoke run)"
    if ranks >= 2:
        cps = [c for c in (2, 4) if c <= ranks]
        rings = launch(measure_ring, ranks, backend="nccl" if args.device == "cuda" else "gloo",
                       timeout=900, args=(nbytes, cps, args.warmup, args.iters))[0]
        key = f"cp{max(cps)}_{'batched' if max(cps) == 2 else 'unbatched'}"  # cpkit's default
        link = {"what": "seconds of one ring exchange (send to next, receive from previous) vs "
                        "bytes", "points": rings[key], "measurements": rings,
                "source": f"{origin}: {key} ({ranks} x {device_name})"}
    else:
        base = load_calibration(args.base)
        link = {"what": "kept from the base calibration (ring not measured: one GPU)",
                "latency_s": base.link_latency_s, "points": [list(p) for p in base.link],
                "source": f"kept from {args.base or 'the shipped calibration'}"}
    data = {
        "format": 1,
        "device": device_name,
        "software": f"torch {info['torch']}, megatron-core {info.get('megatron_core')}",
        "machine": info,
        "attention": {"what": "single-GPU causal SDPA, forward + backward, b=1, TFLOP/s with "
                              "FLOPs = 3.5 * 2 * heads * L^2 * head_dim",
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "points": att, "source": origin},
        "attention_packed": {"what": f"the same kernel over {per_call} // L sequences of L tokens in "
                                     "one call (a packed micro-batch's varlen call), TFLOP/s",
                             "tokens_per_call": per_call, "points": packed, "source": origin},
        "gemm": {"what": f"a {args.hidden}-wide layer's linear layers (QKV, output projection, "
                         f"4x MLP), forward + backward, TFLOP/s vs tokens",
                 "hidden_size": args.hidden, "points": gemm, "source": origin},
        "link": link,
    }
    out = Path(args.out) if args.out else Path(DEFAULT_RESULTS_DIR) / f"{NAME}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    load_calibration(out)  # the model can read what was written
    print("attention TFLOP/s: " + ", ".join(f"{int(L)}: {r:.4g}" for L, r in att))
    print("packed attention TFLOP/s: " + ", ".join(f"{int(L)}: {r:.4g}" for L, r in packed))
    print("GEMM TFLOP/s: " + ", ".join(f"{int(T)}: {r:.4g}" for T, r in gemm))
    print("link: " + ", ".join(f"{int(b)} B: {s * 1e6:.1f} us" for b, s in link["points"]))
    print(f"calibration: {out}")
    return 0
