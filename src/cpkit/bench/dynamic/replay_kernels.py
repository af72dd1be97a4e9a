"""The replay's timer: the kernels a rank runs, executed for real and timed, cached by shape.

- `layers(tokens)`: one transformer layer's GEMMs forward + backward over `tokens` local tokens
  (QKV, output projection, the MLP's input projection(s) and SwiGLU / GELU, output projection;
  weights and inputs with gradients, through autograd). Timed on a grid (steps of 1/32 of the
  power of two below the token count, at least 16 tokens) and interpolated linearly between
  the two grid points around the asked count: GEMM time is piecewise linear in the row count.
- `call(AttnCall)`: cpkit's own kernels (cpkit.attention.kernels.attn_fwd / attn_bwd, the calls
  cpkit.attention.p2p makes; flash varlen on CUDA) at the call's THD shape, forward and
  backward timed separately. Cached by the sorted chunk lengths (a varlen call's time does not
  depend on the order of its sequences).

Every shape: `warmup` untimed runs, then `iters` timed with CUDA events (host clock on CPU),
median. bf16 on CUDA, fp32 on CPU (the CPU run is a smoke test, not a measurement).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from cpkit.attention.kernels import attn_bwd, attn_fwd
from cpkit.bench.dynamic.replay_work import AttnCall
from cpkit.dynamic.cost import ModelDims

__all__ = ["KernelTimer", "grid_step"]


def grid_step(tokens: int) -> int:
    """Spacing of the GEMM grid around `tokens`: 1/32 of the power of two below it, >= 16."""
    return max(16, 1 << max(0, tokens.bit_length() - 6))


class KernelTimer:
    """Times the replay's kernels on `device` for a model of `dims` (module docstring)."""

    def __init__(self, dims: ModelDims, device: torch.device, *, warmup: int = 1, iters: int = 3,
                 kernel: str | None = None):
        self.dims, self.device = dims, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.warmup, self.iters, self.kernel = warmup, iters, kernel
        self._gemm: dict[int, float] = {}
        self._calls: dict[tuple, tuple[float, float]] = {}
        self._weights = None
        self.measured = 0  # shapes run on the device

    # ------------------------------------------------------------------ timing

    def _time(self, fn: Callable[[], None]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e-3

    # ------------------------------------------------------------------ GEMMs

    def _layer_weights(self):
        if self._weights is None:
            d = self.dims
            h, ffn = d.hidden_size, d.ffn_hidden_size or 4 * d.hidden_size
            mlp_in = 2 * ffn if d.gated_linear_unit else ffn
            shapes = [(h, (d.num_heads + 2 * d.num_kv_heads) * d.head_dim),
                      (d.num_heads * d.head_dim, h), (h, mlp_in), (ffn, h)]
            self._weights = [(torch.randn(a, b, device=self.device, dtype=self.dtype) / math.sqrt(a))
                             .requires_grad_() for a, b in shapes]
        return self._weights

    def _gemm_at(self, tokens: int) -> float:
        if tokens not in self._gemm:
            d = self.dims
            w = self._layer_weights()
            x = torch.randn(tokens, d.hidden_size, device=self.device, dtype=self.dtype,
                            requires_grad=True)
            q_width = d.num_heads * d.head_dim

            def step():
                qkv = x @ w[0]
                o = qkv[:, :q_width] @ w[1]
                up = o @ w[2]
                if d.gated_linear_unit:
                    gate, val = up.chunk(2, dim=-1)
                    act = torch.nn.functional.silu(gate) * val
                else:
                    act = torch.nn.functional.gelu(up)
                (act @ w[3]).sum().backward()

            self._gemm[tokens] = self._time(step)
            self.measured += 1
            del x
        return self._gemm[tokens]

    def layers(self, tokens: int) -> float:
        """Seconds of one layer's GEMMs fwd+bwd over `tokens` tokens (grid-interpolated)."""
        if tokens <= 0:
            return 0.0
        step = grid_step(tokens)
        lo = max(step, tokens // step * step)
        if lo == tokens:
            return self._gemm_at(tokens)
        hi = lo + step
        t_lo, t_hi = self._gemm_at(lo), self._gemm_at(hi)
        return t_lo + (t_hi - t_lo) * (tokens - lo) / (hi - lo)

    # ------------------------------------------------------------------ attention

    def call(self, call: AttnCall) -> tuple[float, float]:
        """(forward s, backward s) of one ring step's attention call (one layer)."""
        key = (call.kind, tuple(sorted(call.chunks)))
        if key not in self._calls:
            self._calls[key] = self._measure(AttnCall(call.kind, key[1]))
            self.measured += 1
        return self._calls[key]

    def _measure(self, call: AttnCall) -> tuple[float, float]:
        d, dev = self.dims, self.device

        def cu(lens):
            offs = [0]
            for n in lens:
                offs.append(offs[-1] + n)
            return torch.tensor(offs, dtype=torch.int32, device=dev)

        q_lens, k_lens = call.q_lens, call.k_lens
        q = torch.randn(sum(q_lens), d.num_heads, d.head_dim, device=dev, dtype=self.dtype)
        k = torch.randn(sum(k_lens), d.num_kv_heads, d.head_dim, device=dev, dtype=self.dtype)
        v = torch.randn_like(k)
        kw = dict(cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens), max_seqlen_q=max(q_lens),
                  max_seqlen_k=max(k_lens), kernel=self.kernel)
        scale = d.head_dim ** -0.5
        out, lse = attn_fwd(q, k, v, call.causal, scale, **kw)
        dout = torch.randn_like(out)
        fwd = self._time(lambda: attn_fwd(q, k, v, call.causal, scale, **kw))
        bwd = self._time(lambda: attn_bwd(dout, q, k, v, out, lse, call.causal, scale, **kw))
        return fwd, bwd
