"""Fit the step model's host and memory-bound constants from micro-benchmark points.

Pure Python. A point is one micro-batch forward + backward of the real model on every rank at
once (cpkit.bench.dynamic.dynamic_step_calibrate runs them): CP size c, packed sample lengths, the
model's layers, the counted ops and syncs, and the seconds one more micro-batch adds when it runs
back to back with others, as a step runs them (never a plan's step: the bench validates the
model against those).

`fit_costs`:
1. At c = 1 (no ring): host_op_s (per op of the micro-batch's fixed part), sample_op_s (per op
   that comes with a packed sample: many are cheap views), mem_s_per_token, overlap_loss and
   residual_s[1] minimize the squared relative error of cpkit.dynamic.step_model's micro-batch
   formula over the points (the downhill simplex from several starts; the tiny micro-batches pin
   the host costs, the large ones the memory-bound rate, the middle ones the overlap).
   host_op_s * ops and residual_s[1] are both a constant per micro-batch of one model: only
   points of models with different op counts (different layer counts) tell them apart. Without
   such points residual_s[1] is held at 0 and `residual_identified` is False.
2. At every c > 1: residual_s[c] = the median of what the model leaves (ring posting, exposed
   latency, the group switch), measured on real groups of c ranks.
Each point's host terms (per-op costs, residual) are read at the host's pace while it was timed
(`MicrobatchPoint.pace`), so the constants are the calibration's median pace's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from cpkit.errors import CPConfigError

__all__ = ["MicrobatchPoint", "fit_costs", "fit_linear", "relative_errors"]


@dataclass(frozen=True)
class MicrobatchPoint:
    """One measured micro-batch (module docstring)."""

    cp: int
    seq_lens: tuple[int, ...]
    ops: float
    """Counted ops of the micro-batch's fixed part (OpCounts base at cp)."""
    sample_ops: float
    """Counted ops that come with its samples (per-sample count x samples)."""
    syncs: float
    seconds: float
    layers: int = 0
    """The model's layers (0: the fit's `layers`)."""
    pace: float = 1.0
    """The host's pace while it was timed against the calibration's median (a pace probe's
    ratio): its host terms are read at that pace, so a point timed while the host ran slow does
    not raise the fitted host costs (cpkit.dynamic.step_model.StepCosts.at_pace)."""

    @property
    def local_tokens(self) -> int:
        """Tokens per rank after the runtime pads each sample to a multiple of 2c."""
        return sum(-(-L // (2 * self.cp)) * 2 for L in self.seq_lens)


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; one distinct x: (mean y, 0)."""
    n = len(xs)
    if n == 0:
        raise CPConfigError.single("points", [], "must hold at least one point", "measure one")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _predict(p: MicrobatchPoint, kernels: float, layers: int, sync_s: float, q: dict,
             resid: float) -> float:
    gpu = kernels + (p.layers or layers) * q["mem_s_per_token"] * p.local_tokens
    cpu = p.pace * (q["host_op_s"] * p.ops + q["sample_op_s"] * p.sample_ops)
    return max(gpu, cpu) + q["overlap_loss"] * min(gpu, cpu) + sync_s * p.syncs + p.pace * resid


def relative_errors(points, kernel_time: Callable[[MicrobatchPoint], float], layers: int,
                    sync_s: float, params: dict) -> list[float]:
    """predicted / measured - 1 of each point under `params` (fit_costs' result)."""
    return [_predict(p, kernel_time(p), layers, sync_s, params, params["residual_s"].get(p.cp, 0.0))
            / p.seconds - 1 for p in points]


def _nelder_mead(f, x0: list[float], steps: list[float], iters: int = 600) -> list[float]:
    """Minimize f over R^n from x0 (the downhill simplex: reflect, expand, contract, shrink)."""
    pts = [list(x0)] + [[x + (steps[i] if i == j else 0.0) for j, x in enumerate(x0)]
                        for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centre = [sum(p[j] for p in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]

        def toward(t):
            return [c + t * (w - c) for c, w in zip(centre, pts[-1])]

        r = toward(-1.0)
        fr = f(r)
        if fr < vals[0]:
            e = toward(-2.0)
            fe = f(e)
            pts[-1], vals[-1] = (e, fe) if fe < fr else (r, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = r, fr
        else:
            k = toward(0.5)
            fk = f(k)
            if fk < vals[-1]:
                pts[-1], vals[-1] = k, fk
            else:  # shrink toward the best
                pts = [pts[0]] + [[b + 0.5 * (x - b) for b, x in zip(pts[0], p)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(len(pts)), key=vals.__getitem__)]


def fit_costs(points: Sequence[MicrobatchPoint], kernel_time: Callable[[MicrobatchPoint], float],
              layers: int, sync_s: float) -> dict:
    """{"host_op_s", "sample_op_s", "mem_s_per_token", "overlap_loss", "residual_s": {c: s},
    "residual_identified", "errors": {c: [..]}}
    fitted from `points` (module docstring). `kernel_time(point)`: the kernels-only model of
    that micro-batch (CostModel.group_time). Raises CPConfigError without a c = 1 point."""
    base = [p for p in points if p.cp == 1 and p.seconds > 0]
    if not base:
        raise CPConfigError.single("points", [p.cp for p in points], "need micro-batches at cp 1",
                                   "measure cp 1 points (cpkit.bench.dynamic.dynamic_step_calibrate)")
    kern = {id(p): kernel_time(p) for p in points}
    # a first guess: all of the smallest micro-batch's time is host time
    tiny = min(base, key=lambda p: p.local_tokens)
    first = max(1e-7, min(1e-3, tiny.seconds / max(tiny.ops + tiny.sample_ops, 1.0)))
    params = {"host_op_s": first, "sample_op_s": first, "mem_s_per_token": 1e-9, "overlap_loss": 0.5,
              "resid": 0.0}

    def cost(**change):
        q = {**params, **change}
        return sum((_predict(p, kern[id(p)], layers, sync_s, q, q["resid"]) / p.seconds - 1) ** 2
                   for p in base)

    shortest = min(p.seconds for p in base)
    # residual_s[1] and host_op_s * ops are told apart only by points whose fixed ops differ
    identified = len({round(p.ops) for p in base}) > 1
    logs = ("host_op_s", "sample_op_s", "mem_s_per_token")

    def unpack(x):  # log rates; the overlap and the residual clamped to their ranges
        q = {k: math.exp(min(0.0, v)) for k, v in zip(logs, x)}
        q["overlap_loss"] = min(1.0, max(0.0, x[3]))
        q["resid"] = min(shortest, max(0.0, x[4] * shortest)) if identified else 0.0
        return q

    # the surface has a kink where host and GPU time cross: start from several overlaps and
    # memory rates, keep the best
    best = None
    for overlap in (0.0, 0.3, 0.7, 1.0):
        for mem in (1e-10, 1e-8):
            x = _nelder_mead(lambda x: cost(**unpack(x)),
                             [math.log(params["host_op_s"]), math.log(params["sample_op_s"]),
                              math.log(mem), overlap, 0.1], [1.0, 1.0, 1.0, 0.2, 0.2], iters=300)
            if best is None or cost(**unpack(x)) < cost(**unpack(best)):
                best = x
    params.update(unpack(best))
    out = {k: params[k] for k in ("host_op_s", "sample_op_s", "mem_s_per_token", "overlap_loss")}
    out["residual_s"] = {1: params["resid"]}
    out["residual_identified"] = identified
    for c in sorted({p.cp for p in points} - {1}):
        left = [p.seconds - _predict(p, kern[id(p)], layers, sync_s, out, 0.0)
                for p in points if p.cp == c]
        out["residual_s"][c] = max(0.0, statistics.median(left))
    out["errors"] = {c: relative_errors([p for p in points if p.cp == c], lambda p: kern[id(p)],
                                        layers, sync_s, out)
                     for c in sorted({p.cp for p in points})}
    return out
