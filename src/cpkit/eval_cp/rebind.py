"""Rebinding a built model's process groups, and putting them back exactly.

A model built for one layout caches its process groups on many modules (MCore passes
`pg_collection` down at construction, and several modules keep a group or a size of their own).
`install_pg_collection(model, target)` rebinds every cached CP-bearing reference to the groups of
`target` (a ProcessGroupCollection over the same ranks, tp and pp unchanged) and returns a
`Rebinding`, the recorder of every change, whose `restore()` puts back exactly the objects that
were there before (a snapshot, not a re-install). Eval CP (`cpkit.eval_cp.context.eval_cp_context`) and
dynamic CP (`cpkit.dynamic.runtime.use_cp_group`) both switch groups through it.

What is rebound, on every module of the model (or of each virtual-pipeline chunk in a list):
- the attributes of `REBIND_TABLE`, the single source of truth (`pg_collection`, `cp_group`,
  `tp_cp_group`, `dp_cp_group`, `tp_dp_cp_group`, `hcp`, and the cached size `cp_size`);
- CP core attention (cpkit's ContextParallelAttention, TE's DotProductAttention and MCore's
  TEDotProductAttention): through `set_context_parallel_group(cp_group, cp_global_ranks,
  cp_stream, cp_comm_type)`, with `[a2a, p2p]` for a2a+p2p and MCore's class-level CP stream for
  TE; their `CP_ATTENTION_ATTRS` are snapshotted first;
- `config.context_parallel_size` (and `hierarchical_context_parallel_sizes` / `cp_comm_type`
  where they change), once per distinct config object: MCore multiplies the RoPE length by it;
- caches that hold CP-sliced values: the lru cache of RotaryEmbedding.forward (keyed without the
  CP group) is cleared on entry and on exit, and YaRN's cos/sin cache is invalidated.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from cpkit.compat import get_pg
from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.layout import A2A_P2P, CP_COMM_TYPES, P2P
from cpkit.parallel.group_info import check_hierarchical_groups, global_ranks, group_size, members

__all__ = [
    "RebindRule",
    "REBIND_TABLE",
    "CP_ATTENTION_ATTRS",
    "UNSUPPORTED_MODULES",
    "EvalCPWarning",
    "Rebinding",
    "install_pg_collection",
    "rebound",
    "model_roots",
]

ModelOrChunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]



@dataclass(frozen=True)
class RebindRule:
    """One module attribute that caches a CP-bearing group (or a size derived from one)."""

    attr: str
    """The attribute name on the module instance."""
    source: str
    """What it is rebound to: "collection" (the whole target), or a ProcessGroupCollection field."""
    kind: str
    """"collection", "group" (the target's field) or "size" (the size of the target's field)."""
    seen_in: str
    """Where MCore (0.16 / 0.19) keeps it; documentation only."""


REBIND_TABLE: tuple[RebindRule, ...] = (
    RebindRule("pg_collection", "collection", "collection",
               "GPTModel (LanguageModule), TransformerBlock, TransformerLayer, Attention, "
               "DotProductAttention, MambaMixer, GatedDeltaNet, Float16Module, cpkit ContextParallelAttention"),
    RebindRule("cp_group", "cp", "group",
               "LanguageModule, RotaryEmbedding, MultimodalRotaryEmbedding, TopKRouter, MultiTokenPrediction"),
    RebindRule("tp_cp_group", "tp_cp", "group", "TopKRouter"),
    RebindRule("dp_cp_group", "dp_cp", "group", "DistributedDataParallel, CUDA-graph runner"),
    RebindRule("tp_dp_cp_group", "tp_dp_cp", "group", "TopKRouter"),
    RebindRule("hcp", "hcp", "group", "modules that keep pg_collection.hcp ([a2a, p2p]) themselves"),
    RebindRule("cp_size", "cp", "size", "GatedDeltaNet (0.19) derives its head split from it"),
)
"""Every module attribute eval CP rebinds (instance attributes only; a property is never set).
The CP attention modules' own `cp_group` is left to set_context_parallel_group."""

CP_ATTENTION_ATTRS = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type", "load_balancing_strategy")
"""Attributes set_context_parallel_group writes (TE 2.x and cpkit); snapshotted before the call."""

