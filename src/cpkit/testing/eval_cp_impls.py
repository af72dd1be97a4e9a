"""Eval-CP rebinding implementations behind one protocol, so one set of tests runs against each.

The protocol (`EvalCPImpl.context(model, eval_pgs, train_pgs)`): a context manager inside which
`model` (a module or a list of virtual-pipeline chunks) runs on `eval_pgs`, and after which,
also after an exception, the model holds what it held before. `train_pgs` is the collection the
model was built with; an implementation may use it or not.

Implementations:
- `cpkit_impl()`: cpkit.eval_cp.context.eval_cp_context (snapshot and restore; ignores train_pgs);
- `reinstall_impl()`: a stand-in that installs `eval_pgs` on entry and re-installs `train_pgs`
  on exit (no snapshot). It runs in CI so that the adapter path and the tests that tell the two
  designs apart are exercised without a Megatron-Bridge checkout;
- `bridge_impl()`: Megatron-Bridge's `megatron/bridge/training/eval_context_parallel_rebinding.py`
  (`eval_cp_context(model, eval_pgs, train_pgs)`), loaded by file path from the `src/` directory
  named by `CPKIT_BRIDGE_SRC`, or from an importable `megatron.bridge`. Only that file is loaded
  (Bridge's package `__init__` is not run; the file imports torch and megatron.core only), and
  nothing of it is replaced.

Each implementation carries its known deviations: test function name -> `Deviation` (reason,
the upstream symbol, the exception the test then raises). Tests turn them into strict xfails,
so a deviation that goes away (an upstream fix) fails the run until its record is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch

from cpkit.upstream.bridge import BRIDGE_SRC_ENV, bridge_src

__all__ = [
    "BRIDGE_SRC_ENV",
    "BRIDGE_MODULE_PATH",
    "Deviation",
    "EvalCPImpl",
    "available_impls",
    "bridge_impl",
    "cpkit_impl",
    "reinstall_context",
    "reinstall_impl",
]

BRIDGE_MODULE_PATH = Path("megatron/bridge/training/eval_context_parallel_rebinding.py")
"""Where Bridge's eval-CP rebinding module lies under its `src/` directory."""

_BRIDGE_MODULE = "megatron.bridge.training.eval_context_parallel_rebinding"


@dataclass(frozen=True)
class Deviation:
    """A known way an implementation fails one protocol test."""

    reason: str
    """What the implementation does instead, in one sentence."""
    upstream: str
    """The symbol responsible (module.function of the implementation)."""
    raises: type = AssertionError
    """The exception the test raises because of it (the xfail accepts only this)."""


@dataclass(frozen=True)
class EvalCPImpl:
    """One eval-CP rebinding implementation under the protocol (see the module docstring)."""

    name: str
    """Short id, used as the pytest parameter id."""
    context: Optional[Callable[[Any, Any, Any], ContextManager]]
    """`context(model, eval_pgs, train_pgs)`; None when the implementation is not available."""
    deviations: Mapping[str, Deviation] = field(default_factory=dict)
    """Test function name -> its known deviation (a strict xfail)."""
    skip_reason: Optional[str] = None
    """Why it cannot run here (one line), or None."""


# ---------------------------------------------------------------------------------------------
# cpkit


def _no_rederive(upstream: str) -> Deviation:
    return Deviation(
        "rebinds a cached cp_size but does not re-run _setup_variant_attrs, where MCore 0.19's "
        "GatedDeltaNet derives its per-rank split (feat_dim_split) from cp_size at build", upstream)


def cpkit_impl() -> EvalCPImpl:
    """cpkit.eval_cp.context.eval_cp_context under the protocol (train_pgs unused: it restores a snapshot)."""
    from cpkit.eval_cp.context import eval_cp_context

    def context(model, eval_pgs, train_pgs):
        return eval_cp_context(model, eval_pgs)

    return EvalCPImpl("cpkit", context, {})


# ---------------------------------------------------------------------------------------------
# The re-installing stand-in

_REINSTALL = "cpkit.testing.eval_cp_impls.reinstall_context"


def _install(model: Any, target: Any) -> None:
    """Point every cached CP-bearing reference of `model` at `target` (cpkit's REBIND_TABLE
    attributes, CP attention through set_context_parallel_group, each chunk's config CP size,
    the lru caches of the modules' classes). Records nothing: what was there is overwritten."""
    from cpkit.compat import get_pg
    from cpkit.eval_cp.context import REBIND_TABLE

    cp = get_pg(target, "cp")
    size = cp.size()
    ranks = torch.distributed.get_process_group_ranks(cp) if size > 1 else None
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        if config is not None and hasattr(config, "context_parallel_size"):
            config.context_parallel_size = size
        for module in chunk.modules():
            attention = callable(getattr(type(module), "set_context_parallel_group", None))
            for rule in REBIND_TABLE:
                if rule.attr not in vars(module) or (attention and rule.attr == "cp_group"):
                    continue
                group = target if rule.kind == "collection" else get_pg(target, rule.source)
                setattr(module, rule.attr, group.size() if rule.kind == "size" else group)
            if attention:
                stream = getattr(type(module), "cp_stream", None)
                on = size > 1
                module.set_context_parallel_group(cp if on else None, ranks, stream if on else None,
                                                  module.cp_comm_type)
            for value in vars(type(module)).values():
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@contextlib.contextmanager
def reinstall_context(model: Any, eval_pgs: Any, train_pgs: Any):
    """Stand-in eval-CP context: install `eval_pgs` on entry, install `train_pgs` on exit (also
    on an exception). The design that re-installs instead of restoring a snapshot, written
    here so the protocol tests can show what it loses."""
    _install(model, eval_pgs)
    try:
        yield
    finally:
        _install(model, train_pgs)


