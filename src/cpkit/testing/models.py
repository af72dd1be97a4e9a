"""The tests' name for the small MCore GPT models of `cpkit.models` (re-exported: one module, two
names, so that benchmarks import the library and tests keep their imports)."""

from cpkit.models import (
    FEATURE_MODELS,
    GPTConfig,
    build_gpt,
    build_gpt_chunks,
    eval_step,
    init_weights,
    local_spec_name,
    make_batch,
    named_gradients,
    named_parameters_full,
    prepare_cpu,
    train_step,
)

__all__ = [
    "FEATURE_MODELS",
    "GPTConfig",
    "build_gpt",
    "build_gpt_chunks",
    "prepare_cpu",
    "init_weights",
    "local_spec_name",
    "make_batch",
    "train_step",
    "eval_step",
    "named_gradients",
    "named_parameters_full",
]