UNSUPPORTED_MODULES = {
    "megatron.core.transformer.dot_product_attention.DotProductAttention":
        "MCore's local core attention has no CP (it asserts context_parallel_size == 1); build the "
        "model with cpkit's ContextParallelAttention (cpkit.attention.spec) or TE's attention",
    "megatron.core.ssm.mamba_context_parallel.MambaContextParallel":
        "derives per-rank head, group and state sizes from the CP size when it is built; build "
        "the model at the eval CP size instead",
}
"""Classes (by module.qualname, subclasses included) that cannot run at another CP size by
rebinding; install_pg_collection refuses them when the CP size changes."""

# YaRN keeps cos/sin computed (CP-sliced) at build; forcing the length check to fail rebuilds them.
_DERIVED_CACHE_ATTRS = ("max_seq_len_cached", "offset_cached", "dtype_cached", "packed_seq_cached",
                        "cos_cached", "sin_cached")

_MISSING = object()


class EvalCPWarning(UserWarning):
    """A rebinding that does nothing useful (e.g. a model without CP-bearing modules)."""


def model_roots(model: ModelOrChunks) -> list[torch.nn.Module]:
    """`model` as a list of chunks: [model], or the list of its virtual-pipeline chunks.
    Raises CPConfigError for anything else (an empty list, a non-module)."""
    roots = list(model) if isinstance(model, (list, tuple)) else [model]
    bad = [type(r).__name__ for r in roots if not isinstance(r, torch.nn.Module)]
    if not roots or bad:
        raise CPConfigError.single(
            "model", bad or "[]", "must be a torch.nn.Module or a non-empty list of them (VPP chunks)",
            "pass the model, or the list of its virtual-pipeline chunks")
    return roots


