"""What one cell of `python -m cpkit.bench attention` runs, per backend: a function that does one
forward + backward on this rank's shard (cpkit, TE, single-GPU SDPA) or, for torch's
experimental CP, a context manager that yields one. Inputs are random in the run's dtype; a
cell's feature (`attention_features.py`) sets its mask, sink and head dims for cpkit and TE.
"""

from __future__ import annotations

import torch

from cpkit.bench.attention.attention_features import feature
from cpkit.parallel.layout import A2A_P2P

__all__ = ["step_cpkit", "step_te", "step_sdpa", "TorchCP"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _rand(shape, s, dev, grad=True):
    t = torch.randn(*shape, device=dev, dtype=_DTYPES[s.dtype])
    return t.requires_grad_(grad)


def step_cpkit(case, s, dev, groups):
    """One fwd+bwd of cpkit's CP attention for `case` (its feature's mask, sink and head dims)."""
    from cpkit.attention import context_parallel_attention

    f = feature(case.feature, s.window)
    d_qk, d_v = f.head_dims(s.head_dim)
    kvh = f.kv_heads(s.heads, case.kv_heads)
    local = case.seq // case.cp
    q = _rand((local, s.batch, s.heads, d_qk), s, dev)
    k = _rand((local, s.batch, kvh, d_qk), s, dev)
    v = _rand((local, s.batch, kvh, d_v), s, dev)
    dout = _rand((local, s.batch, s.heads, d_v), s, dev, grad=False)
    sink = torch.zeros(s.heads, device=dev, dtype=torch.float32, requires_grad=True) if f.sink else None
    inputs = (q, k, v) + ((sink,) if f.sink else ())
    group = groups[("hcp", case.cp)] if case.comm == A2A_P2P else groups[("cp", case.cp)]

    def step():
        out = context_parallel_attention(q, k, v, cp_group=group, cp_comm_type=case.comm, causal=f.causal,
                                         window_size=f.window, softmax_offset=sink)
        torch.autograd.grad(out, inputs, dout)

    return step


def step_te(case, s, dev, groups):
    """The same cell through Transformer Engine's DotProductAttention bound to the same groups."""
    import torch.distributed as dist
    import transformer_engine.pytorch as te

    f = feature(case.feature, s.window)
    d_qk, d_v = f.head_dims(s.head_dim)
    kvh = f.kv_heads(s.heads, case.kv_heads)
    local = case.seq // case.cp
    cp_group = groups[("cp", case.cp)]
    group = groups[("hcp", case.cp)] if case.comm == A2A_P2P else cp_group
    extra = {"window_size": f.window} if f.window else {}
    if f.sink:
        extra["softmax_type"] = "learnable"
    attn = te.DotProductAttention(
        num_attention_heads=s.heads,
        kv_channels=(d_qk, d_v) if f.dims else d_qk,
        num_gqa_groups=kvh,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal" if f.causal else "no_mask",
        **extra,
    ).to(dev)
    attn.set_context_parallel_group(
        group, dist.get_process_group_ranks(cp_group), torch.cuda.Stream(), case.comm
    )
    q = _rand((local, s.batch, s.heads, d_qk), s, dev)
    k = _rand((local, s.batch, kvh, d_qk), s, dev)
    v = _rand((local, s.batch, kvh, d_v), s, dev)
    dout = _rand((local, s.batch, s.heads * d_v), s, dev, grad=False)
    inputs = (q, k, v) + tuple(p for p in attn.parameters() if p.requires_grad)

    def step():
        out = attn(q, k, v)
        torch.autograd.grad(out, inputs, dout)

    return step


def _sdpa_inputs(case, s, dev, seq: int, expand_kv: bool):
    kvh = s.heads if expand_kv else case.kv_heads
    q = _rand((s.batch, s.heads, seq, s.head_dim), s, dev)
    k = _rand((s.batch, kvh, seq, s.head_dim), s, dev)
    v = _rand((s.batch, kvh, seq, s.head_dim), s, dev)
    return q, k, v


def step_sdpa(case, s, dev, groups, expand_kv: bool = False):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _sdpa_inputs(case, s, dev, case.seq, expand_kv)
    dout = torch.randn_like(q)
    gqa = k.shape[1] != q.shape[1]
    backends = [SDPBackend.CUDNN_ATTENTION] if dev.type == "cuda" else None

    def step():
        if backends is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        torch.autograd.grad(out, (q, k, v), dout)

    return step


class TorchCP:
    """torch's experimental context_parallel (allgather rotation), entered around the timing."""

    def __init__(self, case, s, dev, groups, expand_kv: bool = False):
        from torch.distributed.device_mesh import DeviceMesh

        self.case, self.s, self.dev, self.expand_kv = case, s, dev, expand_kv
        self.mesh = DeviceMesh.from_group(groups[("cp", case.cp)], device_type=dev.type)

    def __enter__(self):
        import torch.nn.functional as F
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental import _attention as cp_attention

        self._options = cp_attention._cp_options
        self._old_rotate = self._options.rotate_method
        cp_attention.set_rotate_method("allgather")
        try:
            q, k, v = (t.detach() for t in _sdpa_inputs(self.case, self.s, self.dev, self.case.seq, self.expand_kv))
            self._ctx = context_parallel(
                self.mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}
            )
            self._ctx.__enter__()
        except BaseException:
            self._options.rotate_method = self._old_rotate
            raise
        # The buffers are now this rank's shards; differentiate with respect to them.
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)
        gqa = k.shape[1] != q.shape[1]

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            torch.autograd.grad(out, (q, k, v), dout)

        return step

    def __exit__(self, *exc):
        try:
            self._ctx.__exit__(*exc)
        finally:
            self._options.rotate_method = self._old_rotate
        return False
