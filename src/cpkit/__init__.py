"""cpkit: context parallelism (CP) for megatron-core, tested on CPU (gloo) and GPUs (NCCL)."""

from cpkit.errors import CPConfigError, Violation

__all__ = ["CPConfigError", "Violation"]
__version__ = "0.1.0"
