"""Step-time cost model of dynamic CP: seconds per rank from measured kernel and link speeds.

One CP group of c ranks runs a packed micro-batch of samples; each sample of length L is cut into
c chunks of l = ceil(L / c) tokens. Per rank and per layer, forward + backward:

- linear layers (QKV, output projection, MLP): their FLOPs on the rank's T = sum(l) tokens at the
  GEMM rate measured for T tokens (`gemm`): short micro-batches run the GEMMs slowly;
- attention: a packed micro-batch is one varlen kernel call per ring step over the chunks of all
  its samples (cpkit's THD path), so short samples share a call instead of each paying a launch.
  A call over T tokens in sequences (chunks) of l tokens runs at `rate(l, T)`: the single-sequence
  rate (`attention`, b=1) when T = l, the packed rate (`attention_packed`, many sequences of l
  filling `tokens_per_call` tokens) from T = tokens_per_call on, log-linear in T between; a call
  takes at least one launch (the single call at the smallest measured length). p2p and
  all_gather run c such calls (one per ring step) on chunks of l = ceil(L / c); a2a runs one
  call on whole samples with heads / c. Without `attention_packed` the single rate is used;
- exposed CP communication (`link`: latency + bytes / bandwidth per transfer):
  p2p: c - 1 ring steps; each step sends the group's KV chunks forward (K and V) and KV + dKV
  backward; a step hides behind that step's attention (forward 1/3.5 of the kernel time,
  backward 2.5/3.5), so only max(0, transfer - attention) is paid;
  all_gather: the same bytes as c - 1 ring steps, none hidden (the gather precedes attention);
  a2a: Q, K, V and the output, (c - 1) / c of each, forward and backward, none hidden.
- c = 1: no communication.

The step time of a plan follows a step rule (cpkit.dynamic.step_rules, shared with the replay
`python -m cpkit.bench replay`): "free" at PP = 1, where a rank runs its micro-batches in order
and a group starts when all its ranks are free; "lockstep" where micro-batches end together (MCore's
schedule, which waits after every micro-batch, and the pipeline at PP > 1).
The ring's first step is the causal diagonal block, the other c - 1 the unmasked off-diagonal
blocks (their own rates where the calibration has `attention_offdiag`); chunks are the runtime's:
each sample padded to a multiple of 2c.

Calibration (`Calibration`, JSON): attention TFLOP/s vs sequence length (FLOPs 3.5 * 2 * h * L^2
* d, causal fwd+bwd, the convention of cpkit.bench.attention.attention), GEMM TFLOP/s vs tokens, and link
seconds vs bytes (from which latency and bandwidth are fitted). Rates are interpolated linearly in
log-log between points and held constant above the largest; below the smallest, the time of the
smallest is kept (short calls are launch-bound: a shorter one is no faster). The shipped file
(`cpkit/dynamic/calibration_h200.json`) says where each number comes from; `python -m cpkit.bench
calibrate` writes a new one; `CPKIT_CALIBRATION=FILE` or `load_calibration(FILE)` picks it.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

from cpkit.dynamic.step_rules import step_end
from cpkit.errors import CPConfigError, Violation

__all__ = [
    "CALIBRATION_ENV",
    "COMM_TYPES",
    "Calibration",
    "CostModel",
    "ModelDims",
    "default_cost_model",
    "load_calibration",
    "replay_check_line",
    "shipped_calibration_path",
]

CALIBRATION_ENV = "CPKIT_CALIBRATION"
COMM_TYPES = ("p2p", "all_gather", "a2a")
_SHIPPED = "calibration_h200.json"
_FWD_SHARE = 1.0 / 3.5  # forward share of causal fwd+bwd attention time (backward = 2.5 x forward)


def _attention_flops(tokens: float, heads: int, head_dim: int) -> float:
    """Causal forward + backward attention FLOPs of one sequence (cpkit.bench.attention.attention's
    convention)."""
    return 3.5 * 2.0 * heads * tokens * tokens * head_dim


class _LogLogCurve:
    """Rate (FLOP/s) vs size, linear in log-log between measured points, constant beyond them."""

    def __init__(self, points: Sequence[tuple[float, float]], what: str):
        pts = sorted((float(x), float(y)) for x, y in points)
        bad = [p for p in pts if not (p[0] > 0 and p[1] > 0 and math.isfinite(p[1]))]
        if len(pts) < 1 or bad or len({x for x, _ in pts}) != len(pts):
            raise CPConfigError.single(
                what, points, "must be a non-empty list of [size, rate] pairs, sizes distinct, "
                "both > 0", "re-run python -m cpkit.bench calibrate")
        self.xs = [math.log(x) for x, _ in pts]
        self.ys = [math.log(y) for _, y in pts]

    @property
    def smallest(self) -> float:
        """The smallest measured size."""
        return math.exp(self.xs[0])

    def __call__(self, x: float) -> float:
        lx = math.log(max(x, 1e-9))
        xs, ys = self.xs, self.ys
        if lx <= xs[0]:
            return math.exp(ys[0])
        if lx >= xs[-1]:
            return math.exp(ys[-1])
        j = bisect.bisect_right(xs, lx)
        t = (lx - xs[j - 1]) / (xs[j] - xs[j - 1])
        return math.exp(ys[j - 1] + t * (ys[j] - ys[j - 1]))


@dataclass(frozen=True)
class Calibration:
    """Measured speeds the model reads (see the module docstring for the units).

    attention: [[seq_len, TFLOP/s]] of single-GPU causal fwd+bwd attention with
        `attention_heads` query heads of `attention_head_dim`, one sequence per call.
    attention_packed: [[seq_len, TFLOP/s]] of the same kernel over many sequences of seq_len in
        one call of `attention_tokens_per_call` tokens (empty: not measured, single rates used).
    gemm: [[tokens, TFLOP/s]] of a layer's linear layers (fwd+bwd) on that many tokens.
    link: [[bytes, seconds]] of one CP transfer (a ring step's send and receive) between two
        GPUs of the group; latency and bandwidth are fitted by least squares (one point: the
        `link_latency_s` given, bandwidth from the point).
    attention_offdiag / attention_offdiag_packed: [[seq_len, TFLOP/s]] of the ring's unmasked
        off-diagonal block of a sample of seq_len local tokens (q: seq_len against half of it,
        the same FLOPs as the causal seq_len), single and packed (empty: the causal rates).
    attention_packed_small / attention_offdiag_packed_small: the packed rates at
        `attention_small_tokens_per_call` tokens per call (empty: interpolated from single to
        packed); a call's rate is log-linear in its tokens between these anchors.
    """

    attention: tuple[tuple[float, float], ...]
    gemm: tuple[tuple[float, float], ...]
    link: tuple[tuple[float, float], ...]
    attention_heads: int = 32
    attention_head_dim: int = 128
    link_latency_s: float = 20e-6
    attention_packed: tuple[tuple[float, float], ...] = ()
    attention_tokens_per_call: int = 32768
    attention_offdiag: tuple[tuple[float, float], ...] = ()
    attention_offdiag_packed: tuple[tuple[float, float], ...] = ()
    attention_packed_small: tuple[tuple[float, float], ...] = ()
    attention_offdiag_packed_small: tuple[tuple[float, float], ...] = ()
    attention_small_tokens_per_call: int = 4096
    source: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, data: dict, origin: str = "calibration") -> "Calibration":
        """Build from the JSON form; raises CPConfigError naming a missing or malformed key."""
        bad = []
        for key in ("attention", "gemm", "link"):
            v = data.get(key)
            ok = isinstance(v, dict) and isinstance(v.get("points"), list) and v["points"]
            if not ok:
                bad.append(Violation(f"{origin}.{key}.points", v, "must be a non-empty list",
                                     "re-run python -m cpkit.bench calibrate"))
        if bad:
            raise CPConfigError(bad)
        att, link = data["attention"], data["link"]
        packed = data.get("attention_packed") or {}
        offdiag = data.get("attention_offdiag") or {}
        return cls(
            attention_offdiag=tuple(tuple(p) for p in offdiag.get("points", ())),
            attention_offdiag_packed=tuple(tuple(p) for p in offdiag.get("packed_points", ())),
            attention_packed_small=tuple(tuple(p) for p in packed.get("small_points", ())),
            attention_offdiag_packed_small=tuple(tuple(p) for p in offdiag.get("packed_small_points", ())),
            attention_small_tokens_per_call=int(packed.get("small_tokens_per_call", 4096)),
            attention_packed=tuple(tuple(p) for p in packed.get("points", ())),
            attention_tokens_per_call=int(packed.get("tokens_per_call", 32768)),
            attention=tuple(tuple(p) for p in att["points"]),
            gemm=tuple(tuple(p) for p in data["gemm"]["points"]),
            link=tuple(tuple(p) for p in link["points"]),
            attention_heads=int(att.get("heads", 32)),
            attention_head_dim=int(att.get("head_dim", 128)),
            link_latency_s=float(link.get("latency_s", 20e-6)),
            source={k: v for k, v in data.items()
                    if k not in ("attention", "attention_packed", "attention_offdiag", "gemm", "link")},
        )

    def link_fit(self) -> tuple[float, float]:
        """(latency in s, bandwidth in bytes/s) of the link points: a least-squares line of
        seconds vs bytes with two or more sizes, else the given latency and the point's slope."""
        pts = [(float(b), float(s)) for b, s in self.link]
        if len({b for b, _ in pts}) >= 2:
            n = len(pts)
            mb = sum(b for b, _ in pts) / n
            ms = sum(s for _, s in pts) / n
            slope = sum((b - mb) * (s - ms) for b, s in pts) / sum((b - mb) ** 2 for b, _ in pts)
            latency = max(0.0, ms - slope * mb)
            return latency, 1.0 / slope if slope > 0 else math.inf
        b, s = pts[0]
        latency = min(self.link_latency_s, s)
        return latency, b / (s - latency) if s > latency else math.inf


def shipped_calibration_path() -> Path:
    """Path of the calibration file shipped in the package (H200 measurements)."""
    return Path(str(resources.files("cpkit.dynamic").joinpath(_SHIPPED)))


def load_calibration(path: str | os.PathLike | None = None) -> Calibration:
    """The calibration at `path`, else at $CPKIT_CALIBRATION, else the shipped one.

    Raises CPConfigError naming the file when it cannot be read or is malformed.
    """
    chosen = path or os.environ.get(CALIBRATION_ENV) or shipped_calibration_path()
    field_name = "calibration" if path else (CALIBRATION_ENV if os.environ.get(CALIBRATION_ENV)
                                             else "calibration")
    try:
        with open(chosen, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise CPConfigError.single(field_name, str(chosen), f"cannot be read ({err.strerror})",
                                   "pass a file written by python -m cpkit.bench calibrate") from None
    except json.JSONDecodeError as err:
        raise CPConfigError.single(field_name, str(chosen), f"is not JSON ({err.msg})",
                                   "pass a file written by python -m cpkit.bench calibrate") from None
    if not isinstance(data, dict):
        raise CPConfigError.single(field_name, str(chosen), "must hold a JSON object",
                                   "pass a file written by python -m cpkit.bench calibrate")
    return Calibration.from_dict(data, origin=str(chosen))


@dataclass(frozen=True)
class ModelDims:
    """The transformer a plan trains: sizes that set FLOPs and bytes per token.

    Defaults: a 4096-wide GPT layer with 32 query / 8 KV heads of 128 (the calibration's
    shapes), a 4 x hidden MLP, 32 layers, bf16 activations.
    """

    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    num_layers: int = 32
    ffn_hidden_size: int | None = None
    bytes_per_element: int = 2
    gated_linear_unit: bool = False

    def __post_init__(self):
        bad = [Violation(name, getattr(self, name), "must be an int >= 1", "pass e.g. 4096")
               for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_layers",
                            "bytes_per_element")
               if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1)]
        if self.ffn_hidden_size is not None and not (
                isinstance(self.ffn_hidden_size, int) and self.ffn_hidden_size >= 1):
            bad.append(Violation("ffn_hidden_size", self.ffn_hidden_size,
                                 "must be None or an int >= 1", "pass e.g. 16384"))
        if bad:
            raise CPConfigError(bad)

    @property
    def linear_flops_per_token(self) -> float:
        """Forward + backward FLOPs of one layer's linear layers per token (3 x 2 x params)."""
        h, d = self.hidden_size, self.head_dim
        ffn = self.ffn_hidden_size or 4 * h
        mlp = (3 if self.gated_linear_unit else 2) * h * ffn  # SwiGLU: two input projections
        params = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + mlp
        return 6.0 * params