def _reinstall_deviations(upstream: str) -> dict[str, Deviation]:
    """What any re-installing design fails: the tests are written so these hold for it too."""
    return {
        "test_a_module_on_another_collection_gets_it_back": Deviation(
            "exit re-installs train_pgs instead of restoring what each module held, so a module "
            "built on another collection ends on train_pgs", upstream),
        "test_te_like_attention_is_bound_inside_and_restored_after": Deviation(
            "exit calls set_context_parallel_group again with the training group instead of "
            "restoring the attributes that call wrote: an instance cp_stream now shadows the "
            "class-level one, and arguments the call does not pass are back at their defaults",
            upstream),
    }


def reinstall_impl() -> EvalCPImpl:
    """The re-installing stand-in (`reinstall_context`) under the protocol."""
    deviations = _reinstall_deviations(_REINSTALL)
    deviations["test_a_cached_cp_size_rederives_what_was_built_from_it"] = _no_rederive(_REINSTALL)
    return EvalCPImpl("reinstall", reinstall_context, deviations)


# ---------------------------------------------------------------------------------------------
# Megatron-Bridge


def _bridge_file() -> tuple[Optional[Path], str]:
    """(path of Bridge's rebinding module, "") or (None, why it was not found)."""
    src, why = bridge_src(marker=BRIDGE_MODULE_PATH)
    return (src / BRIDGE_MODULE_PATH if src is not None else None), why


def _load_bridge(path: Path) -> Any:
    """Bridge's rebinding module from `path`, on its own (Bridge's package __init__ not run)."""
    # One module name per file, so a second checkout in the same process is loaded, not reused.
    name = "_cpkit_bridge_rebinding_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        del sys.modules[name]
        if (err.name or "").startswith("megatron.bridge"):
            raise ImportError(
                f"{path} imports {err.name}, another Bridge module; only the file itself is loaded "
                "from CPKIT_BRIDGE_SRC, so install that checkout (pip install -e <checkout>) for its "
                "imports to resolve") from err
        raise
    except BaseException:
        del sys.modules[name]
        raise
    return module


# Protocol tests that check the restore of a GPT model built at CP 1 (its CP attention's
# cp_group is None there).
_GPT_RESTORE_TESTS = (
    "test_every_cp_reference_is_the_target_inside_and_the_original_after",
    "test_an_exception_inside_the_block_restores",
    "test_1000_enter_exit_cycles_leave_no_drift",
    "test_a_list_of_vpp_chunks_is_rebound_and_a_shared_config_restored",
    "test_two_models_in_a_list_each_get_their_config",
    "test_cp_attention_built_without_cp_holds_none_again",
)


def _bridge_deviations() -> dict[str, Deviation]:
    """Bridge's known deviations from the protocol, as recorded against Megatron-Bridge main of
    2026-08-22 (commit 067f987) on MCore 0.16.1 without TE."""
    install = f"{_BRIDGE_MODULE}.install_pg_collection"
    out = _reinstall_deviations(f"{_BRIDGE_MODULE}.eval_cp_context")
    none_back = Deviation(
        "sets every module's cp_group attribute to the target's cp group, and exit installs the "
        "training one, so CP attention built at CP 1 (cp_group None) ends on the size-1 training "
        "cp group", install)
    for test in _GPT_RESTORE_TESTS:
        out[test] = none_back
    out["test_rebinding_works_without_transformer_engine"] = Deviation(
        "without Transformer Engine, MCore's TE extension defines TEDotProductAttention as a "
        "MagicMock, so the guarded import succeeds and isinstance(module, TEDotProductAttention) "
        "raises TypeError on the first module", install, TypeError)
    return out


def bridge_impl() -> EvalCPImpl:
    """Megatron-Bridge's eval_cp_context under the protocol, or an EvalCPImpl with a skip reason
    when no checkout is given. Raises CPConfigError when CPKIT_BRIDGE_SRC names no Bridge src/."""
    path, why = _bridge_file()
    if path is None:
        return EvalCPImpl("bridge", None, skip_reason=why)
    module = _load_bridge(path)

    def context(model, eval_pgs, train_pgs):
        return module.eval_cp_context(model, eval_pgs, train_pgs)

    return EvalCPImpl("bridge", context, _bridge_deviations())


def available_impls() -> list[EvalCPImpl]:
    """cpkit, the re-installing stand-in and Bridge (the last with a skip reason when absent)."""
    return [cpkit_impl(), reinstall_impl(), bridge_impl()]
