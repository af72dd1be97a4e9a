"""Seconds of a replayed group pass from per-call kernel times and a link table.

Pure Python: the kernel times come from a timer (`KernelTimer` in cpkit.bench.dynamic.replay_kernels on
a GPU, `AnalyticTimer` here for CPU tests). A timer answers, per layer:
`layers(tokens)` -> seconds of the layer's GEMMs forward + backward over that many local tokens,
and `call(AttnCall)` -> (forward s, backward s) of one ring step's attention call.

A pass of a CP group of c ranks (cpkit.bench.dynamic.replay_work.GroupPass), per layer:
- compute: the GEMMs over the group's local tokens, plus, per ring step, the slowest rank's
  attention call of that step (every rank waits for its ring neighbour's KV before the next
  step), forward and backward;
- communication (modeled from the link table, never measured here): each ring exchange is posted
  before the step's attention and waited for after it, so only max(0, transfer - that step's
  attention) is exposed. Forward: c - 1 exchanges of the group's K and V; backward: c exchanges
  (cpkit.attention.p2p.ring_backward): the first carries K and V, the middle ones K, V, dK and
  dV, the last dK and dV only.
Both are times the number of layers; the pass takes compute + exposed communication.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from cpkit.bench.dynamic.replay_work import AttnCall, GroupPass
from cpkit.errors import CPConfigError

__all__ = ["AnalyticTimer", "LINKS", "LinkTable", "PassTime", "Timer", "link_table", "pass_time"]


class Timer(Protocol):
    """Per-layer kernel seconds (module docstring)."""

    def layers(self, tokens: int) -> float: ...

    def call(self, call: AttnCall) -> tuple[float, float]: ...


@dataclass(frozen=True)
class LinkTable:
    """Seconds of one ring transfer vs bytes: latency_s + bytes / bandwidth (fitted to points)."""

    name: str
    latency_s: float
    bandwidth: float  # bytes per second
    source: str

    def time(self, nbytes: float) -> float:
        """Seconds of one transfer of `nbytes` (0 for none)."""
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth

    def to_dict(self) -> dict:
        return {"name": self.name, "latency_s": self.latency_s, "bandwidth_GBps": self.bandwidth / 1e9,
                "source": self.source}


#: Built-in link tables. "nvlink": one NVLink ring step as the 4x H200 evidence measured it
#: (64 MiB in 228 us: the shipped calibration's link point, evidence/2026-11-21-4xH200-f8952ee),
#: with its assumed 20 us latency. "ib": CP across nodes, one 400 Gb/s NIC per GPU: 45 GB/s and
#: 25 us per transfer, assumed (typical NCCL send/recv over InfiniBand NDR), not measured.
LINKS = {
    "nvlink": LinkTable("nvlink", 20e-6, 67108864 / (228.137e-6 - 20e-6),
                        "4x H200 NVLink ring step, evidence/2026-11-21-4xH200-f8952ee (20 us latency assumed)"),
    "ib": LinkTable("ib", 25e-6, 45e9, "assumed: 400 Gb/s InfiniBand per GPU, 45 GB/s, 25 us"),
}


def link_table(spec: str) -> LinkTable:
    """A built-in table by name (LINKS) or a JSON file {"points": [[bytes, seconds], ...]}
    (two or more sizes: least-squares latency and bandwidth; one point: 20 us latency)."""
    if spec in LINKS:
        return LINKS[spec]
    try:
        with open(spec, encoding="utf-8") as f:
            pts = [(float(b), float(s)) for b, s in json.load(f)["points"]]
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise CPConfigError.single("link", spec, f"is neither {sorted(LINKS)} nor a readable JSON "
                                   f"file with points [[bytes, seconds]] ({err})",
                                   "pass --link nvlink, --link ib or such a file") from None
    from cpkit.dynamic.cost import Calibration

    lat, bw = Calibration(attention=((1, 1),), gemm=((1, 1),), link=tuple(pts)).link_fit()
    return LinkTable(spec, lat, bw, f"fitted to {spec}")


@dataclass(frozen=True)
class PassTime:
    """Seconds of one group pass, all layers: compute (measured kernels) and exposed
    communication (modeled from the link table)."""

    compute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def _exchange_tokens(step: int, c: int, forward: bool) -> int:
    """Multiples of the group's KV bytes that ring step `step` sends (module docstring)."""
    if forward:
        return 1 if step < c - 1 else 0
    if c == 1:
        return 0
    return 1 if step in (0, c - 1) else 2


@dataclass(frozen=True)
class AnalyticTimer:
    """A stand-in timer for CPU tests: GEMMs at `gemm_flops` FLOP/s plus `launch_s`, attention
    at `attn_flops` FLOP/s (fwd 1/3.5 of fwd+bwd) plus `launch_s` per call."""

    linear_flops_per_token: float = 6.0 * 4096 * 4096 * 12
    heads: int = 32
    head_dim: int = 128
    gemm_flops: float = 600e12
    attn_flops: float = 400e12
    launch_s: float = 20e-6

    def layers(self, tokens: int) -> float:
        return self.launch_s + tokens * self.linear_flops_per_token / self.gemm_flops

    def call(self, call: AttnCall) -> tuple[float, float]:
        pairs = sum(q * k for q, k in zip(call.q_lens, call.k_lens)) / (2 if call.causal else 1)
        total = 3.5 * 4.0 * self.heads * self.head_dim * pairs / self.attn_flops
        return self.launch_s + total / 3.5, self.launch_s + total * 2.5 / 3.5


def pass_time(p: GroupPass, timer: Timer, link: LinkTable, *, num_layers: int,
              kv_bytes_per_token: int) -> PassTime:
    """Seconds of group pass `p` (module docstring); `kv_bytes_per_token`: K and V of one local
    token, all KV heads, in bytes."""
    c = p.cp_size
    kv_bytes = p.tokens * kv_bytes_per_token
    compute = timer.layers(p.tokens)
    exposed = 0.0
    for step in range(c):
        fwd = max(timer.call(w.forward[step])[0] for w in p.work)
        bwd = max(timer.call(w.backward[step])[1] for w in p.work)
        compute += fwd + bwd
        for attn, fwd_dir in ((fwd, True), (bwd, False)):
            mult = _exchange_tokens(step, c, fwd_dir)
            if mult:
                exposed += max(0.0, link.time(mult * kv_bytes) - attn)
    return PassTime(compute_s=num_layers * compute, comm_s=num_layers * exposed)
