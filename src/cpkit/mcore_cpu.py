"""Let an MCore GPTModel build and run forward/backward on CPU (gloo), for tests only.

megatron-core calls CUDA unconditionally in a few places. Each patch below (`PATCHES`, by name)
replaces exactly one such call with its device-neutral equivalent and changes nothing else; each
is a CPU-only necessity (tests/test_cpu_shim.py runs the MCore call each one replaces without it
and sees it fail on CPU):

| name | MCore symbol | on CUDA | under the shim |
|---|---|---|---|
| rope-emb | `RotaryEmbedding.get_emb` | moves `inv_freq` to `torch.cuda.current_device()` | keeps it on CPU |
| rope-init | `RotaryEmbedding.__init__` | builds `inv_freq` on CUDA unless `use_cpu_initialization` (MLA does not pass it) | passes True |
| rope-cp-index | `rope_utils.get_pos_emb_on_this_cp_rank` (and where imported by name) | index with `pin_memory=True`, `.cuda()` | index on the embedding's device |
| rng-fork | `CudaRNGStatesTracker.fork` | saves and restores the CUDA RNG state | a no-op context (equivalence tests run with dropout off) |
| causal-masks | `transformer.utils.get_default_causal_mask`, `get_sliding_window_causal_mask` (and in `fused_softmax`) | build on "cuda" | build on CPU |
| memory-buffer | `GlobalMemoryBuffer.get_tensor` | allocates on the current CUDA device | allocates on CPU |
| cuda-placement | `torch` as seen by `pipeline_parallel.schedules`, `.p2p_communication`, `transformer.moe.router`, `transformer.multi_token_prediction` | receive buffers and counters on `torch.cuda.current_device()` / "cuda", `torch.cuda.synchronize()` | `_CpuTorch`: `cuda.current_device()` is "cpu", `synchronize` does nothing, `zeros` / `empty` put "cuda" on CPU |
| te-linear | `multi_latent_attention.TELinear` | TE's class | where TE is missing but MCore's TE extension imports (a mock, not a class: MLA's isinstance raises), a class nothing is an instance of |
| te-gemm | `moe_utils.te_general_gemm` | TE's GEMM | 0.16 without TE: None (the router otherwise raises NameError) |

What the shim does NOT change: MCore's global memory buffer exists only where something created
it (initialize_model_parallel, `cpkit.compat.ensure_global_memory_buffer`, which cpkit.devices.
init_rank and the test models' local attention call on every device), and
`parallel_state.get_global_memory_buffer` raises after destroy_model_parallel on CPU as on CUDA
("global memory buffer is not initialized"). An earlier shim created it on demand, which hid a
Megatron-Bridge example that failed on CUDA (its cp=1 reference ran after destroy_model_parallel).

The shim is for processes that run MCore on CPU: the unit tier and gloo ranks, also on a host
that has GPUs (`device_in_use` says which device a process runs on). A process that runs MCore on
CUDA (an NCCL rank) never installs it. Library code never uses it.
"""

from __future__ import annotations

import contextlib
import operator
from functools import reduce

import torch

__all__ = ["device_in_use", "install_mcore_cpu_shim", "mcore_cpu_shim", "mcore_on_cuda", "shim_installed"]

_saved: list[tuple[object, str, object]] = []


def _get_emb_cpu(self, max_seq_len: int, offset: int = 0):
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _get_pos_emb_on_this_cp_rank_cpu(pos_emb, seq_dim, cp_group):
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _default_causal_mask_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_causal_mask_cpu(sq: int, skv: int, window_size):
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    allowed = torch.triu(allowed, diagonal=skv - sq - window_size[0])
    return ~torch.tril(allowed, diagonal=skv - sq + window_size[1])


class _NoTELinear:
    """Stands for Transformer Engine's TELinear where TE is not installed: matches nothing."""


def _rotary_init_on_cpu(original):
    def __init__(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        original(self, *args, **kwargs)

    return __init__


@contextlib.contextmanager
def _fork_noop(self, name=None):
    yield


def _get_tensor_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required_len = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        buf = self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device="cpu")
    return buf[:required_len].view(*tensor_shape)


def device_in_use() -> torch.device:
    """The device MCore runs on in this process: cuda:<local rank> in an NCCL rank, else cpu
    (the unit tier and gloo ranks run on CPU even where CUDA is present)."""
    from cpkit.process_device import device

    return device()


def _on_cpu(device):
    if device == "cuda" or isinstance(device, int) or getattr(device, "type", None) == "cuda":
        return "cpu"
    return device


class _CpuCuda:
    """torch.cuda as MCore's pipeline schedules use it, on CPU (see the module docstring)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(device=None):
        return None


class _CpuTorch:
    """The torch module for MCore's pipeline schedules on CPU: only CUDA placement differs."""

    def __init__(self, real):
        self._real = real
        self.cuda = _CpuCuda(real.cuda)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def zeros(self, *args, device=None, **kwargs):
        return self._real.zeros(*args, device=_on_cpu(device), **kwargs)

    def empty(self, *args, device=None, **kwargs):
        return self._real.empty(*args, device=_on_cpu(device), **kwargs)