class CostModel:
    """Modeled seconds per rank of CP groups and plans (definitions: module docstring).

    dims: the model (ModelDims). calibration: Calibration (default: load_calibration()).
    comm_type: "p2p" (default), "all_gather" or "a2a".
    """

    def __init__(self, dims: ModelDims | None = None, calibration: Calibration | None = None,
                 comm_type: str = "p2p"):
        if comm_type not in COMM_TYPES:
            raise CPConfigError.single("comm_type", comm_type, f"must be one of {COMM_TYPES}",
                                       "pass p2p, all_gather or a2a")
        self.dims = dims or ModelDims()
        self.calibration = calibration or load_calibration()
        self.comm_type = comm_type
        cal = self.calibration
        self._attention_rate = _LogLogCurve(cal.attention, "attention.points")
        self._packed_rate = (_LogLogCurve(cal.attention_packed, "attention_packed.points")
                             if cal.attention_packed else None)
        self._off_rate = (_LogLogCurve(cal.attention_offdiag, "attention_offdiag.points")
                          if cal.attention_offdiag else None)
        self._off_packed_rate = (_LogLogCurve(cal.attention_offdiag_packed,
                                              "attention_offdiag.packed_points")
                                 if cal.attention_offdiag_packed else None)
        self._small_rate = (_LogLogCurve(cal.attention_packed_small, "attention_packed.small_points")
                            if cal.attention_packed_small else None)
        self._off_small_rate = (_LogLogCurve(cal.attention_offdiag_packed_small,
                                             "attention_offdiag.packed_small_points")
                                if cal.attention_offdiag_packed_small else None)
        self._launch_s = self._attention_time_uncached(int(self._attention_rate.smallest))
        self._gemm_rate = _LogLogCurve(cal.gemm, "gemm.points")
        _LogLogCurve([(b, s) for b, s in cal.link], "link.points")  # validates
        self.link_latency_s, self.link_bandwidth = cal.link_fit()
        d = self.dims
        self._kv_bytes_per_token = 2 * d.num_kv_heads * d.head_dim * d.bytes_per_element
        self._qkvo_bytes_per_token = (2 * d.num_heads + 2 * d.num_kv_heads) * d.head_dim * d.bytes_per_element
        self._linear_flops_per_token = d.linear_flops_per_token
        # Plans repeat lengths and chunk sizes: cache the calibrated primitives per token count.
        self._attention_time = lru_cache(maxsize=1 << 17)(self._attention_time_uncached)
        self._gemm_time = lru_cache(maxsize=1 << 17)(self._gemm_time_uncached)
        self._sample_time = lru_cache(maxsize=1 << 17)(self._sample_time_uncached)
        # a scheduler times a group while building it and again when timing the plan
        self._group_time = lru_cache(maxsize=1 << 16)(self._group_time_uncached)
        self._estimates: dict[tuple[int, int, int], float] = {}

    # ---------------------------------------------------------------- calibrated primitives

    def _attention_time_uncached(self, tokens: int) -> float:
        d = self.dims
        tokens = max(tokens, self._attention_rate.smallest)  # launch-bound below the smallest
        flops = _attention_flops(tokens, d.num_heads, d.head_dim)
        return flops / (self._attention_rate(tokens) * 1e12)

    def attention_time(self, tokens: int) -> float:
        """Seconds of one causal fwd+bwd attention call over `tokens` on one GPU (one layer)."""
        return self._attention_time(int(tokens))

    def _rate(self, length: int, call_tokens: int, offdiag: bool = False) -> float:
        """TFLOP/s of sequences of `length` in a call of `call_tokens` tokens (module docstring);
        `offdiag`: the ring's unmasked off-diagonal block, where calibrated. Log-linear in the
        call's tokens between the anchors: one sequence (the single rate), the small packed call
        and the full packed call (where calibrated), constant beyond the last."""
        single_curve, packed_curve, small_curve = (self._attention_rate, self._packed_rate,
                                                   self._small_rate)
        if offdiag and self._off_rate is not None:
            single_curve, packed_curve, small_curve = (self._off_rate, self._off_packed_rate,
                                                       self._off_small_rate)
        single = single_curve(length)
        full = self.calibration.attention_tokens_per_call
        if packed_curve is None or call_tokens <= length or length >= full:
            return single
        anchors = [(length, single)]
        small = self.calibration.attention_small_tokens_per_call
        if small_curve is not None and length < small < full:
            anchors.append((small, small_curve(length)))
        anchors.append((full, packed_curve(length)))
        for (x0, y0), (x1, y1) in zip(anchors, anchors[1:]):
            if call_tokens <= x1:
                share = math.log(call_tokens / x0) / math.log(x1 / x0)
                return math.exp(math.log(y0) + share * (math.log(y1) - math.log(y0)))
        return anchors[-1][1]

    def call_time(self, lengths: Sequence[int], heads_share: float = 1.0,
                  offdiag: bool = False) -> float:
        """Seconds of one varlen causal fwd+bwd attention call over sequences of `lengths`
        (one layer), with `heads_share` of the model's heads (a2a: 1 / c); at least one launch.
        `offdiag`: the ring's off-diagonal block of those local lengths instead (same FLOPs)."""
        d = self.dims
        total = sum(lengths)
        flops = sum(_attention_flops(L, d.num_heads, d.head_dim)
                    / (self._rate(L, total, offdiag) * 1e12)
                    for L in lengths if L > 0)
        return max(self._launch_s, heads_share * flops)

    def _gemm_time_uncached(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        tokens = max(tokens, self._gemm_rate.smallest)  # launch-bound below the smallest
        return tokens * self._linear_flops_per_token / (self._gemm_rate(tokens) * 1e12)

    def gemm_time(self, tokens: int) -> float:
        """Seconds of one layer's linear layers (fwd+bwd) over `tokens` tokens on one GPU."""
        return self._gemm_time(int(tokens))

    def link_time(self, nbytes: float) -> float:
        """Seconds of one transfer of `nbytes` between two GPUs of a CP group (0 for none)."""
        if nbytes <= 0:
            return 0.0
        return self.link_latency_s + nbytes / self.link_bandwidth

    # ---------------------------------------------------------------- groups and plans

    def group_time(self, seq_lens: Iterable[int], cp_size: int) -> float:
        """Seconds per rank (all layers, fwd+bwd) of one CP group of `cp_size` ranks running the
        packed samples `seq_lens` (each sharded over all its ranks)."""
        return self._group_time(tuple(seq_lens), int(cp_size))

    def _group_time_uncached(self, seq_lens: tuple[int, ...], cp_size: int) -> float:
        c = cp_size
        chunks = [-(-L // (2 * c)) * 2 for L in seq_lens]  # the runtime pads to a multiple of 2c
        tokens = sum(chunks)
        if self.comm_type == "a2a" and c > 1:
            attention = self.call_time(seq_lens, heads_share=1.0 / c)
            comm = 2 * self.link_time((c - 1) / c * tokens * self._qkvo_bytes_per_token)
            return self.dims.num_layers * (self._gemm_time(tokens) + attention + comm)
        step_attention = self.call_time(chunks)  # one ring step: one call over every chunk
        total = self._gemm_time(tokens) + step_attention
        if c > 1:  # the other c - 1 steps run the unmasked off-diagonal blocks
            step_attention = self.call_time(chunks, offdiag=True)
            total += (c - 1) * step_attention
            fwd_bytes = tokens * self._kv_bytes_per_token
            fwd, bwd = self.link_time(fwd_bytes), self.link_time(2 * fwd_bytes)
            if self.comm_type == "p2p":
                hidden_fwd = step_attention * _FWD_SHARE
                hidden_bwd = step_attention - hidden_fwd
                total += (c - 1) * (max(0.0, fwd - hidden_fwd) + max(0.0, bwd - hidden_bwd))
            else:  # all_gather: KV gathered, dKV reduce-scattered, before/after the kernel
                total += (c - 1) * (fwd + bwd)
        return self.dims.num_layers * total

    def _sample_time_uncached(self, seq_len: int, cp_size: int) -> float:
        return self.group_time((seq_len,), cp_size)

    def sample_time(self, seq_len: int, cp_size: int) -> float:
        """Seconds per rank of one sample alone in a group of `cp_size` ranks."""
        return self._sample_time(int(seq_len), int(cp_size))

    def estimate_sample_time(self, seq_len: int, cp_size: int) -> float:
        """sample_time with seq_len rounded down to its 7 leading bits (within 1.6%): for
        heuristics that time thousands of distinct lengths; plans are timed exactly."""
        key = (seq_len >> max(0, seq_len.bit_length() - 7), seq_len.bit_length(), cp_size)
        t = self._estimates.get(key)
        if t is None:
            shift = max(0, seq_len.bit_length() - 7)
            t = self._estimates[key] = self._sample_time((seq_len >> shift) << shift, cp_size)
        return t

    def _group_times(self, plan, microbatch) -> list[float]:
        lens = plan.seq_lens
        if plan.packed:
            return [self.group_time([lens[s] for s in g.samples], g.cp_size)
                    for g in microbatch.groups]
        return [sum(self.sample_time(lens[s], g.cp_size) for s in g.samples)
                for g in microbatch.groups]

    def microbatch_times(self, plan) -> list[float]:
        """Modeled seconds of each micro-batch of `plan` (a cpkit.dynamic.plan.Plan): its
        slowest group (an empty micro-batch: 0). A group of a plan with packed=False runs its
        samples one after another, each alone."""
        return [max(self._group_times(plan, mb), default=0.0) for mb in plan.microbatches]

    def step_time(self, plan, rule: str = "free", pp_size: int = 1) -> float:
        """Modeled seconds of one training step of `plan` under the step rule `rule` at
        `pp_size` pipeline stages (cpkit.dynamic.step_rules: "free", cpkit's runtime at PP = 1,
        where a group starts when all its ranks are free; "lockstep", where micro-batches end
        together). A plan with packed=False (MCore's hybrid CP schedule) always runs lockstep:
        MCore's schedule waits for the DPxCP group after every micro-batch.
        """
        if not plan.packed:
            rule = "lockstep"
        if rule != "free" or pp_size != 1:
            return step_end([[(g.ranks, t) for g, t in zip(mb.groups, self._group_times(plan, mb))]
                             for mb in plan.microbatches], plan.dp_cp_size, rule, pp_size)
        ready = [0.0] * plan.dp_cp_size
        for mb in plan.microbatches:
            for g, t in zip(mb.groups, self._group_times(plan, mb)):
                first, k = g.ranks[0], len(g.ranks)
                if g.ranks[-1] - first + 1 == k:  # a block: slices
                    ready[first:first + k] = [max(ready[first:first + k]) + t] * k
                else:
                    end = max(ready[r] for r in g.ranks) + t
                    for r in g.ranks:
                        ready[r] = end
        return max(ready, default=0.0)


def replay_check_line(calibration: Calibration) -> str:
    """One line saying how far the model with `calibration` was from the one-GPU replay that
    measured it (its "replay_check", written by python -m cpkit.bench replay
    --write-calibration), or that it was never held to one."""
    check = calibration.source.get("replay_check")
    if not isinstance(check, dict) or check.get("cpkit_median") is None:
        return ("modeled only: this calibration was not held to a replay (python -m cpkit.bench "
                "replay --write-calibration FILE measures one that is)")
    where = ", ".join(str(check[k]) for k in ("device", "commit", "evidence") if check.get(k))
    return (f"last calibration against the replay ({where}): the model was off by "
            f"{check['cpkit_median']:.1%} median, {check['cpkit_max']:.1%} at most, on "
            f"{check.get('batches', '?')} batches")


@lru_cache(maxsize=1)
def default_cost_model() -> CostModel:
    """The model `schedule` uses when given none: ModelDims() (4096 wide, 32 layers), p2p, and
    load_calibration() ($CPKIT_CALIBRATION, read once, else the shipped H200 file)."""
    return CostModel()
