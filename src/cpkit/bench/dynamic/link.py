"""`python -m cpkit.bench link`: the ring link table measured, where the replay and the model read it.

One exchange of cpkit's p2p ring (cpkit.attention.comm.RingComm.exchange, the call the ring
attention makes once per step: send one packed buffer to the next rank of the CP group, receive
one from the previous, then wait) timed against bytes, at cp 2 and cp 4 (as many as there are
ranks), batched (one batch_isend_irecv) and unbatched (separate isend / irecv). Every rank of the
group exchanges at once, as in the ring. CUDA events on NCCL (`--device cuda`, one GPU per rank),
the host clock on gloo (`--device cpu`: a smoke run, not a link).

The table (`link_table_data`) fits latency + bytes / bandwidth by least squares to the points of
the mode cpkit's ring uses at each size (RingComm's default: batched at cp 2, unbatched above),
cp 2 and cp 4 together (a DPxCP-4 plan runs both); the per-mode points and fits stay in the file.
Written where they are read:
- `--out` (default bench-results/link.json): {"points": [[bytes, seconds]], ...}, what
  `python -m cpkit.bench replay --link FILE` and `dynamic_step --link FILE` read
  (cpkit.bench.dynamic.replay_timing.link_table);
- `--calibration FILE`: that calibration's "link" section is replaced in place (what the cost
  model reads: cpkit.dynamic.cost.Calibration.link; CPKIT_CALIBRATION=FILE or --calibration FILE);
  `--from LINK.json --calibration FILE` does it from a table measured before (no GPUs needed).
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
from cpkit.errors import CPConfigError, Violation

__all__ = ["BYTES", "QUICK_BYTES", "default_mode", "fit", "link_table_data", "main",
           "measure_ring_exchange", "update_calibration"]

NAME = "link"
BYTES = [1 << k for k in range(14, 29, 2)]  # 16 KiB .. 256 MiB: a ring step's KV at 4096 wide
QUICK_BYTES = [1 << 12, 1 << 16]


def default_mode(cp: int) -> str:
    """The exchange mode cpkit's ring uses at `cp` ranks (RingComm: batched for a ring of 2)."""
    return "batched" if cp <= 2 else "unbatched"


