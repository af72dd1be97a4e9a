"""Eval-time CP planning: how much work evaluation does at the training and at the eval layout.

Pure arithmetic (no torch, no process groups): `plan_eval_cp` takes the job's sizes and returns,
for the training layout and the eval layout, the data-parallel size, the micro-batches each rank
runs, the sample-steps and the redundancy, the activation memory per rank, and an estimated
speedup of evaluate() at the eval layout, with warnings for the cases where eval CP does not pay.

Work accounting (exact)
-----------------------
A validation set of S samples is split over the dp replicas in micro-batches of B samples. A
pipeline of pp stages needs at least pp micro-batches per rank to be full, so each rank runs
``m = max(pp, ceil(S / (dp * B)))`` micro-batches; ``sample_steps = dp * m * B`` counts every
sample a replica processes (the pipeline filler included) and ``redundancy = sample_steps / S``.
Raising CP divides dp, so with few samples per replica the filler disappears: at 8192 GPUs with
TP=2 PP=4, 1024 samples run 4096 sample-steps at CP=1 (redundancy 4) and 1024 at CP=4.

Speedup model (empirical, calibrated)
-------------------------------------
Time is counted in units of one token through the dense (non-attention) layers of the whole model
at tp=1. One micro-batch costs, on the slowest stage:

    t_mb = [B * (L / cp) * (1 + L / (6 * hidden)) / tp + F + C * (cp - 1)] / pp
           + (pp > 1) * P * B * L / cp

- the first term is the compute of the stage: dense work per token plus causal attention, whose
  cost per token grows with L and equals the dense work at L = 6 * hidden;
- F is the fixed cost of a micro-batch (kernel launches, synchronisation, loss, data), which
  does not shrink with CP;
- C is the CP communication latency that compute does not hide, one ring step's worth per extra
  CP rank;
- P is a per-token cost of pipelined execution that does not shrink with more stages
  (activation transfers between stages and the wait for the slowest stage).

evaluate() runs ``m + pp - 1`` micro-batch steps (fill and drain of a forward-only pipeline), so
``T = (m + pp - 1) * t_mb`` and ``speedup_estimate = T_train / T_eval``. F, C and P were fitted to the
five measurements of Megatron-Bridge PR #3755 (8x H100, an 8B-class model: hidden 4096, 32
layers; CP 1 -> 2, micro-batch 1, the eval layout's pipeline filled exactly once, so the train
layout does cp_eval/cp_train times the sample-steps): 0.72x at 1K PP=1, 1.23x at 8K PP=1, 1.64x at
8K TP1 PP4, 1.78x at 16K TP2 PP2, 1.88x at 16K TP1 PP4. The model reproduces each within 5%
(`REFERENCE_POINTS`, tested in tests/test_eval_plan.py). The constants are in model-relative
units: they are taken to scale with the model, so `hidden_size` only moves the attention
crossover. Away from the reference points the estimate is a trend, not a promise: measure with
`python -m cpkit.bench eval_cp`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Union

from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.layout import CPLayout, P2P

__all__ = [
    "SpeedupModel",
    "DEFAULT_MODEL",
    "REFERENCE_HIDDEN_SIZE",
    "REFERENCE_POINTS",
    "LayoutEstimate",
    "EvalPlan",
    "micro_batches_per_rank",
    "micro_batch_time",
    "plan_eval_cp",
]

REFERENCE_HIDDEN_SIZE = 4096
"""Hidden size assumed when none is given (the calibration model's)."""


@dataclass(frozen=True)
class SpeedupModel:
    """Constants of the evaluate() time model (see the module docstring), in dense-token units."""

    fixed: float = 3400.0
    """F: fixed cost of one micro-batch."""

    cp_latency: float = 2400.0
    """C: exposed CP communication latency per extra CP rank, per micro-batch."""

    pipeline: float = 1.0
    """P: per-token cost of pipelined execution (pp > 1) that more stages do not divide."""

    attention_crossover: float = 6.0
    """Sequence length, in multiples of hidden_size, at which causal attention costs as much
    per token as the dense layers."""


DEFAULT_MODEL = SpeedupModel()

REFERENCE_POINTS = (
    # Megatron-Bridge PR #3755, 8x H100, CP 1 -> 2: (tp, pp, seq_length, measured speedup)
    dict(tp=1, pp=1, seq_length=1024, measured=0.72),
    dict(tp=1, pp=1, seq_length=8192, measured=1.23),
    dict(tp=1, pp=4, seq_length=8192, measured=1.64),
    dict(tp=2, pp=2, seq_length=16384, measured=1.78),
    dict(tp=1, pp=4, seq_length=16384, measured=1.88),
)
"""The measurements the model is calibrated on; world_size 8, cp 1 -> 2, micro-batch 1, hidden
4096, eval_samples = dp_eval * pp (see the module docstring)."""


@dataclass(frozen=True)
class LayoutEstimate:
    """Evaluation work of one layout (training or eval)."""

    cp: int
    dp: int
    micro_batches_per_rank: int
    sample_steps: int
    redundancy: float
    activation_memory_ratio: float
    """Activation memory per rank relative to the training layout (tokens held per rank)."""
    tokens_per_rank: int
    """Tokens of one micro-batch held by one rank: B * seq_length / cp."""
    pipeline_steps: int
    """Micro-batch steps of the forward-only schedule: m + pp - 1."""
    time_units: float
    """Estimated evaluate() time in model units (comparable between the two layouts only)."""


@dataclass(frozen=True)
class EvalPlan:
    """The result of plan_eval_cp: both layouts, the estimated speedup and the warnings."""

    train: LayoutEstimate
    eval: LayoutEstimate
    speedup_estimate: float
    warnings: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form: {"train": {...}, "eval": {...}, "speedup_estimate", "warnings", "inputs"}."""
        return {
            "train": asdict(self.train),
            "eval": asdict(self.eval),
            "speedup_estimate": round(self.speedup_estimate, 4),
            "warnings": list(self.warnings),
            "inputs": dict(self.inputs),
        }


def micro_batches_per_rank(eval_samples: int, dp: int, micro_batch_size: int, pp: int) -> int:
    """Micro-batches one rank runs: enough for its share of the samples, and at least pp so the
    pipeline is full."""
    return max(pp, math.ceil(eval_samples / (dp * micro_batch_size)))


def micro_batch_time(
    *,
    cp: int,
    tp: int,
    pp: int,
    seq_length: int,
    micro_batch_size: int = 1,
    hidden_size: int = REFERENCE_HIDDEN_SIZE,
    model: SpeedupModel = DEFAULT_MODEL,
) -> float:
    """t_mb of the module docstring: one micro-batch on the slowest stage, in model units."""
    tokens = micro_batch_size * seq_length / cp
    crossover = model.attention_crossover * hidden_size
    stage = (tokens * (1.0 + seq_length / crossover) / tp + model.fixed + model.cp_latency * (cp - 1)) / pp
    pipe = model.pipeline * tokens if pp > 1 else 0.0
    return stage + pipe


def _planner_violations(eval_samples, micro_batch_size, num_layers, hidden_size, pp) -> list[Violation]:
    out = []
    for name, value in (("eval_samples", eval_samples), ("micro_batch_size", micro_batch_size)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            out.append(Violation(name, value, "must be an integer >= 1", f"set {name} to 1 or more"))
    if hidden_size is not None and not (isinstance(hidden_size, int) and hidden_size >= 1):
        out.append(Violation("hidden_size", hidden_size, "must be an integer >= 1 (or unset)",
                             f"set hidden_size, or leave it unset for {REFERENCE_HIDDEN_SIZE}"))
    if (isinstance(num_layers, int) and isinstance(pp, int) and pp >= 1 and num_layers >= 1
            and num_layers % pp):
        out.append(Violation("num_layers", num_layers, f"must be divisible by pp = {pp} (layers per stage)",
                             f"use a multiple of {pp} layers, or change pp"))
    return out


def _estimate(layout: CPLayout, *, train_cp: int, samples: int, mbs: int, hidden: int,
              model: SpeedupModel) -> tuple[LayoutEstimate, float]:
    m = micro_batches_per_rank(samples, layout.dp, mbs, layout.pp)
    steps = m + layout.pp - 1
    t_mb = micro_batch_time(cp=layout.cp, tp=layout.tp, pp=layout.pp, seq_length=layout.seq_length,
                            micro_batch_size=mbs, hidden_size=hidden, model=model)
    sample_steps = layout.dp * m * mbs
    estimate = LayoutEstimate(
        cp=layout.cp,
        dp=layout.dp,
        micro_batches_per_rank=m,
        sample_steps=sample_steps,
        redundancy=round(sample_steps / samples, 4),
        activation_memory_ratio=round(train_cp / layout.cp, 4),
        tokens_per_rank=mbs * layout.seq_length // layout.cp,
        pipeline_steps=steps,
        time_units=round(steps * t_mb, 2),
    )
    return estimate, steps * t_mb


def _warnings(train: LayoutEstimate, ev: LayoutEstimate, speedup: float, *, pp: int,
              seq_length: int, samples: int, mbs: int) -> list[str]:
    out = []
    if ev.cp == train.cp:
        out.append("no-change: cp_eval equals cp_train; evaluation runs at the training layout")
    if speedup < 1.0:
        if pp == 1:
            out.append(
                f"short-sequence-pp1: at PP=1 and seq_length={seq_length} eval CP is estimated "
                f"slower ({speedup:.2f}x; measured 0.72x at 1K): the CP communication and fixed "
                "costs outweigh the removed redundancy; keep cp_eval = cp_train")
        else:
            out.append(f"slower: eval CP is estimated slower ({speedup:.2f}x); keep cp_eval = cp_train")
    if ev.redundancy > 1.0:
        out.append(
            f"eval-redundancy: the eval layout still runs {ev.redundancy:g}x the samples (pipeline "
            "fill or a partly filled last micro-batch); a larger cp_eval, where valid, removes more")
    if ev.cp < train.cp:
        out.append(
            f"activation-memory: cp_eval < cp_train, each rank holds {ev.activation_memory_ratio:g}x "
            "the activations of training; check the memory headroom")
    if samples % (ev.dp * mbs):
        out.append(
            f"uneven-shard: eval_samples={samples} is not a multiple of dp_eval*micro_batch_size = "
            f"{ev.dp * mbs}; some eval replicas run fewer samples (each sample is still evaluated once)")
    return out


def plan_eval_cp(
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    cp_train: int = 1,
    cp_eval: int,
    eval_samples: int,
    micro_batch_size: int = 1,
    seq_length: int,
    num_layers: Optional[int] = None,
    hidden_size: Optional[int] = None,
    cp_comm_type: Union[str, Sequence[str]] = P2P,
    hierarchical_context_parallel_sizes: Optional[list[int]] = None,
    model: SpeedupModel = DEFAULT_MODEL,
) -> EvalPlan:
    """Plan evaluation at cp_eval for a job trained at cp_train (same world, tp and pp).

    Returns an EvalPlan with both layouts' dp, micro-batches per rank, sample-steps,
    redundancy, activation memory ratio and time, the estimated speedup (train time / eval
    time) and warnings (``short-sequence-pp1``, ``eval-redundancy``, ``activation-memory``,
    ``uneven-shard``, ``no-change``, ``slower``). Raises CPConfigError listing every violation:
    the CPLayout rules for both layouts (sizes, world divisibility, seq_length divisible by
    2*cp and by 2*cp_eval) and the planner's own (positive eval_samples and micro_batch_size,
    num_layers divisible by pp).
    """
    layout = CPLayout(
        world_size=world_size, tp=tp, pp=pp, cp=cp_train, cp_comm_type=cp_comm_type,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        seq_length=seq_length, num_layers=num_layers, eval_context_parallel_size=cp_eval,
    )
    found = layout.violations()
    found += _planner_violations(eval_samples, micro_batch_size, num_layers, hidden_size, pp)
    if seq_length is None:
        found.append(Violation("seq_length", None, "is needed for the estimate", "set seq_length"))
    if found:
        raise CPConfigError(found)
    hidden = hidden_size or REFERENCE_HIDDEN_SIZE
    kwargs = dict(train_cp=cp_train, samples=eval_samples, mbs=micro_batch_size, hidden=hidden, model=model)
    train, train_time = _estimate(layout, **kwargs)
    ev, eval_time = _estimate(layout.eval_layout(), **kwargs)
    speedup = train_time / eval_time
    warnings = _warnings(train, ev, speedup, pp=pp, seq_length=seq_length, samples=eval_samples,
                         mbs=micro_batch_size)
    inputs = dict(world_size=world_size, tp=tp, pp=pp, cp_train=cp_train, cp_eval=cp_eval,
                  eval_samples=eval_samples, micro_batch_size=micro_batch_size, seq_length=seq_length,
                  num_layers=num_layers, hidden_size=hidden)
    return EvalPlan(train=train, eval=ev, speedup_estimate=speedup, warnings=warnings, inputs=inputs)
