"""The cost model's calibration from the replay's own kernels (cpkit.bench.dynamic.replay_kernels).

What cpkit.dynamic.cost reads, measured with the kernels the replay times, on this machine:
- gemm: TFLOP/s of one layer's GEMMs (the replay's `layers`) at 4 token counts per octave,
  64 to 65536, FLOPs = tokens * ModelDims.linear_flops_per_token;
- attention / attention_packed: the ring's causal diagonal call over one sample of L local
  tokens, and over 32768 // L (and 4096 // L: small_points) of them in one call; FLOPs
  3.5 * 2 * h * L^2 * d;
- attention_offdiag (points, packed_points): the unmasked off-diagonal call (L queries against
  L / 2 keys: the same FLOPs), single and packed;
- link: the replay's link table as two points (the model fits the same latency and bandwidth).
"""

from __future__ import annotations

import datetime

from cpkit.bench.dynamic.replay_timing import LinkTable, Timer
from cpkit.bench.dynamic.replay_work import DIAG, KV_FIRST, AttnCall
from cpkit.dynamic.cost import ModelDims

__all__ = ["calibration_from_timer", "TOKENS", "LENGTHS"]

TOKENS = sorted({max(16, int(round(64 * 2 ** (k / 4) / 16)) * 16) for k in range(41)})
LENGTHS = sorted({L for k in range(6, 17) for L in (1 << k, 3 << (k - 1)) if L <= 65536})
PER_CALL = 32768


def _flops(L: int, dims: ModelDims) -> float:
    return 3.5 * 2.0 * dims.num_heads * L * L * dims.head_dim


def calibration_from_timer(timer: Timer, dims: ModelDims, link: LinkTable, *, device: str,
                           origin: str, quick: bool = False, max_tokens: int | None = None) -> dict:
    """The calibration JSON (cpkit.dynamic.cost.Calibration.from_dict's format); `max_tokens`:
    no GEMM or attention shape above it (a rank never holds more; the model extends the last)."""
    cap = max_tokens or (1 << 30)
    tokens = [t for t in TOKENS if t <= min(cap, 1024 if quick else cap)]
    lengths = [L for L in LENGTHS if L <= min(cap, 512 if quick else cap)]
    per_call = 1024 if quick else PER_CALL

    def rate(call: AttnCall, L: int, count: int = 1) -> float:
        f, b = timer.call(call)
        return count * _flops(L, dims) / (f + b) / 1e12

    gemm = [[T, T * dims.linear_flops_per_token / timer.layers(T) / 1e12] for T in tokens]
    single = [[L, rate(AttnCall(DIAG, (L // 2,)), L)] for L in lengths]
    off = [[L, rate(AttnCall(KV_FIRST, (L // 2,)), L)] for L in lengths]
    packed = [[L, rate(AttnCall(DIAG, (L // 2,) * (per_call // L)), L, per_call // L)]
              for L in lengths if L < per_call]
    off_packed = [[L, rate(AttnCall(KV_FIRST, (L // 2,) * (per_call // L)), L, per_call // L)]
                  for L in lengths if L < per_call]
    small = per_call // 8
    packed_small = [[L, rate(AttnCall(DIAG, (L // 2,) * (small // L)), L, small // L)]
                    for L in lengths if L < small]
    off_small = [[L, rate(AttnCall(KV_FIRST, (L // 2,) * (small // L)), L, small // L)]
                 for L in lengths if L < small]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    src = f"{origin}, {when}, the replay's kernels on {device}"
    return {
        "format": 1,
        "device": device,
        "dims": {k: v for k, v in vars(dims).items()},
        "attention": {"what": "the ring's causal diagonal call over one sample of L local tokens, "
                              "fwd+bwd, TFLOP/s (3.5 * 2 * h * L^2 * d)",
                      "heads": dims.num_heads, "kv_heads": dims.num_kv_heads,
                      "head_dim": dims.head_dim, "points": single, "source": src},
        "attention_packed": {"what": f"the same call over {per_call} // L samples of L",
                             "tokens_per_call": per_call, "points": packed,
                             "small_tokens_per_call": small, "small_points": packed_small,
                             "source": src},
        "attention_offdiag": {"what": "the ring's unmasked off-diagonal call (L queries, L / 2 "
                                      "keys), single and packed, TFLOP/s of the causal L's FLOPs",
                              "points": off, "packed_points": off_packed,
                              "packed_small_points": off_small, "source": src},
        "gemm": {"what": "one layer's GEMMs fwd+bwd (the replay's), TFLOP/s vs tokens",
                 "hidden_size": dims.hidden_size, "points": gemm, "source": src},
        "link": {"what": f"the replay's link table {link.name!r} as two points",
                 "latency_s": link.latency_s,
                 "points": [[b, link.time(b)] for b in (1 << 20, 1 << 26)], "source": link.source},
    }