def measure_ring_exchange(nbytes, cps, warmup: int, iters: int, device) -> dict:
    """Collective (every rank calls it): {"cp<k>_<mode>": [[bytes, seconds]]} of one ring
    exchange of `nbytes` (bf16 buffers) on the group of global ranks 0..k-1, for each k in `cps`
    (<= world size) and both modes; the median over `iters` after `warmup`, the slowest rank of
    the group. Every rank returns the same dict."""
    from cpkit.attention.comm import RingComm

    rank = dist.get_rank()
    out: dict[str, list[list[float]]] = {}
    for cp in cps:
        group = dist.new_group(list(range(cp)))  # every rank calls new_group, in one order
        for mode in ("batched", "unbatched"):
            points = []
            for b in nbytes:
                secs = 0.0
                if rank < cp:
                    comm = RingComm(group, batched=mode == "batched")
                    send = torch.ones(max(1, b // 2), dtype=torch.bfloat16, device=device)
                    recv = torch.empty_like(send)
                    secs = median(time_fn(lambda: comm.exchange(send, recv).wait(), warmup=warmup,
                                          iters=iters, device=device,
                                          barrier=lambda: dist.barrier(group))) * 1e-3
                slowest = torch.tensor([secs], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                points.append([b, slowest.item()])
            out[f"cp{cp}_{mode}"] = points
    return out


def fit(points) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of [[bytes, seconds]]: the cost model's least squares."""
    from cpkit.dynamic.cost import Calibration

    return Calibration(attention=((1, 1),), gemm=((1, 1),), link=tuple(map(tuple, points))).link_fit()


def link_table_data(measurements: dict, *, device: str, origin: str) -> dict:
    """The link table JSON: "points" (the default mode of every cp, together), "latency_s" and
    "bandwidth_GBps" of their fit, "fits" per measured mode, "measurements" as measured."""
    chosen = [f"cp{k[2:].split('_')[0]}_{default_mode(int(k[2:].split('_')[0]))}"
              for k in measurements]
    keys = sorted(set(chosen), key=chosen.index)
    points = sorted(p for k in keys for p in measurements[k])
    lat, bw = fit(points)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fits = {}
    for k, pts in measurements.items():
        f_lat, f_bw = fit(pts)
        fits[k] = {"latency_s": f_lat, "bandwidth_GBps": f_bw / 1e9}
    return {
        "what": "seconds of one ring exchange (RingComm.exchange + wait: send to the next rank, "
                "receive from the previous, every rank at once) vs bytes; points: "
                + " and ".join(keys) + " (the mode cpkit's ring uses at each cp)",
        "points": points, "latency_s": lat, "bandwidth_GBps": bw / 1e9, "fits": fits,
        "measurements": measurements, "device": device,
        "source": f"{origin}, {when}, measured on {device}",
    }


def update_calibration(path: str, table: dict) -> None:
    """Replace the "link" section of the calibration at `path` with `table`'s points."""
    data = json.loads(Path(path).read_text())
    data["link"] = {"what": table["what"], "latency_s": table["latency_s"],
                    "points": table["points"], "measurements": table["measurements"],
                    "source": table["source"]}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _rank(nbytes, cps, warmup, iters):
    from cpkit.process_device import device

    return measure_ring_exchange(nbytes, cps, warmup, iters, device())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.bench link", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ranks", type=int, default=4, help="ranks (GPUs); cp 2 and 4 as far as they go")
    p.add_argument("--quick", action="store_true", help="two small sizes (smoke run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout-s", type=float, default=300.0, help="launch timeout")
    p.add_argument("--calibration", default=None, help="also replace this calibration's link section")
    p.add_argument("--out", default=None, help=f"JSON (default {DEFAULT_RESULTS_DIR}/{NAME}.json)")
    p.add_argument("--from", dest="from_file", default=None,
                   help="no measurement: take the table of this link JSON (e.g. dynamic_step's) "
                        "and write it into --calibration")
    return p


def main(argv=None) -> int:
    """Measure and write the link table; 0 on success, 2 without enough GPUs."""
    from cpkit.harness.launch import launch

    args = _parser().parse_args(list(sys.argv[2:] if argv is None else argv))
    bad = [Violation(f"--{n.replace('_', '-')}", getattr(args, n), f"must be >= {low}",
                     f"pass e.g. --{n.replace('_', '-')} {fix}")
           for n, low, fix in (("ranks", 2, 4), ("warmup", 0, 3), ("iters", 1, 10), ("timeout_s", 1, 300))
           if getattr(args, n) < low]
    if args.calibration and not Path(args.calibration).is_file():
        bad.append(Violation("--calibration", args.calibration, "must be an existing calibration file",
                             "pass a file written by python -m cpkit.bench calibrate or replay"))
    if args.from_file and not (Path(args.from_file).is_file() and args.calibration):
        bad.append(Violation("--from", args.from_file, "must be an existing link JSON, with --calibration",
                             "pass --from bench-results/link.json --calibration FILE"))
    if bad:
        raise CPConfigError(bad)
    if args.from_file:
        table = json.loads(Path(args.from_file).read_text())
        print(format_link(table))
        update_calibration(args.calibration, table)
        print(f"calibration link section replaced from {args.from_file}: {args.calibration}")
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"error: --ranks {args.ranks} needs {args.ranks} GPUs, {torch.cuda.device_count()} "
              "visible; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    cps = [c for c in (2, 4) if c <= args.ranks]
    measured = launch(_rank, args.ranks, backend="nccl" if args.device == "cuda" else "gloo",
                      timeout=args.timeout_s,
                      args=(QUICK_BYTES if args.quick else BYTES, cps, args.warmup, args.iters))[0]
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (smoke run)"
    table = link_table_data(measured, device=f"{args.ranks} x {dev}",
                            origin=f"python -m cpkit.bench link, commit {source_commit()}")
    table["machine"] = machine_info()
    print(format_link(table))
    out = Path(args.out or f"{DEFAULT_RESULTS_DIR}/{NAME}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    print(f"json: {out} (python -m cpkit.bench replay --link {out})")
    if args.calibration:
        update_calibration(args.calibration, table)
        print(f"calibration link section replaced: {args.calibration}")
    return 0


def format_link(table: dict) -> str:
    """The table as text: microseconds per size and mode, then the fits."""
    meas = table["measurements"]
    sizes = sorted({int(b) for pts in meas.values() for b, _ in pts})
    lines = ["ring exchange (us, measured)  " + "  ".join(f"{k:>14}" for k in meas)]
    for b in sizes:
        row = [dict((int(x), s) for x, s in meas[k]).get(b) for k in meas]
        lines.append(f"{b:>28} B  " + "  ".join(f"{s * 1e6:14.1f}" if s is not None else f"{'-':>14}"
                                              for s in row))
    lines.append("fit per mode: " + "; ".join(f"{k} {f['latency_s'] * 1e6:.1f} us + "
                                              f"{f['bandwidth_GBps']:.1f} GB/s"
                                              for k, f in table["fits"].items()))
    lines.append(f"link table (the ring's modes): {table['latency_s'] * 1e6:.1f} us + "
                 f"{table['bandwidth_GBps']:.1f} GB/s")
    return "\n".join(lines)
