"""`CPAttentionOptions`: the settings of CP attention that change speed, not results.

One frozen object passed down from `ContextParallelAttention` / `context_parallel_attention` to
the comm types and kernels, so nothing deep in a kernel path reads the environment. Its default
(`default_options()`) comes from the environment, read once per process:

- CPKIT_P2P_BATCHED: `auto` (default) posts a ring step as one batch_isend_irecv call for a ring
  of 2 and as separate isend/irecv calls for more (TE's NVTE_BATCH_MHA_P2P_COMM choice); `1` or
  `0` forces one mode.
- CPKIT_A2A_CHUNKS: head chunks pipelined through the a2a and a2a+p2p all-to-alls (default 2; 1
  turns the overlap off).
- CPKIT_ATTN_KERNEL: `cudnn`, `flash`, `efficient`, `math` or `cudnn_fe` (the cuDNN frontend,
  extra `cpkit[kernels]`) forces one CUDA kernel (no fallback), for benchmarking; on CPU only
  `math` is honoured. Unset, cpkit chooses per block (`kernels.py`'s module docstring: the cuDNN
  frontend for sliding windows, THD, sinks and MLA where it is installed).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from cpkit.errors import CPConfigError

__all__ = [
    "A2A_CHUNKS_ENV",
    "CUDA_KERNELS",
    "CPAttentionOptions",
    "KERNEL_ENV",
    "P2P_BATCHED_ENV",
    "default_options",
]

P2P_BATCHED_ENV = "CPKIT_P2P_BATCHED"
A2A_CHUNKS_ENV = "CPKIT_A2A_CHUNKS"
KERNEL_ENV = "CPKIT_ATTN_KERNEL"
CUDA_KERNELS = ("cudnn", "flash", "efficient", "math", "cudnn_fe")


@dataclass(frozen=True)
class CPAttentionOptions:
    """Speed settings of CP attention; every value gives the same results (up to rounding)."""

    p2p_batched: Optional[bool] = None
    """Ring exchanges as one batch_isend_irecv call (True) or separate isend/irecv calls, even
    ranks sending first (False); None: batched for a ring of 2, separate for more (TE's choice;
    separate calls measured 7% faster at cp=4, kv32, 32K on 4x H200)."""
    a2a_chunks: int = 2
    """Head chunks pipelined through the all-to-alls of a2a and a2a+p2p (1: no overlap); lowered
    to the largest count that divides the local KV heads."""
    kernel: Optional[str] = None
    """Force one CUDA kernel (one of CUDA_KERNELS, no fallback); None lets cpkit choose (the rule
    is in `kernels.py`'s docstring). "cudnn_fe" also takes the band (window) blocks off
    FlexAttention; where the cuDNN frontend is not installed it warns once and cpkit chooses.
    On CPU only "math" is honoured."""

    def __post_init__(self):
        if self.p2p_batched not in (None, True, False):
            raise CPConfigError.single("p2p_batched", self.p2p_batched, "must be None (auto), True or False",
                                       "pass None to let the ring size decide")
        if isinstance(self.a2a_chunks, bool) or not isinstance(self.a2a_chunks, int) or self.a2a_chunks < 1:
            raise CPConfigError.single("a2a_chunks", self.a2a_chunks, "must be an int >= 1",
                                       "pass 1 (no overlap) or more head chunks (default 2)")
        if self.kernel is not None and self.kernel not in CUDA_KERNELS:
            raise CPConfigError.single("kernel", self.kernel, f"must be None or one of {list(CUDA_KERNELS)}",
                                       "pass None to let cpkit choose")

    def ring_batched(self, ring_size: int) -> bool:
        """Whether a ring of `ring_size` ranks posts each exchange as one batched call."""
        return ring_size <= 2 if self.p2p_batched is None else self.p2p_batched

    def chunk_count(self, local_kv_heads: int) -> int:
        """Head chunks for the all-to-alls: `a2a_chunks` lowered to the largest count that
        divides this rank's KV heads after the all-to-all (h_kv / A)."""
        top = min(self.a2a_chunks, max(local_kv_heads, 1))
        return max(c for c in range(1, top + 1) if local_kv_heads % c == 0)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "CPAttentionOptions":
        """Options from CPKIT_P2P_BATCHED, CPKIT_A2A_CHUNKS and CPKIT_ATTN_KERNEL (`environ`,
        default os.environ); unset ones keep their defaults. Raises ValueError naming the
        variable for a value it does not take."""
        env = os.environ if environ is None else environ
        batched = env.get(P2P_BATCHED_ENV, "auto").strip().lower()
        if batched not in ("auto", "0", "1"):
            raise ValueError(
                f"{P2P_BATCHED_ENV}={batched!r}: must be auto (the default: batched for a ring of 2 "
                "ranks, separate calls for more), 1 (always one batched call per ring step) or 0 "
                "(always separate isend/irecv calls); unset it for the default"
            )
        chunks = env.get(A2A_CHUNKS_ENV, "2").strip()
        if not chunks.isdigit() or int(chunks) < 1:
            raise ValueError(
                f"{A2A_CHUNKS_ENV}={chunks!r}: must be a positive integer (head chunks pipelined "
                "through the all-to-alls; 1 turns the overlap off); unset it for the default 2"
            )
        kernel = env.get(KERNEL_ENV, "").strip().lower()
        if kernel and kernel not in CUDA_KERNELS:
            raise ValueError(
                f"{KERNEL_ENV}={kernel!r}: must be one of {', '.join(CUDA_KERNELS)}; unset it to "
                "let cpkit choose"
            )
        return cls(p2p_batched=None if batched == "auto" else batched == "1",
                   a2a_chunks=int(chunks), kernel=kernel or None)


@functools.lru_cache(maxsize=1)
def default_options() -> CPAttentionOptions:
    """The options used when none are passed: `CPAttentionOptions.from_env()`, read once per
    process (set the variables before the first CP attention call, e.g. in the launcher)."""
    return CPAttentionOptions.from_env()
