"""The CPU shim follows the device a process runs MCore on, and steps aside for CUDA sections."""

import torch

from cpkit import mcore_cpu as cpu_shim


def test_the_shim_installs_for_cpu_and_never_for_cuda(mcore_cpu):
    assert cpu_shim.install_mcore_cpu_shim(torch.device("cpu")) and cpu_shim.shim_installed()
    assert cpu_shim.install_mcore_cpu_shim("cuda:0") is False  # an NCCL rank's device: untouched


def test_a_cuda_section_sets_the_shim_and_its_cpu_buffer_aside_and_puts_them_back(mcore_cpu):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from cpkit.compat import ensure_global_memory_buffer

    cpu_shim.install_mcore_cpu_shim("cpu")
    ensure_global_memory_buffer()
    cpu_buffer, patched = parallel_state._GLOBAL_MEMORY_BUFFER, RotaryEmbedding.get_emb
    with cpu_shim.mcore_on_cuda():
        assert not cpu_shim.shim_installed() and RotaryEmbedding.get_emb is not patched
        assert parallel_state._GLOBAL_MEMORY_BUFFER not in (None, cpu_buffer)  # a fresh buffer
    assert cpu_shim.shim_installed() and parallel_state._GLOBAL_MEMORY_BUFFER is cpu_buffer
    assert RotaryEmbedding.get_emb.__name__ == patched.__name__


# --- each patch is a CPU-only necessity, and the shim is no kinder than MCore on CUDA --------------

import pytest  # noqa: E402

from cpkit.compat import new_pg_collection, schedule_pg_collection  # noqa: E402


def _rope_emb(group):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding(8, 1.0, use_cpu_initialization=True).get_emb(16)


def _rope_init(group):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding(8, 1.0)


def _rope_cp_index(group):
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils.get_pos_emb_on_this_cp_rank(torch.zeros(8, 1, 1, 4), 0, group)


def _rng_fork(group):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with CudaRNGStatesTracker().fork():
        pass


def _causal_masks(group):
    from megatron.core.transformer import utils as transformer_utils

    transformer_utils.get_default_causal_mask(4)
    transformer_utils.get_sliding_window_causal_mask(4, 4, (2, 0))


def _memory_buffer(group):
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer().get_tensor((4,), torch.float32, "probe")


class _Tiny(torch.nn.Module):
    def __init__(self):
        from megatron.core.transformer.transformer_config import TransformerConfig

        super().__init__()
        from megatron.core.enums import ModelType

        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        self.model_type = ModelType.encoder_or_decoder
        self.w = torch.nn.Parameter(torch.ones(1))

    def set_input_tensor(self, tensor):
        pass


def _cuda_placement(group):
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    def forward_step(data_iterator, model):
        out = model.w * next(data_iterator)
        return out, lambda o: (o.sum(), torch.tensor(1, dtype=torch.int), {"loss": o.sum().detach()})

    get_forward_backward_func(pp_size=1, vp_size=None)(forward_step_func=forward_step, data_iterator=iter([torch.ones(2)]),
                                model=[_Tiny()], num_microbatches=1, seq_length=2, micro_batch_size=1,
                                forward_only=True,
                                pg_collection=schedule_pg_collection(new_pg_collection(pp=group, tp=group, cp=group, dp_cp=group)))


PROBES = {"rope-emb": _rope_emb, "rope-init": _rope_init, "rope-cp-index": _rope_cp_index, "rng-fork": _rng_fork,
          "causal-masks": _causal_masks, "memory-buffer": _memory_buffer, "cuda-placement": _cuda_placement}


@pytest.fixture
def shim_without(world1):
    """install(leave_out=...) for the test, the whole shim (as the session had it) after."""
    from megatron.core.transformer import utils as transformer_utils

    had = cpu_shim.shim_installed()

    def install(*leave_out):
        cpu_shim.uninstall_mcore_cpu_shim()
        cpu_shim.install_mcore_cpu_shim("cpu", leave_out=leave_out)
        for cached in (transformer_utils.get_default_causal_mask,):
            getattr(cached, "cache_clear", lambda: None)()

    yield install
    cpu_shim.uninstall_mcore_cpu_shim()
    if had:
        cpu_shim.install_mcore_cpu_shim("cpu")


def test_every_patch_has_a_probe():
    assert set(PROBES) == set(cpu_shim.PATCHES) - {"te-linear", "te-gemm"}  # those two: below


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what CPU-only torch refuses")
@pytest.mark.parametrize("name", sorted(PROBES))
def test_each_patch_is_needed_on_cpu_and_enough(shim_without, world1, name):
    group = torch.distributed.new_group([0])
    shim_without()
    PROBES[name](group)  # the whole shim: MCore's call runs on CPU
    shim_without(name)
    with pytest.raises(Exception):  # noqa: B017 - CUDA missing surfaces as RuntimeError, AssertionError, ...
        PROBES[name](group)


def test_the_te_patches_apply_only_where_mcore_lacks_te(shim_without):
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    shim_without("te-linear", "te-gemm")
    linear_is_class = isinstance(getattr(multi_latent_attention, "TELinear", type), type)
    has_gemm = hasattr(moe_utils, "te_general_gemm")
    shim_without()
    assert isinstance(multi_latent_attention.TELinear, type)
    assert hasattr(moe_utils, "te_general_gemm")
    if linear_is_class:  # nothing to do: the shim left it as MCore has it
        assert multi_latent_attention.TELinear is not cpu_shim._NoTELinear or not has_gemm
    if not linear_is_class:
        with pytest.raises(TypeError):  # what MLA's isinstance does with the mock
            shim_without("te-linear")
            isinstance(object(), multi_latent_attention.TELinear)


def test_leave_out_names_only_patches(world1):
    with pytest.raises(ValueError, match="rope-emb"):
        cpu_shim.install_mcore_cpu_shim("cpu", leave_out=("rope",))


def test_the_memory_buffer_is_not_recreated_after_destroy_model_parallel_as_on_cuda(shim_without):
    from megatron.core import parallel_state

    from cpkit.compat import ensure_global_memory_buffer

    shim_without()
    saved = parallel_state._GLOBAL_MEMORY_BUFFER
    try:
        ensure_global_memory_buffer()
        assert parallel_state.get_global_memory_buffer() is not None
        parallel_state.destroy_model_parallel()
        with pytest.raises(AssertionError, match="global memory buffer is not initialized"):
            parallel_state.get_global_memory_buffer()
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved
