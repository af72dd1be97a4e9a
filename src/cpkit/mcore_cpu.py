"""Let an MCore GPTModel build and run forward/backward on CPU (gloo), for tests only.

megatron-core calls CUDA unconditionally in a few places. Each patch below replaces exactly one
such call with its device-neutral equivalent and changes nothing else:

- `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`: keep it on CPU.
- `RotaryEmbedding.__init__` builds `inv_freq` on the CUDA device unless told
  `use_cpu_initialization` (MCore's MLA attention does not pass it): pass True.
- `multi_latent_attention.TELinear` is a mock, not a class, where MCore's TE extension imports
  without Transformer Engine (HAVE_TE is still True), so MLA's `isinstance(..., TELinear)`
  raises: give it a class that nothing is an instance of.
- `rope_utils.get_pos_emb_on_this_cp_rank` builds its index with `pin_memory=True` and `.cuda()`:
  build it on the embedding's device (patched where it is imported by name too).
- `CudaRNGStatesTracker.fork` saves and restores the CUDA RNG state: a no-op context on CPU
  (equivalence tests run with dropout off, so no random numbers are drawn inside it).
- `transformer.utils.get_default_causal_mask` and `get_sliding_window_causal_mask` build their
  masks on "cuda" (MCore's local attention at cp=1 uses them through fused_softmax, the second
  with `window_size`): build them on CPU.
- `GlobalMemoryBuffer.get_tensor` allocates on the current CUDA device: allocate on CPU; and
  `parallel_state.get_global_memory_buffer` creates the buffer on first use (the decentralized
  process-group path never calls initialize_model_parallel, which would create it).
- The pipeline schedules (`pipeline_parallel.schedules`, `.p2p_communication`), the MoE router
  (`transformer.moe.router`, which moves its weight to the current CUDA device) and MTP's
  `roll_tensor` (`transformer.multi_token_prediction`) allocate their
  receive buffers and token counters on `torch.cuda.current_device()` / `device="cuda"` and call
  `torch.cuda.synchronize()` after batched transfers: those two modules see a `torch` whose
  `cuda.current_device()` is "cpu", whose `cuda.synchronize()` does nothing, and whose `zeros` /
  `empty` put a "cuda" device on CPU (`_CpuTorch`); everything else is the real torch.

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
    from cpkit.launch import device

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


def install_mcore_cpu_shim(device: torch.device | str | None = None) -> bool:
    """Install the CPU patches (idempotent) when MCore runs on CPU in this process.

    `device` is the device this process runs MCore on; None means the launcher's device for this
    process (cuda under an NCCL rank, else cpu). Returns False, doing nothing, for a CUDA device.
    """
    if torch.device(device if device is not None else device_in_use()).type != "cpu":
        return False
    if _saved:
        return True
    from megatron.core import parallel_state, utils
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mcore_random

    _patch(rotary_pos_embedding.RotaryEmbedding, "get_emb", _get_emb_cpu)
    _patch(rotary_pos_embedding.RotaryEmbedding, "__init__",
           _rotary_init_on_cpu(rotary_pos_embedding.RotaryEmbedding.__init__))
    _patch(rope_utils, "get_pos_emb_on_this_cp_rank", _get_pos_emb_on_this_cp_rank_cpu)
    for mod_name in ("rotary_pos_embedding", "yarn_rotary_pos_embedding"):
        try:
            mod = __import__(f"megatron.core.models.common.embeddings.{mod_name}", fromlist=["_"])
        except ImportError:
            continue
        if hasattr(mod, "get_pos_emb_on_this_cp_rank"):
            _patch(mod, "get_pos_emb_on_this_cp_rank", _get_pos_emb_on_this_cp_rank_cpu)
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    _patch(transformer_utils, "get_default_causal_mask", _default_causal_mask_cpu)
    _patch(fused_softmax, "get_default_causal_mask", _default_causal_mask_cpu)
    _patch(transformer_utils, "get_sliding_window_causal_mask", _sliding_window_causal_mask_cpu)
    _patch(fused_softmax, "get_sliding_window_causal_mask", _sliding_window_causal_mask_cpu)
    _patch(mcore_random.CudaRNGStatesTracker, "fork", _fork_noop)
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(getattr(multi_latent_attention, "TELinear", _NoTELinear), type):
        _patch(multi_latent_attention, "TELinear", _NoTELinear)
    _patch(utils.GlobalMemoryBuffer, "get_tensor", _get_tensor_cpu)

    original_get_buffer = parallel_state.get_global_memory_buffer

    def get_global_memory_buffer():
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._GLOBAL_MEMORY_BUFFER = utils.GlobalMemoryBuffer()
        return original_get_buffer()

    _patch(parallel_state, "get_global_memory_buffer", get_global_memory_buffer)

    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.moe import router

    for module in (p2p_communication, schedules, router, multi_token_prediction):
        _patch(module, "torch", _CpuTorch(torch))
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without TE: a NameError in the router's gemm
        _saved.append((moe_utils, "te_general_gemm", None))
        moe_utils.te_general_gemm = None
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
