"""Shared benchmark helpers: timing, result tables, JSON output, machine description.

Timing: `time_fn` runs warm-ups, then times each iteration with CUDA events on GPUs (host
clock on CPU), with an optional barrier before each iteration so ranks start together, and
returns the per-iteration milliseconds; `median` summarizes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "add_common_args",
    "parse_int_list",
    "parse_str_list",
    "time_fn",
    "median",
    "format_table",
    "write_json",
    "loaded_code",
    "source_commit",
    "pyplot",
    "PLOT_SKIPPED",
    "machine_info",
    "short_error",
    "profile_table",
    "append_profile",
]

DEFAULT_RESULTS_DIR = "bench-results"


def parse_int_list(text: str) -> list[int]:
    """"32768,65536" -> [32768, 65536]; accepts a K suffix ("32K")."""
    out = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        mult = 1024 if piece[-1] in "kK" else 1
        out.append(int(piece.rstrip("kK")) * mult)
    return out


def parse_str_list(text: str) -> list[str]:
    """"p2p,a2a" -> ["p2p", "a2a"]."""
    return [p.strip() for p in text.split(",") if p.strip()]


def add_common_args(parser: argparse.ArgumentParser, *, warmup: int = 3, iters: int = 10,
                    profile: bool = False) -> None:
    """--warmup, --iters, --out, --quick, --device (and --profile FILE with `profile`) for a
    benchmark's argument parser."""
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed iterations first")
    parser.add_argument("--iters", type=int, default=iters, help="timed iterations (median reported)")
    parser.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_RESULTS_DIR}/<name>.json)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations")
    if profile:
        parser.add_argument("--profile", default=None, metavar="FILE",
                            help="also profile each cell (torch.profiler, after the timing) and "
                                 "append its top ops by device time to FILE")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="cuda (NCCL, one GPU per rank) or cpu (gloo, tiny smoke run)",
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int,
    iters: int,
    device: torch.device,
    barrier: Optional[Callable[[], None]] = None,
) -> list[float]:
    """Run `fn` `warmup` times untimed, then `iters` times timed; return milliseconds per iteration.

    On CUDA each iteration is timed with a pair of CUDA events on the current stream (after a
    synchronize and the optional `barrier`, so ranks start together); on CPU with the host clock.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        _sync(device)
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile_table(fn: Callable[[], Any], *, iters: int, device: torch.device, title: str,
                  row_limit: int = 20, trace_path: Optional[str] = None) -> str:
    """Run `fn` `iters` times under torch.profiler (after one untimed call) and return a text
    block: `title`, host milliseconds per iteration, and the ops sorted by their own device time
    and by their own host time. With `trace_path`, also write the Chrome trace there (the
    tables sum kernel times; only the timeline shows which communication is exposed). Every rank
    that `fn` communicates with must call it too."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities):  # the profiler's first set-up (CUPTI) stays out of the numbers
        pass
    fn()
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        _sync(device)
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    if trace_path:
        prof.export_chrome_trace(trace_path)
    averages = prof.key_averages()
    text = f"=== {title}: {iters} iterations, {host_ms:.2f} ms host time per iteration (profiled)\n"
    # By device time: where the GPU is busy. By host time: what keeps the host (and, when it is
    # the bottleneck, the GPU) waiting, e.g. syncs, allocations, Python-side work.
    for sort in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        text += f"--- sorted by {sort}\n"
        text += averages.table(sort_by=sort, row_limit=row_limit, max_name_column_width=70) + "\n"
    return text


def append_profile(path: str, fn: Callable[[], Any], *, iters: int, device: torch.device, title: str) -> None:
    """profile_table of `fn` on this rank (every rank of `fn`'s groups must call it), appended to
    `path` by global rank 0 only (or by the process itself when not distributed). Every rank
    also writes its Chrome trace as `<path>.<title>.rank<r>.trace.json` (the title with runs of
    other characters than letters, digits, '.', '-' made '_'): with pipeline stages, the slowest
    stage is seldom rank 0."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    trace = f"{path}.{re.sub(r'[^A-Za-z0-9.-]+', '_', title).strip('_')}.rank{rank}.trace.json"
    text = profile_table(fn, iters=iters, device=device, title=title, trace_path=trace)
    if rank == 0:
        with open(path, "a") as fh:
            fh.write(text)


def median(values: Iterable[float]) -> float:
    """The median of `values` (NaN when empty)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def short_error(exc: BaseException, limit: int = 60) -> str:
    """"error: <Type>: <first line>" cut to `limit` characters, for a table cell."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"error: {type(exc).__name__}: {first}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_table(
    row_labels: Sequence[str],
    columns: Sequence[str],
    cells: dict[tuple[str, str], str],
    *,
    corner: str = "",
) -> str:
    """A plain-text table: one row per label, one column per name; missing cells are "-"."""
    header = [corner] + list(columns)
    rows = [[label] + [cells.get((label, c), "-") for c in columns] for label in row_labels]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(
            (r[i].ljust(widths[i]) if i == 0 else r[i].rjust(widths[i])) for i in range(len(r))
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def write_json(name: str, payload: dict, out: Optional[str] = None) -> Path:
    """Write `payload` to `out`, or to bench-results/<name>.json; return the path. The payload
    gains `code`: the cpkit source files this process loaded, so a claim made from the JSON is
    held to the code that ran (src/cpkit/cards/claim_scope.py)."""
    payload = {**payload, "code": payload.get("code") or loaded_code()}
    path = Path(out) if out else Path(DEFAULT_RESULTS_DIR) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return path


def loaded_code() -> list[str]:
    """The source paths (src/cpkit/...) of the cpkit modules this process has loaded, sorted."""
    root = Path(__file__).resolve().parents[3]
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] == "cpkit" and path and Path(path).resolve().is_relative_to(root):
            out.append(Path(path).resolve().relative_to(root).as_posix())
    return sorted(out)


#: Environment variables recorded by `machine_info` (by prefix).
RECORDED_ENV_PREFIXES = ("CPKIT_", "NCCL_", "NVTE_", "TORCH_NCCL_")


def machine_info() -> dict:
    """Versions and devices of this machine, recorded next to every benchmark result."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
    }
    try:
        from megatron.core import package_info

        info["megatron_core"] = package_info.__version__
    except Exception:  # noqa: BLE001 - informational only
        info["megatron_core"] = None
    try:  # cpkit.attention.te reads MCore; a benchmark without it (hybrid) records no TE
        from cpkit.attention.te import te_version

        info["transformer_engine"] = te_version()
    except ImportError:
        info["transformer_engine"] = None
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            info["cudnn"] = None
    else:
        info["gpu_count"] = 0
    # The knobs that change what is measured (cpkit's comm modes, NCCL, TE), so an A/B's JSON
    # says which side it is.
    info["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV_PREFIXES)}
    from cpkit.upstream.checkouts import upstream_identities

    upstream = upstream_identities()  # the commit, or the content of a copy without .git
    if upstream:
        info["upstream"] = upstream
    return info


PLOT_SKIPPED = "plot skipped: matplotlib is not installed (pip install matplotlib, or pip install -e '.[plot]' in a checkout)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed
    (plots are optional: `pip install matplotlib`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def source_commit() -> str | None:
    """The short commit of the checkout the benchmark runs from, or None outside a git checkout
    (a copied tree) or without git: the evidence names its commit by hand then."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - informational only
        return None
