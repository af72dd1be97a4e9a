"""A model of the real training step of a dynamic-CP plan: kernels plus what the host pays.

cpkit.dynamic.cost.CostModel times the kernels (GEMM, attention, exposed ring communication).
The real step (cpkit.dynamic.runtime through MCore) takes longer than that model (an early
4-GPU run that kept no evidence folder; the recorded one is claim `dynamic-real-step` in
cards/dynamic-context-parallel/card.yaml). A reading of the code (op and sync counts checked on CPU with
MCore 0.19.2; their times inferred, not measured) names what it adds: host-launched operations
(hundreds per micro-batch, ~300 more per packed sample at 4 layers: MCore's per-sequence THD
RoPE loop), host syncs, the CP group switch, memory-bound layers (norms, residual adds, RoPE,
casts), an idle slot's zero-loss backward, the batch preparation and the gradient all-reduce
with the optimizer. `StepModel` adds them (modeled; its error on 4 GPUs:
cpkit.dynamic.candidates.validated_band):

    one group's micro-batch  = join(gpu, host) + sync_s * syncs(c, n) + residual_s[c]
      gpu                    = CostModel.group_time (GEMM + attention + exposed ring)
                               + layers * mem_s_per_token * local tokens
      host                   = host_op_s * ops(c, 0) + sample_op_s * (ops(c, n) - ops(c, 0))
      join(a, b)             = max(a, b) + overlap_loss * min(a, b)
    step                     = max over ranks of prep + fwd+bwd makespan + reduce_opt_s
      fwd+bwd makespan         = the micro-batches, back to back, + call_gap_s per forward-backward
                                 call (one for a packed plan, one per segment in lockstep)

c is the group's CP size and n its packed samples. ops() and syncs() are counted, not guessed
(`OpCounts`, from cpkit.bench.dynamic.dynamic_step_calibrate counting dispatched aten ops of a
micro-batch forward + backward of the bench's model), linear in n per c. join() is the host
launching work while the GPU runs it: max() where one hides the other, plus the part that does
not hide (overlap_loss = 1: no overlap). Every constant is fitted from micro-benchmarks
(cpkit.dynamic.step_fit), never from a plan's step, timed as a step runs micro-batches: back to
back between two syncs, so what a call pays once (the first launch before the GPU is busy, the
final wait: call_gap_s) is not taken for a per-micro-batch cost. The rank schedule follows the runtime:
`runtime_segments` (MCore's unpacked plans: one sample at a time, every rank waits after each
micro-batch), free otherwise; an idle rank in a micro-batch pays `idle_s`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

from cpkit.dynamic.cost import Calibration, CostModel, ModelDims
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan
from cpkit.errors import CPConfigError

__all__ = ["OpCounts", "StepCosts", "StepModel", "runtime_segments"]


@dataclass(frozen=True)
class OpCounts:
    """Host-launched ops and host syncs of one micro-batch forward + backward on a rank, per CP
    size c: ops(c, n) = base + per_sample * n (n packed samples); `per_cp` maps
    c -> (ops_base, ops_per_sample, syncs_base, syncs_per_sample). `source` says where they were
    counted (model shape, MCore, torch, device)."""

    per_cp: Mapping[int, tuple[float, float, float, float]]
    source: str = ""

    def __post_init__(self):
        if not self.per_cp:
            raise CPConfigError.single("ops.per_cp", dict(self.per_cp), "must count at least one CP size",
                                       "count ops with cpkit.bench.dynamic.dynamic_step_calibrate.count_ops")

    def _row(self, cp: int) -> tuple[float, float, float, float]:
        if cp in self.per_cp:
            return self.per_cp[cp]
        sizes = sorted(self.per_cp)
        lo = max((c for c in sizes if c < cp), default=None)
        hi = min((c for c in sizes if c > cp), default=None)
        if lo is None or hi is None:  # beyond the counted sizes: the nearest, extended linearly
            a, b = (sizes[-2], sizes[-1]) if hi is None and len(sizes) > 1 else (sizes[0], sizes[0])
            if a == b:
                return self.per_cp[a]
            ra, rb = self.per_cp[a], self.per_cp[b]
            t = (cp - b) / (b - a)
            return tuple(max(0.0, y + t * (y - x)) for x, y in zip(ra, rb))
        ra, rb = self.per_cp[lo], self.per_cp[hi]
        t = (cp - lo) / (hi - lo)
        return tuple(x + t * (y - x) for x, y in zip(ra, rb))

    def ops(self, cp: int, samples: int) -> float:
        """Counted host-launched ops of a micro-batch of `samples` packed samples at CP `cp`."""
        base, per, _, _ = self._row(cp)
        return max(0.0, base) + max(0.0, per) * samples

    def syncs(self, cp: int, samples: int) -> float:
        """Counted host syncs of the same micro-batch."""
        _, _, base, per = self._row(cp)
        return max(0.0, base + per * samples)

    def to_dict(self) -> dict:
        """JSON form."""
        return {"per_cp": {str(c): list(v) for c, v in sorted(self.per_cp.items())},
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> "OpCounts":
        """From to_dict's form; CPConfigError names a malformed entry."""
        try:
            per_cp = {int(c): tuple(float(x) for x in v) for c, v in data["per_cp"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CPConfigError.single("step.ops", data, "must be {per_cp: {cp: [4 numbers]}}",
                                       "re-run python -m cpkit.bench dynamic_step --recalibrate") from None
        if any(len(v) != 4 for v in per_cp.values()):
            raise CPConfigError.single("step.ops.per_cp", data["per_cp"], "needs 4 numbers per CP size",
                                       "re-run python -m cpkit.bench dynamic_step --recalibrate")
        return cls(per_cp, str(data.get("source", "")))


@dataclass(frozen=True)
class StepCosts:
    """The host-side and memory-bound costs the real step adds (seconds; module docstring)."""

    ops: OpCounts
    host_op_s: float
    """Per counted op of a micro-batch's fixed part (ops(c, 0))."""
    sync_s: float
    mem_s_per_token: float
    """Per local token per layer, forward + backward (memory-bound layers)."""
    overlap_loss: float = 1.0
    sample_op_s: float = -1.0
    """Per counted op that comes with a packed sample (-1: host_op_s)."""
    residual_s: Mapping[int, float] = field(default_factory=dict)
    """Per micro-batch at CP size c: what the fit leaves (group switch, ring posting, latency)."""
    idle_s: float = 0.0
    prep_mb_s: float = 0.0
    prep_sample_s: float = 0.0
    reduce_opt_s: float = 0.0
    call_gap_s: float = 0.0
    """Per forward-backward call, once, whatever its micro-batches (measured: a call of one
    micro-batch minus what one more adds back to back)."""
    source: dict = field(default_factory=dict, compare=False)

    def at_pace(self, pace: float) -> "StepCosts":
        """These costs on a host `pace` times as slow as the calibration's (pace 1.1: every host
        cost 10% longer): the host's terms scaled (per op, per sample, residual, call gap, idle
        slot, preparation), the device's and the reduce-and-optimizer step's kept. A host-bound
        step's host runs 5-25% faster or slower from one run to the next on the same machine
        (2x H200, 2026-11-28 and 29), which no calibration measured at another time can know;
        the bench measures that pace beside the steps and reads the model at it
        (cpkit.bench.dynamic.dynamic_step_rank)."""
        if not pace > 0:
            raise ValueError(f"pace={pace!r}: must be a positive ratio of host speeds (1.0: the calibration's); "
                             "fix: pass the probe's seconds now over its seconds at calibration")
        per_sample = self.sample_op_s * pace if self.sample_op_s >= 0 else self.sample_op_s
        return dataclasses.replace(
            self, host_op_s=self.host_op_s * pace, sample_op_s=per_sample, call_gap_s=self.call_gap_s * pace,
            idle_s=self.idle_s * pace, prep_mb_s=self.prep_mb_s * pace, prep_sample_s=self.prep_sample_s * pace,
            residual_s={c: v * pace for c, v in self.residual_s.items()})

    def residual(self, cp: int) -> float:
        """residual_s at `cp`, the nearest measured size's where `cp` was not measured."""
        if not self.residual_s:
            return 0.0
        if cp in self.residual_s:
            return self.residual_s[cp]
        return self.residual_s[min(self.residual_s, key=lambda c: (abs(c - cp), -c))]

    def to_dict(self) -> dict:
        """JSON form (the calibration file's "step" section)."""
        out = {k: getattr(self, k) for k in ("host_op_s", "sync_s", "mem_s_per_token", "overlap_loss",
                                             "idle_s", "prep_mb_s", "prep_sample_s", "reduce_opt_s",
                                             "sample_op_s", "call_gap_s")}
        out["residual_s"] = {str(c): v for c, v in sorted(self.residual_s.items())}
        out["ops"] = self.ops.to_dict()
        out["source"] = dict(self.source)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "StepCosts":
        """From to_dict's form; CPConfigError names a missing or negative number."""
        names = ("host_op_s", "sync_s", "mem_s_per_token", "overlap_loss", "idle_s", "prep_mb_s",
                 "prep_sample_s", "reduce_opt_s", "call_gap_s")
        bad = [n for n in names[:3] if not isinstance(data.get(n), (int, float))]
        bad += [n for n in names if isinstance(data.get(n), (int, float)) and data[n] < 0]
        sample_op_s = float(data.get("sample_op_s", -1.0))
        if bad or "ops" not in data:
            raise CPConfigError.single("step", {n: data.get(n) for n in bad or ["ops"]},
                                       "must hold non-negative numbers and the op counts",
                                       "re-run python -m cpkit.bench dynamic_step --recalibrate")
        return cls(ops=OpCounts.from_dict(data["ops"]),
                   residual_s={int(c): float(v) for c, v in data.get("residual_s", {}).items()},
                   source=dict(data.get("source", {})), sample_op_s=sample_op_s,
                   **{n: float(data.get(n, 1.0 if n == "overlap_loss" else 0.0)) for n in names})


def runtime_segments(plan: Plan) -> tuple[list[list[Microbatch]], bool]:
    """(micro-batches the runtime runs, grouped in segments; lockstep) for `plan`.

    A packed plan: its micro-batches, one segment, free. packed=False (MCore's schedule): each
    group's samples one after another, so micro-batch m becomes max(len(samples)) runtime
    micro-batches (the j-th sample of every group in the j-th), forming segment m, after which
    every rank waits for the others."""
    if plan.packed:
        return [list(plan.microbatches)], False
    segments = []
    for mb in plan.microbatches:
        seg = []
        for j in range(max((len(g.samples) for g in mb.groups), default=0)):
            seg.append(Microbatch(tuple(CPGroupAssignment(g.ranks, (g.samples[j],), g.cp_size)
                                        for g in mb.groups if len(g.samples) > j)))
        segments.append(seg)
    return segments, True


class StepModel(CostModel):
    """CostModel plus the real step's host and memory-bound costs (module docstring).

    step_time(plan) is the whole step (prep + forward/backward + gradient reduce and optimizer),
    so the scheduler ranks plans by it; `predict(plan)` also gives per-rank figures.
    """

    def __init__(self, dims: ModelDims | None = None, calibration: Calibration | None = None,
                 comm_type: str = "p2p", costs: Optional[StepCosts] = None):
        super().__init__(dims, calibration, comm_type)
        step = self.calibration.source.get("step")
        if costs is None and step is None:
            raise CPConfigError.single(
                "calibration.step", None, "is missing: the step model needs the host costs",
                "calibrate with python -m cpkit.bench dynamic_step (it writes them), or pass costs=")
        self.costs = costs if costs is not None else StepCosts.from_dict(step)

    def kernel_group_time(self, seq_lens, cp_size: int) -> float:
        """CostModel's group time: kernels and exposed ring only."""
        return super()._group_time_uncached(tuple(seq_lens), int(cp_size))

    def _group_time_uncached(self, seq_lens: tuple[int, ...], cp_size: int) -> float:
        k, c = self.costs, cp_size
        local = sum(-(-L // (2 * c)) * 2 for L in seq_lens)
        gpu = (self.kernel_group_time(seq_lens, c)
               + self.dims.num_layers * k.mem_s_per_token * local)
        fixed = k.ops.ops(c, 0)
        per_sample = k.sample_op_s if k.sample_op_s >= 0 else k.host_op_s
        host = k.host_op_s * fixed + per_sample * (k.ops.ops(c, len(seq_lens)) - fixed)
        joined = max(gpu, host) + k.overlap_loss * min(gpu, host)
        return joined + k.sync_s * k.ops.syncs(c, len(seq_lens)) + k.residual(c)

    def predict(self, plan: Plan) -> dict:
        """{"step_s", "fwd_bwd_s", "prep_s", "reduce_opt_s", "per_rank_fwd_bwd_s",
        "per_rank_prep_s", "per_rank_microbatch_s"} of one step of `plan` as the runtime runs it
        (runtime_segments). per_rank_microbatch_s[r] holds, per micro-batch the runtime runs
        (segments in order), rank r's modeled seconds in it: its group's group_time, idle_s
        where idle; what it waits for other ranks is the rest of per_rank_fwd_bwd_s[r]."""
        k, n = self.costs, plan.dp_cp_size
        lens = plan.seq_lens
        segments, lockstep = runtime_segments(plan)
        ready, prep = [0.0] * n, [0.0] * n
        per_mb = [[] for _ in range(n)]
        for seg in segments:
            for mb in seg:
                busy = [False] * n
                for g in mb.groups:
                    t = self.group_time([lens[s] for s in g.samples], g.cp_size)
                    end = max(ready[r] for r in g.ranks) + t
                    for r in g.ranks:
                        ready[r], busy[r] = end, True
                        prep[r] += k.prep_mb_s + k.prep_sample_s * len(g.samples)
                        per_mb[r].append(t)
                for r in range(n):
                    if not busy[r]:
                        ready[r] += k.idle_s
                        per_mb[r].append(k.idle_s)
            ready = [t + k.call_gap_s for t in ready]  # one forward-backward call per segment
            if lockstep:  # every rank waits for the DPxCP group after each micro-batch
                ready = [max(ready) + k.sync_s] * n
        prep_s = max(prep) + k.sync_s  # agree_on_tokens: every rank waits for the slowest
        fwd_bwd = max(ready, default=0.0)
        return {"step_s": prep_s + fwd_bwd + k.reduce_opt_s, "fwd_bwd_s": fwd_bwd, "prep_s": prep_s,
                "reduce_opt_s": k.reduce_opt_s, "per_rank_fwd_bwd_s": ready,
                "per_rank_prep_s": prep, "per_rank_microbatch_s": per_mb}

    def step_time(self, plan, rule: str = "free", pp_size: int = 1) -> float:
        """The whole step of `plan` (predict's step_s) at PP = 1 with the free rule (the runtime's;
        packed=False plans run in lockstep); other rules: CostModel's kernels-only step."""
        if pp_size != 1 or (rule != "free" and plan.packed):
            return super().step_time(plan, rule, pp_size)
        return self.predict(plan)["step_s"]


def with_costs(calibration: Calibration, costs: StepCosts) -> Calibration:
    """`calibration` whose source carries `costs` (what StepModel reads)."""
    return dataclasses.replace(calibration, source={**calibration.source, "step": costs.to_dict()})
