"""The model features of the attention bench (`--features`): the mask, sink and head dims a
cell runs, and the FLOPs it does, so TFLOP/s compare across features and backends.

- `dense`: causal, the bench's head dim (the default, the table the README quotes);
- `window`: causal sliding window, a query sees the `--window` keys before it (Mistral-style);
- `window2`: two-sided window without a causal mask, `--window` keys on each side;
- `sink`: causal with learnable per-head sink logits (gpt-oss style), their gradient included;
- `mla`: causal with MLA head dims, q/k 192 and v 128, and no GQA (kv heads = heads), as
  DeepSeek's MLA runs after its up-projections.

FLOPs = 3.5 x 2 x b x h x pairs x (d_qk + d_v): `pairs` is the attended (query, key) count,
s^2/2 under a causal mask (the convention of `causal_fwd_bwd_flops`), s^2 without one, and the
exact band count with a window; x3.5 counts forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["FEATURES", "Feature", "feature", "attended_pairs", "fwd_bwd_flops"]

FEATURES = ("dense", "window", "window2", "sink", "mla")
MLA_DIMS = (192, 128)


@dataclass(frozen=True)
class Feature:
    name: str
    causal: bool
    window: Optional[tuple[int, int]]  # (left, right) keys around a query; None: no window
    sink: bool
    dims: Optional[tuple[int, int]]  # (d_qk, d_v); None: the bench's head dim for both
    mha: bool  # kv heads = heads (MLA), whatever --kv-heads says

    def head_dims(self, head_dim: int) -> tuple[int, int]:
        return self.dims or (head_dim, head_dim)

    def kv_heads(self, heads: int, kv_heads: int) -> int:
        return heads if self.mha else kv_heads


def feature(name: str, window: int) -> Feature:
    """The feature called `name` (one of FEATURES) with a window of `window` keys."""
    table = {
        "dense": Feature("dense", True, None, False, None, False),
        "window": Feature("window", True, (window, 0), False, None, False),
        "window2": Feature("window2", False, (window, window), False, None, False),
        "sink": Feature("sink", True, None, True, None, False),
        "mla": Feature("mla", True, None, False, MLA_DIMS, True),
    }
    if name not in table:
        raise ValueError(f"feature {name!r}: must be one of {list(FEATURES)}")
    return table[name]


def attended_pairs(seq: int, causal: bool, window: Optional[tuple[int, int]]) -> float:
    """(query, key) pairs attended in a sequence of `seq` tokens."""
    if window is None:
        return seq * seq / 2 if causal else float(seq * seq)
    left, right = (min(w, seq - 1) for w in window)
    right = 0 if causal else right
    # Each query sees left + right + 1 keys, less those that fall off either end.
    return float(seq * (left + right + 1) - left * (left + 1) // 2 - right * (right + 1) // 2)


def fwd_bwd_flops(batch: int, heads: int, seq: int, head_dim: int, f: Feature) -> float:
    """Forward + backward FLOPs of one cell of feature `f`."""
    d_qk, d_v = f.head_dims(head_dim)
    return 3.5 * 2.0 * batch * heads * attended_pairs(seq, f.causal, f.window) * (d_qk + d_v)