def _patch(owner, attr, value):
    _saved.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


def shim_installed() -> bool:
    return bool(_saved)


def _rope_emb():
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    _patch(rotary_pos_embedding.RotaryEmbedding, "get_emb", _get_emb_cpu)


def _rope_init():
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    _patch(rotary_pos_embedding.RotaryEmbedding, "__init__",
           _rotary_init_on_cpu(rotary_pos_embedding.RotaryEmbedding.__init__))


def _rope_cp_index():
    from megatron.core.models.common.embeddings import rope_utils

    _patch(rope_utils, "get_pos_emb_on_this_cp_rank", _get_pos_emb_on_this_cp_rank_cpu)
    for mod_name in ("rotary_pos_embedding", "yarn_rotary_pos_embedding"):
        try:
            mod = __import__(f"megatron.core.models.common.embeddings.{mod_name}", fromlist=["_"])
        except ImportError:
            continue
        if hasattr(mod, "get_pos_emb_on_this_cp_rank"):
            _patch(mod, "get_pos_emb_on_this_cp_rank", _get_pos_emb_on_this_cp_rank_cpu)


def _rng_fork():
    from megatron.core.tensor_parallel import random as mcore_random

    _patch(mcore_random.CudaRNGStatesTracker, "fork", _fork_noop)


def _causal_masks():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    for module in (transformer_utils, fused_softmax):
        _patch(module, "get_default_causal_mask", _default_causal_mask_cpu)
        _patch(module, "get_sliding_window_causal_mask", _sliding_window_causal_mask_cpu)


def _memory_buffer():
    from megatron.core import utils

    _patch(utils.GlobalMemoryBuffer, "get_tensor", _get_tensor_cpu)


def _cuda_placement():
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.moe import router

    for module in (p2p_communication, schedules, router, multi_token_prediction):
        _patch(module, "torch", _CpuTorch(torch))


def _te_linear():
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(getattr(multi_latent_attention, "TELinear", _NoTELinear), type):
        _patch(multi_latent_attention, "TELinear", _NoTELinear)


def _te_gemm():
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without TE: a NameError in the router's gemm
        _saved.append((moe_utils, "te_general_gemm", None))
        moe_utils.te_general_gemm = None


PATCHES = {
    "rope-emb": _rope_emb,
    "rope-init": _rope_init,
    "rope-cp-index": _rope_cp_index,
    "rng-fork": _rng_fork,
    "causal-masks": _causal_masks,
    "memory-buffer": _memory_buffer,
    "cuda-placement": _cuda_placement,
    "te-linear": _te_linear,
    "te-gemm": _te_gemm,
}
"""The shim's patches by name (the module docstring's table says what each changes and why)."""


def install_mcore_cpu_shim(device: torch.device | str | None = None, *, leave_out: tuple[str, ...] = ()) -> bool:
    """Install the CPU patches (idempotent) when MCore runs on CPU in this process.

    `device` is the device this process runs MCore on; None means the launcher's device for this
    process (cuda under an NCCL rank, else cpu). Returns False, doing nothing, for a CUDA device.
    `leave_out`: names of PATCHES not to install (tests/test_cpu_shim.py shows each is needed).
    """
    unknown = sorted(set(leave_out) - set(PATCHES))
    if unknown:
        raise ValueError(f"leave_out={unknown}: not patches of the shim; choose from {sorted(PATCHES)}")
    if torch.device(device if device is not None else device_in_use()).type != "cpu":
        return False
    if _saved:
        return True
    for name, apply in PATCHES.items():
        if name not in leave_out:
            apply()
    return True


def uninstall_mcore_cpu_shim() -> None:
    """Undo every patch, in reverse order."""
    while _saved:
        owner, attr, value = _saved.pop()
        setattr(owner, attr, value)


@contextlib.contextmanager
def mcore_cpu_shim(device: torch.device | str | None = None):
    """Context manager form: install on entry (if needed), restore what it installed on exit."""
    installed_here = not _saved and install_mcore_cpu_shim(device)
    try:
        yield
    finally:
        if installed_here:
            uninstall_mcore_cpu_shim()


@contextlib.contextmanager
def mcore_on_cuda():
    """For a test that runs MCore on CUDA in a process where the shim may be installed (an xdist
    worker that ran CPU tests first): the shim's patches and MCore's global memory buffer (whose
    cached scratch tensors are then CPU tensors) are set aside for the block, a fresh buffer and
    MCore's CUDA RNG state are provided, and what was there is put back afterwards."""
    from megatron.core import parallel_state

    from cpkit.compat import ensure_cuda_rng_tracker, ensure_global_memory_buffer

    had_shim = shim_installed()
    uninstall_mcore_cpu_shim()
    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = None
    try:
        ensure_global_memory_buffer()
        ensure_cuda_rng_tracker()
        yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = buffer
        if had_shim:
            install_mcore_cpu_shim("cpu")