def _walk(roots: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module of every chunk, each module once."""
    seen: set[int] = set()
    out = []
    for i, root in enumerate(roots):
        prefix = f"[{i}]" if len(roots) > 1 else ""
        for name, module in root.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            full = f"{prefix}.{name}" if prefix and name else (prefix or name or "<model>")
            out.append((full, module))
    return out


def _is_cp_attention(module: torch.nn.Module) -> bool:
    # Looked up on the class: a missing attribute on the instance goes through
    # nn.Module.__getattr__ and an AttributeError, which made this a large share of a switch.
    return callable(getattr(type(module), "set_context_parallel_group", None)) and hasattr(module, "cp_comm_type")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unsupported_reason(module: torch.nn.Module) -> Optional[str]:
    for cls in type(module).__mro__:
        reason = UNSUPPORTED_MODULES.get(_qualname(cls))
        if reason:
            return reason
    return None


def _rules_for(module: torch.nn.Module) -> list[RebindRule]:
    """The table rows present as instance attributes of `module` (CP attention keeps its
    cp_group for set_context_parallel_group)."""
    attrs = vars(module)
    rules = [r for r in REBIND_TABLE if r.attr in attrs]
    if _is_cp_attention(module):
        rules = [r for r in rules if r.attr != "cp_group"]
    out = []
    for r in rules:
        value = attrs[r.attr]
        if r.kind == "collection" and value is None:
            continue  # a module on MCore's global groups: nothing cached to rebind
        if r.kind == "size" and not (isinstance(value, int) and not isinstance(value, bool)):
            continue
        out.append(r)
    return out


def _cache_clears(modules: list[torch.nn.Module]) -> list[Any]:
    """The lru_cache wrappers (cache_clear) defined on the classes of `modules` (RoPE forward).
    Each class of the modules' MROs is scanned once: scanning per module cost most of a switch."""
    classes = {cls: None for module in modules for cls in type(module).__mro__}
    found: dict[int, Any] = {}
    for cls in classes:
        for value in vars(cls).values():
            if callable(getattr(value, "cache_clear", None)):
                found[id(value)] = value
    return list(found.values())


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class _Entry:
    obj: Any
    attr: str
    old: Any


class Rebinding:
    """The recorder of one group switch: every change goes through it, `restore()` undoes them.

    `set` and `snapshot` record an attribute's old object before it changes, `clear_caches`
    clears lru caches now and again on restore, `side_stream` hands out one CUDA stream per
    switch. `.rebound` lists "(module name).(attr)" of every attribute changed (for logs and
    tests), `.active` is True until restore() has run. While active, the modules it was built
    over are marked busy (install_pg_collection refuses nested use); restore() releases them.
    restore() is idempotent.
    """

    def __init__(self, target: Any, modules: Sequence[torch.nn.Module]):
        self.target = target
        self.rebound: list[str] = []
        self.active = True
        self._entries: list[_Entry] = []
        self._modules = list(modules)
        self._clears: list[Any] = []
        self._stream: Any = None
        for module in self._modules:
            _ACTIVE.add(module)

    def set(self, obj: Any, attr: str, value: Any, label: Optional[str] = None) -> None:
        """Record `obj.attr` and set it to `value`; `label` (if given) is added to `.rebound`."""
        self.snapshot(obj, attr)
        setattr(obj, attr, value)
        if label is not None:
            self.rebound.append(label)

    def snapshot(self, obj: Any, attr: str) -> None:
        """Record `obj.attr` (an instance attribute or buffer, or its absence) before a callee
        such as set_context_parallel_group writes it."""
        self._entries.append(_Entry(obj, attr, _module_get(obj, attr)))

    def clear_caches(self, caches: Sequence[Any]) -> None:
        """Clear each of `caches` (objects with cache_clear(), e.g. lru_cache wrappers) now and
        again on restore: their entries were computed for one set of groups."""
        self._clears.extend(caches)
        for cache in caches:
            cache.cache_clear()

    def side_stream(self) -> Any:
        """One CUDA stream shared by every module of this switch (created on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def restore(self) -> None:
        """Put back every recorded attribute (newest first), clear the caches, release the model."""
        if not self.active:
            return
        try:
            for entry in reversed(self._entries):
                if entry.old is _MISSING:
                    if entry.attr in vars(entry.obj):
                        delattr(entry.obj, entry.attr)
                else:
                    setattr(entry.obj, entry.attr, entry.old)
            for clear in self._clears:
                clear.cache_clear()
        finally:
            self._entries.clear()
            for module in self._modules:
                _ACTIVE.discard(module)
            self.active = False


def _module_get(obj: Any, attr: str) -> Any:
    """The current value of an instance attribute or nn.Module buffer, _MISSING when absent
    (class attributes count as absent: restoring deletes the instance's shadow)."""
    if attr in vars(obj):
        return vars(obj)[attr]
    buffers = vars(obj).get("_buffers")
    if buffers is not None and attr in buffers:
        return buffers[attr]
    return _MISSING


# Modules currently rebound; nested or overlapping use is refused. Holds modules, not groups.
_ACTIVE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _preflight(walked, target, cp_comm_type) -> tuple[list, list]:
    """Every check, before anything changes. Returns (rules per module, CP attention modules)."""
    found: list[Violation] = []
    fix_build = ("build the eval collection from the training layout with "
                 "cpkit.eval_cp.context.build_eval_pg_collection(layout, eval_cp, train_pgs=train_pgs)")
    busy = [name for name, m in walked if m in _ACTIVE]
    if busy:
        raise CPConfigError.single(
            "model", busy[0],
            "eval_cp_context / install_pg_collection is already active on this model (nested or "
            "overlapping use would snapshot the eval groups as the training ones)",
            "exit the outer eval_cp_context (or call Rebinding.restore()) before switching again")
    if cp_comm_type is not None and cp_comm_type not in CP_COMM_TYPES:
        found.append(Violation("cp_comm_type", cp_comm_type, f"must be one of {list(CP_COMM_TYPES)} or None",
                               "pass None to keep each attention module's comm type"))
    cp = get_pg(target, "cp")
    if cp is None:
        raise CPConfigError.single("eval_pgs.cp", None, "the target collection needs a CP group", fix_build)
    cp_size = group_size(cp)

    with_rules = [(name, m, _rules_for(m)) for name, m in walked]
    attention = [(name, m) for name, m in walked if _is_cp_attention(m)]
    # tp / pp membership: eval CP moves cp and dp only.
    collections = {id(vars(m)["pg_collection"]): vars(m)["pg_collection"]
                   for _, m, rules in with_rules for r in rules if r.kind == "collection"}
    for coll in collections.values():
        for field in ("tp", "pp"):
            mine, theirs = members(get_pg(coll, field)), members(get_pg(target, field))
            if mine is not None and mine != theirs:
                found.append(Violation(
                    f"eval_pgs.{field}", theirs,
                    f"must have the members of the model's {field} group {mine} (eval CP changes "
                    "only cp and dp; tp and pp stay as trained)", fix_build))
    reasons: dict[type, Optional[str]] = {}  # _unsupported_reason depends on the class only
    for name, module in walked:
        if _is_cp_attention(module):
            reason = None
        else:
            if type(module) not in reasons:
                reasons[type(module)] = _unsupported_reason(module)
            reason = reasons[type(module)]
        current = _current_cp_size(module) if reason else cp_size
        if current != cp_size:
            found.append(Violation(f"model.{name}", type(module).__name__,
                                   f"cannot change CP size {current} -> {cp_size}: {reason}",
                                   "evaluate at the training CP size, or rebuild the model"))
    if cp_size > 1:
        hierarchical = [name for name, module in attention
                        if (cp_comm_type or module.cp_comm_type or P2P) == A2A_P2P]
        if hierarchical:
            try:
                check_hierarchical_groups(
                    get_pg(target, "hcp"), cp, source="eval_pgs.hcp",
                    fix=f"{hierarchical[0]} uses a2a+p2p: build_eval_pg_collection(layout, eval_cp, "
                        "hierarchical_sizes=[a2a, p2p]), or pass cp_comm_type='p2p'")
            except CPConfigError as exc:
                found += exc.violations
    if found:
        raise CPConfigError(found)
    return with_rules, attention


def _current_cp_size(module: torch.nn.Module) -> int:
    """The CP size a module was built for: its cp_size, its collection's or cp_group's size, or
    its config's context_parallel_size."""
    attrs = vars(module)
    if isinstance(attrs.get("cp_size"), int):
        return attrs["cp_size"]
    coll = attrs.get("pg_collection")
    if get_pg(coll, "cp") is not None:
        return group_size(get_pg(coll, "cp"))
    if attrs.get("cp_group") is not None:
        return group_size(attrs["cp_group"])
    return int(getattr(getattr(module, "config", None), "context_parallel_size", 1) or 1)


def _cp_stream_for(module: torch.nn.Module, cp_size: int, rebinding: "Rebinding") -> Any:
    """The CP stream to pass: MCore's class-level TEDotProductAttention.cp_stream where the class
    has one (created, as MCore does at build with cp > 1, if still None; restored on exit), else
    the module's own; a plain TE attention without one gets a stream shared by this rebinding."""
    if cp_size <= 1:
        return None
    for cls in type(module).__mro__:
        if "cp_stream" in vars(cls):
            if vars(cls)["cp_stream"] is None and torch.cuda.is_available():
                rebinding.set(cls, "cp_stream", torch.cuda.Stream())
            return vars(cls)["cp_stream"]
    stream = getattr(module, "cp_stream", None)
    if stream is None and torch.cuda.is_available() and type(module).__module__.startswith("transformer_engine"):
        stream = rebinding.side_stream()  # TE's p2p overlaps its ring on a side stream
    return stream


def install_pg_collection(model: ModelOrChunks, target: Any, *, cp_comm_type: Optional[str] = None) -> Rebinding:
    """Rebind every CP-bearing reference of `model` (a module or a list of VPP chunks) to `target`.

    `target` is a ProcessGroupCollection over the same ranks whose tp and pp groups have the
    model's membership (build it with build_eval_pg_collection). Rebinds the REBIND_TABLE
    attributes, CP attention through set_context_parallel_group (each keeps its cp_comm_type
    unless `cp_comm_type` is given; a model built at cp=1 has p2p everywhere, so pass
    "a2a+p2p" for a hierarchical eval layout), config.context_parallel_size once per config
    object, and clears the RoPE caches. Returns the Rebinding; call its restore() (or use
    `rebound`, or cpkit.eval_cp.context.eval_cp_context) to put everything back.

    Raises CPConfigError, changing nothing, when the model is already rebound (nested use),
    the target's tp or pp membership differs, the target lacks cp (or hcp for a2a+p2p), or a
    module cannot change its CP size (UNSUPPORTED_MODULES). Warns (EvalCPWarning) when the model
    has no CP-bearing module. If a step fails midway, what was changed is restored first.
    """
    roots = model_roots(model)
    walked = _walk(roots)
    with_rules, attention = _preflight(walked, target, cp_comm_type)
    bearing = [m for _, m, rules in with_rules if rules] + [m for _, m in attention]
    if not bearing:
        warnings.warn(
            f"install_pg_collection: {type(roots[0]).__name__} has no CP-bearing module (no "
            f"{', '.join(r.attr for r in REBIND_TABLE)} attribute and no CP attention); nothing "
            "is rebound and evaluation runs as built", EvalCPWarning, stacklevel=3)
    rebinding = Rebinding(target, [m for _, m in walked])
    try:
        _apply(rebinding, with_rules, attention, target, cp_comm_type, bearing)
    except BaseException:
        rebinding.restore()
        raise
    return rebinding


def _apply(rebinding: Rebinding, with_rules, attention, target, cp_comm_type, bearing) -> None:
    cp = get_pg(target, "cp")
    cp_size = group_size(cp)
    for name, module, rules in with_rules:
        for rule in rules:
            if rule.kind == "collection":
                value = target
            elif rule.kind == "group":
                value = get_pg(target, rule.source)
            else:
                value = group_size(get_pg(target, rule.source))
            rebinding.set(module, rule.attr, value, f"{name}.{rule.attr}")
        if any(rule.attr == "cp_size" for rule in rules) and callable(getattr(module, "_setup_variant_attrs", None)):
            _rederive_variant_attrs(rebinding, module, name)
    ranks = global_ranks(cp) if cp_size > 1 else None
    takes_strategy: dict[type, bool] = {}  # inspect.signature once per class, not per layer
    for name, module in attention:
        comm = cp_comm_type or module.cp_comm_type or P2P
        for attr in CP_ATTENTION_ATTRS:
            rebinding.snapshot(module, attr)
        kwargs = {}
        if type(module) not in takes_strategy:
            takes_strategy[type(module)] = _accepts(module.set_context_parallel_group, "load_balancing_strategy")
        if takes_strategy[type(module)] and \
                getattr(module, "load_balancing_strategy", None) is not None:
            kwargs["load_balancing_strategy"] = module.load_balancing_strategy
        if cp_size <= 1:
            module.set_context_parallel_group(None, None, None, comm, **kwargs)
        else:
            group = list(get_pg(target, "hcp")) if comm == A2A_P2P else cp
            module.set_context_parallel_group(group, ranks, _cp_stream_for(module, cp_size, rebinding),
                                              comm, **kwargs)
        rebinding.rebound.append(f"{name}.set_context_parallel_group")
    hcp = get_pg(target, "hcp")
    configs: dict[int, Any] = {}
    for module in bearing:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "context_parallel_size"):
            configs.setdefault(id(config), config)
    for config in configs.values():
        rebinding.set(config, "context_parallel_size", cp_size, "config.context_parallel_size")
        if hcp is not None and hasattr(config, "hierarchical_context_parallel_sizes"):
            rebinding.set(config, "hierarchical_context_parallel_sizes", [group_size(g) for g in hcp])
        if cp_comm_type is not None and hasattr(config, "cp_comm_type"):
            rebinding.set(config, "cp_comm_type", cp_comm_type)
    for module in bearing:
        if "max_seq_len_cached" in vars(module):
            for attr in _DERIVED_CACHE_ATTRS[1:]:
                rebinding.snapshot(module, attr)
            rebinding.set(module, "max_seq_len_cached", -1)  # the next get_cached_cos_sin rebuilds
    rebinding.clear_caches(_cache_clears(bearing))



def _rederive_variant_attrs(rebinding: Rebinding, module: torch.nn.Module, name: str) -> None:
    """MCore 0.19's GatedDeltaNet derives its per-rank split (feat_dim_split) from cp_size in
    _setup_variant_attrs at build: run it again at the rebound cp_size and record every
    attribute it changed, so that restore() puts back the objects that were there."""
    before = dict(vars(module))
    module._setup_variant_attrs()
    changed = {attr: value for attr, value in vars(module).items()
               if before.get(attr, _MISSING) is not value}
    for attr, value in changed.items():  # undo directly, then redo through the recorder
        if before.get(attr, _MISSING) is _MISSING:
            delattr(module, attr)
        else:
            setattr(module, attr, before[attr])
        rebinding.set(module, attr, value, f"{name}.{attr}")


@contextlib.contextmanager
def rebound(model: ModelOrChunks, target: Any, *, cp_comm_type: Optional[str] = None) -> Iterator[Rebinding]:
    """Inside the block `model` runs on `target` (see install_pg_collection); on exit, also on
    an exception, every rebound attribute is the object it was before and the RoPE caches are
    cleared again. Nested use on the same model raises CPConfigError. Yields the Rebinding."""
    rebinding = install_pg_collection(model, target, cp_comm_type=cp_comm_type)
    try:
        yield rebinding
    finally:
        rebinding.restore()
