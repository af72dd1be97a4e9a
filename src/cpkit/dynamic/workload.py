"""Compute-only workload of one packed sample, for the scheduler's optional balancing candidate.

The scheduler itself times plans with the step-time model (cpkit.dynamic.cost); a workload
function passed to `schedule(workload=...)` only drives its compute-only balancer.

A workload function takes exactly one argument, the sample's length in tokens, and returns its
total cost (any unit, finite and >= 0). The scheduler calls it once per sample and spreads the cost
evenly over the ranks of the sample's CP group: a sample of cost w in a group of size k costs
w / k on each of those ranks. Communication is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cpkit.errors import CPConfigError

__all__ = [
    "DEFAULT_LINEAR_COEFF",
    "QuadraticWorkload",
    "default_workload",
    "workload_for_model",
]

# The linear term equals the attention term at 4096 tokens: long samples are attention-bound,
# short ones are dominated by the per-token layers (projections, MLP).
DEFAULT_LINEAR_COEFF = 4096.0


@dataclass(frozen=True)
class QuadraticWorkload:
    """w(L) = L**2 + linear_coeff * L: attention (quadratic in L) plus per-token layers (linear).

    `linear_coeff` is the sequence length at which the two terms are equal.
    """

    linear_coeff: float = DEFAULT_LINEAR_COEFF

    def __post_init__(self):
        if not (math.isfinite(self.linear_coeff) and self.linear_coeff >= 0):
            raise CPConfigError.single(
                "linear_coeff", self.linear_coeff, "must be finite and >= 0", "pass e.g. 4096.0"
            )

    def __call__(self, seq_len: int) -> float:
        """Total cost of one sample of `seq_len` tokens."""
        return float(seq_len) * float(seq_len) + self.linear_coeff * float(seq_len)


default_workload = QuadraticWorkload()
"""The scheduler's default workload model: L**2 + 4096 * L."""


def workload_for_model(hidden_size: int, ffn_hidden_size: int | None = None) -> QuadraticWorkload:
    """Workload whose linear/quadratic ratio follows a GPT layer's forward FLOPs (causal mask).

    Per layer: attention scores and values cost 2 * L**2 * h (causal halves 4 * L**2 * h);
    QKV, output projection and the MLP cost 8 * L * h**2 + 4 * L * h * ffn. Dividing by
    2 * h gives L**2 + (4 * h + 2 * ffn) * L. `ffn_hidden_size` defaults to 4 * hidden_size.
    """
    ffn = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
    return QuadraticWorkload(linear_coeff=float(4 * hidden_size + 2 * ffn))
