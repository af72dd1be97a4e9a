"""The CPU shim follows the device a process runs MCore on, and steps aside for CUDA sections."""

import torch

from cpkit import mcore_cpu as cpu_shim


def test_the_shim_installs_for_cpu_and_never_for_cuda(mcore_cpu):
    assert cpu_shim.install_mcore_cpu_shim(torch.device("cpu")) and cpu_shim.shim_installed()
    assert cpu_shim.install_mcore_cpu_shim("cuda:0") is False  # an NCCL rank's device: untouched


def test_a_cuda_section_sets_the_shim_and_its_cpu_buffer_aside_and_puts_them_back(mcore_cpu):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cpu_shim.install_mcore_cpu_shim("cpu")
    parallel_state.get_global_memory_buffer()
    cpu_buffer, patched = parallel_state._GLOBAL_MEMORY_BUFFER, RotaryEmbedding.get_emb
    with cpu_shim.mcore_on_cuda():
        assert not cpu_shim.shim_installed() and RotaryEmbedding.get_emb is not patched
        assert parallel_state._GLOBAL_MEMORY_BUFFER not in (None, cpu_buffer)  # a fresh buffer
    assert cpu_shim.shim_installed() and parallel_state._GLOBAL_MEMORY_BUFFER is cpu_buffer
    assert RotaryEmbedding.get_emb.__name__ == patched.__name__
