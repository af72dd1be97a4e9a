"""Megatron-LM dev's hybrid-model CP code, loaded from the checkout named by CPKIT_MLM_SRC, for
the tests that hold it to cpkit's invariants (functional/test_mlm_hybrid_layout.py,
functional/test_mlm_gdn_cp.py, tests/test_mcore_gdn_reference.py).

`load_mlm_modules` makes `import megatron.core...` read the checkout's files in this process:
`megatron` and `megatron.core` become empty package objects whose `__path__` is the checkout
(the checkout's `megatron/core/__init__.py` pulls in the whole library), `parallel_state` is
imported first (the checkout's `utils` and `parallel_state` import each other, and its package
`__init__` normally breaks that cycle), then the asked modules. It is for rank processes and
fresh processes only: never in one that has imported the installed megatron-core.

`gloo_all_to_all` stands in for `megatron.core.tensor_parallel.mappings.all_to_all` on gloo:
dev's allocates the all-to-all-v output on `torch.cuda.current_device()` whatever the input's
device, so on CPU it cannot run (kept as a strict xfail by the layout test). The stand-in does
the same exchange on the input's device, so the conversion's own route arithmetic, packing and
scattering are what the gloo tests check; on NCCL dev's collective runs unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["LAYOUT_FILE", "GDN_FILE", "layout_skip_reason", "gdn_skip_reason", "load_mlm_modules",
           "gloo_all_to_all", "mlm_commit"]

MLM_SRC_ENV = "CPKIT_MLM_SRC"
LAYOUT_FILE = "megatron/core/context_parallel_layout/conversion.py"
GDN_FILE = "megatron/core/ssm/gated_delta_net/gdn.py"


def _root() -> Path | None:
    value = os.environ.get(MLM_SRC_ENV, "").strip()
    return Path(value) if value else None


def _missing(needed: str) -> str | None:
    root = _root()
    if root is None:
        return f"{MLM_SRC_ENV} is not set: point it at a Megatron-LM dev checkout to run its {needed}"
    if not (root / needed).is_file():
        return f"{MLM_SRC_ENV}={root} has no {needed} (not a Megatron-LM dev checkout with hybrid-model CP)"
    return None


def layout_skip_reason() -> str | None:
    """Why dev's context_parallel_layout cannot run here (a pytest skip reason), or None."""
    return _missing(LAYOUT_FILE)


def gdn_skip_reason(need_fla: bool = True, need_cuda: bool = True) -> str | None:
    """Why dev's GatedDeltaNet cannot run here, or None: the checkout, with `need_fla`
    flash-linear-attention (`fla`, from the fla-core wheel) and with `need_cuda` CUDA (fla's
    kernels are Triton). Its torch-native rule needs the checkout only."""
    reason = _missing(GDN_FILE)
    if reason or not need_fla:
        return reason
    if importlib.util.find_spec("fla") is None:
        return ("flash-linear-attention is not installed (import fla failed): install the fla-core "
                "wheel (pip install fla-core==0.6.0 einops) to run Megatron-LM dev's GatedDeltaNet")
    if need_cuda and not torch.cuda.is_available():
        return "no CUDA device: fla's gated delta rule kernels are Triton, GPU only"
    if need_cuda:
        from cpkit.hybrid.delta_rule import fla_refusal

        why = fla_refusal(torch.device("cuda"))
        if why:
            return f"{why}: Megatron-LM dev's GatedDeltaNet trains on fla only"
    return None


def mlm_commit() -> str:
    """The commit of the checkout at CPKIT_MLM_SRC (cpkit.upstream.checkouts), for reasons and reports."""
    from cpkit.upstream.checkouts import checkout_identity

    root = _root()
    return checkout_identity(root) if root is not None and root.is_dir() else "unknown"


def load_mlm_modules(names: Sequence[str], root: str | os.PathLike | None = None) -> dict[str, types.ModuleType]:
    """{name: module} for each dotted name, loaded from the checkout at `root` (default
    CPKIT_MLM_SRC). Raises ImportError when another megatron is already imported here."""
    root = Path(root if root is not None else _root()).resolve()
    loaded = sys.modules.get("megatron")
    if loaded is not None and list(getattr(loaded, "__path__", [])) != [str(root / "megatron")]:
        raise ImportError(f"megatron from {getattr(loaded, '__path__', '?')} is already imported in this "
                          f"process; load the checkout at {root} in a fresh process (a rank)")
    for name in ("megatron", "megatron.core"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")))]
            package.__package__ = name
            sys.modules[name] = package
            if "." in name:
                setattr(sys.modules["megatron"], "core", package)
    importlib.import_module("megatron.core.parallel_state")  # breaks the utils <-> parallel_state cycle
    return {name: importlib.import_module(name) for name in names}


class _GlooAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (input_split_sizes, output_split_sizes)
        x = x.contiguous()
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=list(output_split_sizes),
                               input_split_sizes=list(input_split_sizes), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back_out, back_in = ctx.splits  # the backward exchanges the other way
        return None, _GlooAllToAll.apply(ctx.group, grad, back_out, back_in), None, None


def gloo_all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    """dev's `all_to_all(group, input_, output_split_sizes_, input_split_sizes)` on the input's
    device (see the module docstring); equal splits when the sizes are None."""
    n = group.size()
    if input_split_sizes is None:
        input_split_sizes = [input_.shape[0] // n] * n
    if output_split_sizes_ is None:
        output_split_sizes_ = [input_.shape[0] // n] * n
    return _GlooAllToAll.apply(group, input_, list(output_split_sizes_), list(input_split_sizes))
