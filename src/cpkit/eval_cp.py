"""Eval-time context parallelism: evaluate at another CP degree by rebinding process groups.

A model built for one layout caches its process groups on many modules (MCore passes
`pg_collection` down at construction, and several modules keep a group or a size of their own).
`install_pg_collection(model, target)` rebinds every cached CP-bearing reference to the groups of
`target`, an eval ProcessGroupCollection over the same ranks with another CP size
(`build_eval_pg_collection`), and returns a `Rebinding` whose `restore()` puts back exactly the
objects that were there before (a snapshot, not a re-install). `eval_cp_context(model, eval_pgs)`
wraps both around an evaluation, restoring also when the evaluation raises.

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

Eval data: `eval_shard` gives each eval dp rank a disjoint block of the validation set, so every
sample is evaluated once; `reduce_eval_loss` sums the loss and token count over the eval dp x cp
group; `evaluate` runs a GPT-style model over a validation set with both (MCore's pipeline
schedule when pp > 1).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.errors import CPConfigError, Violation
from cpkit.eval_plan import plan_eval_cp
from cpkit.layout import CP_COMM_TYPES, CPLayout
from cpkit.process_groups import group_size

__all__ = [
    "RebindRule",
    "REBIND_TABLE",
    "CP_ATTENTION_ATTRS",
    "UNSUPPORTED_MODULES",
    "EvalCPWarning",
    "Rebinding",
    "eval_layout",
    "build_eval_pg_collection",
    "install_pg_collection",
    "eval_cp_context",
    "eval_shard",
    "eval_shard_for",
    "reduce_eval_loss",
    "EvalResult",
    "evaluate",
    "plan_eval_cp",
]

ModelOrChunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]


# ----------------------------------------------------------------------------------------------
# The table


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


# ----------------------------------------------------------------------------------------------
# Eval layout and groups


def eval_layout(
    layout: CPLayout,
    eval_cp: int,
    *,
    hierarchical_sizes: Optional[Sequence[int]] = None,
    cp_comm_type: Optional[str] = None,
) -> CPLayout:
    """The validated eval layout: `layout` with cp = eval_cp (tp, pp, world unchanged; dp follows).

    `hierarchical_sizes` = [a2a, p2p] makes it an a2a+p2p layout (product eval_cp);
    `cp_comm_type` overrides the comm type. Without either, an a2a+p2p layout keeps a2a+p2p with
    a2a level gcd(old a2a, eval_cp) (CPLayout.with_cp). Raises CPConfigError (every violation,
    the eval ones reported under eval_context_parallel_size).
    """
    dataclasses.replace(layout, eval_context_parallel_size=eval_cp).validate()
    ev = layout.with_cp(eval_cp)
    if hierarchical_sizes is not None:
        ev = dataclasses.replace(ev, cp_comm_type=cp_comm_type or "a2a+p2p",
                                 hierarchical_context_parallel_sizes=list(hierarchical_sizes))
    elif cp_comm_type is not None:
        hier = ev.hierarchical_context_parallel_sizes if cp_comm_type == "a2a+p2p" else None
        ev = dataclasses.replace(ev, cp_comm_type=cp_comm_type, hierarchical_context_parallel_sizes=hier)
    return ev.validate()


def _members(group: Any) -> Optional[tuple]:
    """Sorted global ranks of a group (stand-in groups: their `ranks`), None for None."""
    if group is None:
        return None
    if isinstance(group, (list, tuple)):
        return tuple(_members(g) for g in group)
    if isinstance(group, dist.ProcessGroup):
        return tuple(sorted(dist.get_process_group_ranks(group)))
    ranks = getattr(group, "ranks", None)
    return tuple(sorted(ranks)) if ranks is not None else ("object", id(group))


def _global_ranks(group: Any) -> Optional[list[int]]:
    """Global ranks of a group in group-rank order (stand-in groups: their `ranks`)."""
    if group is None:
        return None
    if isinstance(group, dist.ProcessGroup):
        return list(dist.get_process_group_ranks(group))
    ranks = getattr(group, "ranks", None)
    return list(ranks) if ranks is not None else None


def _collection_fields() -> list[str]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    return [f.name for f in dataclasses.fields(ProcessGroupCollection)]


def build_eval_pg_collection(
    layout: CPLayout,
    eval_cp: int,
    *,
    hierarchical_sizes: Optional[Sequence[int]] = None,
    cp_comm_type: Optional[str] = None,
    train_pgs: Any = None,
    backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
):
    """The eval ProcessGroupCollection: the ranks of `layout` with cp = eval_cp.

    tp and pp groups have the training membership, dp shrinks or grows (dp x cp is unchanged);
    `hierarchical_sizes` = [a2a, p2p] gives it hcp groups (an a2a+p2p eval layout). With
    `train_pgs` (the training collection), every field whose membership is the same in both
    layouts (tp, pp, mp, dp_cp, tp_dp_cp, embd, ...) is the training group object itself, so
    only cp, dp, tp_cp (and hcp) are new and the model's tp/pp groups are kept.

    Collective over the default group (cpkit.groups.build_pg_collection): every rank calls it
    with the same arguments. Raises CPConfigError for an invalid eval layout.
    """
    from cpkit.groups import build_pg_collection

    ev = eval_layout(layout, eval_cp, hierarchical_sizes=hierarchical_sizes, cp_comm_type=cp_comm_type)
    pgs = build_pg_collection(ev, backend=backend, timeout=timeout)
    if train_pgs is not None:
        for name in _collection_fields():
            new, old = get_pg(pgs, name), get_pg(train_pgs, name)
            if new is not None and old is not None and new is not old and _members(new) == _members(old):
                setattr(pgs, name, old)
    return pgs


# ----------------------------------------------------------------------------------------------
# Rebinding


def _roots(model: ModelOrChunks) -> list[torch.nn.Module]:
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
    """What install_pg_collection changed: `restore()` puts back exactly the old objects.

    `.rebound` lists "(module name).(attr)" of every attribute changed (for logs and tests),
    `.active` is True until restore() has run. restore() is idempotent.
    """

    def __init__(self, target: Any, modules: list[torch.nn.Module]):
        self.target = target
        self.rebound: list[str] = []
        self._entries: list[_Entry] = []
        self._modules = modules
        self._clears: list[Any] = []
        self._stream: Any = None
        self.active = True

    def _set(self, obj: Any, attr: str, value: Any, label: Optional[str] = None) -> None:
        self._entries.append(_Entry(obj, attr, _module_get(obj, attr)))
        setattr(obj, attr, value)
        if label is not None:
            self.rebound.append(label)

    def _snapshot(self, obj: Any, attr: str) -> None:
        """Record an attribute a callee (set_context_parallel_group) is about to write."""
        self._entries.append(_Entry(obj, attr, _module_get(obj, attr)))

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
                 "cpkit.eval_cp.build_eval_pg_collection(layout, eval_cp, train_pgs=train_pgs)")
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
            mine, theirs = _members(get_pg(coll, field)), _members(get_pg(target, field))
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
        hcp = get_pg(target, "hcp")
        for name, module in attention:
            comm = cp_comm_type or module.cp_comm_type or "p2p"
            if comm != "a2a+p2p":
                continue
            if not (isinstance(hcp, (list, tuple)) and len(hcp) == 2 and None not in hcp
                    and group_size(hcp) == cp_size):
                found.append(Violation(
                    "eval_pgs.hcp", None if hcp is None else [group_size(g) for g in hcp],
                    f"{name} uses a2a+p2p, which needs [a2a, p2p] groups whose sizes multiply "
                    f"to the eval CP size {cp_size}",
                    "build_eval_pg_collection(layout, eval_cp, hierarchical_sizes=[a2a, p2p]), "
                    "or pass cp_comm_type='p2p'"))
                break
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
                rebinding._set(cls, "cp_stream", torch.cuda.Stream())
            return vars(cls)["cp_stream"]
    stream = getattr(module, "cp_stream", None)
    if stream is None and torch.cuda.is_available() and type(module).__module__.startswith("transformer_engine"):
        if rebinding._stream is None:
            rebinding._stream = torch.cuda.Stream()  # TE's p2p overlaps its ring on a side stream
        stream = rebinding._stream
    return stream


def install_pg_collection(model: ModelOrChunks, target: Any, *, cp_comm_type: Optional[str] = None) -> Rebinding:
    """Rebind every CP-bearing reference of `model` (a module or a list of VPP chunks) to `target`.

    `target` is a ProcessGroupCollection over the same ranks whose tp and pp groups have the
    model's membership (build it with build_eval_pg_collection). Rebinds the REBIND_TABLE
    attributes, CP attention through set_context_parallel_group (each keeps its cp_comm_type
    unless `cp_comm_type` is given; a model built at cp=1 has p2p everywhere, so pass
    "a2a+p2p" for a hierarchical eval layout), config.context_parallel_size once per config
    object, and clears the RoPE caches. Returns the Rebinding; call its restore() (or use
    eval_cp_context) to put everything back.

    Raises CPConfigError, changing nothing, when the model is already rebound (nested use),
    the target's tp or pp membership differs, the target lacks cp (or hcp for a2a+p2p), or a
    module cannot change its CP size (UNSUPPORTED_MODULES). Warns (EvalCPWarning) when the model
    has no CP-bearing module. If a step fails midway, what was changed is restored first.
    """
    roots = _roots(model)
    walked = _walk(roots)
    with_rules, attention = _preflight(walked, target, cp_comm_type)
    modules = [m for _, m in walked]
    rebinding = Rebinding(target, modules)
    bearing = [m for _, m, rules in with_rules if rules] + [m for _, m in attention]
    if not bearing:
        warnings.warn(
            f"install_pg_collection: {type(roots[0]).__name__} has no CP-bearing module (no "
            f"{', '.join(r.attr for r in REBIND_TABLE)} attribute and no CP attention); nothing "
            "is rebound and evaluation runs as built", EvalCPWarning, stacklevel=3)
    for module in modules:
        _ACTIVE.add(module)
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
            rebinding._set(module, rule.attr, value, f"{name}.{rule.attr}")
    ranks = _global_ranks(cp) if cp_size > 1 else None
    takes_strategy: dict[type, bool] = {}  # inspect.signature once per class, not per layer
    for name, module in attention:
        comm = cp_comm_type or module.cp_comm_type or "p2p"
        for attr in CP_ATTENTION_ATTRS:
            rebinding._snapshot(module, attr)
        kwargs = {}
        if type(module) not in takes_strategy:
            takes_strategy[type(module)] = _accepts(module.set_context_parallel_group, "load_balancing_strategy")
        if takes_strategy[type(module)] and \
                getattr(module, "load_balancing_strategy", None) is not None:
            kwargs["load_balancing_strategy"] = module.load_balancing_strategy
        if cp_size <= 1:
            module.set_context_parallel_group(None, None, None, comm, **kwargs)
        else:
            group = list(get_pg(target, "hcp")) if comm == "a2a+p2p" else cp
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
        rebinding._set(config, "context_parallel_size", cp_size, "config.context_parallel_size")
        if hcp is not None and hasattr(config, "hierarchical_context_parallel_sizes"):
            rebinding._set(config, "hierarchical_context_parallel_sizes", [group_size(g) for g in hcp])
        if cp_comm_type is not None and hasattr(config, "cp_comm_type"):
            rebinding._set(config, "cp_comm_type", cp_comm_type)
    for module in bearing:
        if "max_seq_len_cached" in vars(module):
            for attr in _DERIVED_CACHE_ATTRS[1:]:
                rebinding._snapshot(module, attr)
            rebinding._set(module, "max_seq_len_cached", -1)  # the next get_cached_cos_sin rebuilds
    rebinding._clears = _cache_clears(bearing)
    for clear in rebinding._clears:
        clear.cache_clear()


@contextlib.contextmanager
def eval_cp_context(model: ModelOrChunks, eval_pgs: Any, *, cp_comm_type: Optional[str] = None) -> Iterator[Rebinding]:
    """Inside the block `model` runs on `eval_pgs` (see install_pg_collection); on exit, also on
    an exception, every rebound attribute is the object it was before and the RoPE caches are
    cleared again. Nested use on the same model raises CPConfigError. Yields the Rebinding."""
    rebinding = install_pg_collection(model, eval_pgs, cp_comm_type=cp_comm_type)
    try:
        yield rebinding
    finally:
        rebinding.restore()


# ----------------------------------------------------------------------------------------------
# Eval data ownership and the loss


def eval_shard(num_samples: int, dp_rank: int, dp_size: int) -> range:
    """The sample indices eval dp rank `dp_rank` of `dp_size` evaluates: a contiguous block.

    Blocks are disjoint, cover range(num_samples) and differ in length by at most one (ranks
    past num_samples get an empty range). Raises CPConfigError for negative counts or a
    dp_rank outside [0, dp_size).
    """
    if not (isinstance(num_samples, int) and num_samples >= 0):
        raise CPConfigError.single("num_samples", num_samples, "must be an integer >= 0", "pass the validation set size")
    if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
        raise CPConfigError.single("dp_rank", dp_rank, f"must be in [0, dp_size={dp_size}) with dp_size >= 1",
                                   "pass the rank and size of the eval data-parallel group")
    base, extra = divmod(num_samples, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (1 if dp_rank < extra else 0))


def eval_shard_for(num_samples: int, pg_collection: Any) -> range:
    """eval_shard for this rank's eval dp group (`pg_collection.dp`; the whole set without one)."""
    dp = get_pg(pg_collection, "dp")
    if dp is None:
        return range(num_samples)
    return eval_shard(num_samples, dp.rank(), dp.size())


def _reduce_group(pg_collection: Any):
    group = get_pg(pg_collection, "dp_cp")
    if group is None:
        group = get_pg(pg_collection, "cp")
    return group


def reduce_eval_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor, pg_collection: Any) -> tuple[float, float]:
    """(global mean loss, global token count): sums over the eval dp x cp group (`dp_cp`).

    Each rank passes the sum of its per-token losses and its token count (its dp shard, its
    CP slice); every rank of the group gets the same result. A collective over `dp_cp`.
    """
    device = loss_sum.device
    buf = torch.stack([loss_sum.detach().double().reshape(()), num_tokens.detach().double().reshape(()).to(device)])
    group = _reduce_group(pg_collection)
    if group_size(group) > 1:
        dist.all_reduce(buf, group=group)
    total, count = buf.tolist()
    return (total / count if count > 0 else float("nan")), count


@dataclass
class EvalResult:
    """The outcome of evaluate() on this rank."""

    loss: float
    """Mean per-token loss over every sample of the validation set (same on every rank)."""
    num_tokens: float
    """Tokens counted over the whole eval layout (each sample once)."""
    samples: range
    """The sample indices this rank's eval dp replica evaluated."""
    micro_batches: int
    """Micro-batches this rank ran."""


def _micro_batches(dataset: Mapping[str, torch.Tensor], indices: range, mbs: int, *, pad: bool,
                   at_least: int = 0) -> list[dict]:
    """Full-sequence micro-batches of `indices`. With `pad`, the last one is filled up to `mbs`
    with loss-masked copies (fixed shapes for the pipeline schedule); loss-masked filler
    micro-batches are added up to `at_least` (a full pipeline, as the planner counts it).
    `indices` is a contiguous range (evaluate passes the rows of its replica's copied and
    sharded shard), so every micro-batch is a view: no gather or copy per micro-batch."""
    spare = indices.start if len(indices) else 0

    def masked(rows: int) -> dict:
        filler = {k: v[spare:spare + 1].expand(rows, *v.shape[1:]) for k, v in dataset.items()}
        filler["loss_mask"] = torch.zeros_like(filler["loss_mask"])
        return filler

    out = []
    for start in range(0, len(indices), mbs):
        chunk = indices[start:start + mbs]
        mb = {k: v[chunk.start:chunk.stop] for k, v in dataset.items()}
        if pad and len(chunk) < mbs:
            filler = masked(mbs - len(chunk))
            mb = {k: torch.cat([mb[k], filler[k]]) for k in mb}
        out.append(mb)
    while len(out) < at_least:
        out.append(masked(mbs))
    return out


def _loss_sum(logits: torch.Tensor, mb: Mapping[str, torch.Tensor], tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of masked per-token losses, token count) of a [b, s, vocab/tp] logits shard."""
    if group_size(tp_group) > 1:
        from torch.distributed.nn.functional import all_gather

        logits = torch.cat(all_gather(logits.contiguous(), group=tp_group), dim=-1)
    losses = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1), reduction="none")
    mask = mb["loss_mask"].reshape(-1).float()
    return (losses * mask).sum(), mask.sum()


@torch.no_grad()
def evaluate(model: ModelOrChunks, dataset: Mapping[str, torch.Tensor], pg_collection: Any, *,
             micro_batch_size: int = 1, min_micro_batches: int = 0) -> EvalResult:
    """Evaluate a GPT-style model over a validation set, each sample once, under `pg_collection`.

    `dataset` holds full-sequence tensors [S, L]: tokens, labels, position_ids, loss_mask (the
    form of cpkit.models.make_batch). This rank's eval dp replica takes eval_shard_for(S) in
    micro-batches of `micro_batch_size`, each CP-sharded for `pg_collection.cp`
    (cpkit.sharding's 2*cp chunk layout); logits are gathered over tp for the loss. With pp > 1
    the forward runs through MCore's forward-only pipeline schedule (get_forward_backward_func
    with an explicit P2PCommunicator and pg_collection, without MCore's device sync after each
    transfer: _no_p2p_sync; GPU only, as MCore's p2p buffers are CUDA tensors) and the last
    stage's sums are shared over pp. The loss is reduced over
    dp x cp (reduce_eval_loss). `min_micro_batches` adds loss-masked filler micro-batches up to
    that count (pass pp to run a full pipeline, as Megatron's eval and cpkit.eval_plan count
    it); they change the time, not the loss. Call it inside eval_cp_context with the eval
    collection, or outside with the training one. Virtual pipeline chunks are not supported.
    """
    from cpkit.models import shard_batch

    chunks = _roots(model)
    if len(chunks) > 1:
        raise CPConfigError.single("model", f"{len(chunks)} chunks",
                                   "evaluate() runs the non-interleaved schedule",
                                   "call MCore's interleaved schedule yourself inside eval_cp_context")
    module = chunks[0]
    num = int(next(iter(dataset.values())).shape[0])
    shard = eval_shard_for(num, pg_collection)
    pp_group = get_pg(pg_collection, "pp")
    pp = group_size(pp_group)
    cp_group, tp_group = get_pg(pg_collection, "cp"), get_pg(pg_collection, "tp")
    device = next(module.parameters()).device
    # This replica's rows copied and CP-sharded once per key, then cut into micro-batches (views):
    # no per-micro-batch copies before the first kernel. With no rows of its own a replica
    # still takes one, the source of its loss-masked filler.
    rows = shard if len(shard) else range(0, min(1, num))
    mine = shard_batch({k: v[rows.start:rows.stop].to(device) for k, v in dataset.items()}, cp_group)
    local = _micro_batches(mine, range(len(shard)), micro_batch_size, pad=pp > 1, at_least=min_micro_batches)
    was_training = module.training
    module.eval()
    try:
        if pp == 1:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            count = torch.zeros((), dtype=torch.float64, device=device)
            for mb in local:
                logits = module(mb["tokens"], mb["position_ids"], None)
                s, n = _loss_sum(logits, mb, tp_group)
                loss_sum += s.double()
                count += n.double()
        else:
            loss_sum, count = _pipeline_sums(module, local, pg_collection, micro_batch_size, device)
    finally:
        module.train(was_training)
    loss, tokens = reduce_eval_loss(loss_sum, count, pg_collection)
    return EvalResult(loss=loss, num_tokens=tokens, samples=shard, micro_batches=len(local))


def _no_p2p_sync(config: Any) -> Any:
    """A shallow copy of the model config with batch_p2p_sync off, for evaluate()'s own
    P2PCommunicator. MCore synchronizes the whole device after every batched pipeline transfer
    "to protect against race condition when using batch_isend_irecv()", adding "User should
    assert that we have a modern enough PyTorch to not need this"; cpkit needs torch >= 2.6.
    The sync drained the GPU at every micro-batch, and the eval layout, with half the work per
    micro-batch, waited for the host after each. The model's config is left as it is."""
    if not getattr(config, "batch_p2p_sync", False):
        return config
    quiet = copy.copy(config)
    quiet.batch_p2p_sync = False
    return quiet


def _pipeline_sums(module, local: list[dict], pg_collection, mbs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum and token count of `local` through MCore's forward-only pipeline schedule,
    summed over pp (only the last stage has them) so every stage returns the same."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.utils import get_model_config

    pp_group, tp_group, cp_group = (get_pg(pg_collection, k) for k in ("pp", "tp", "cp"))
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    if local:
        config = get_model_config(module)
        seq_length = int(local[0]["tokens"].shape[1]) * group_size(cp_group)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb["tokens"], mb["position_ids"], None)

            def loss_func(logits):
                s, n = _loss_sum(logits, mb, tp_group)
                return s.clone(), n.to(torch.int), {"loss_sum": s.detach(), "num_tokens": n.detach()}

            return output, loss_func

        schedule = get_forward_backward_func(pp_size=group_size(pp_group), vp_size=None)
        stored = schedule(
            forward_step_func=forward_step, data_iterator=iter(local), model=[module],
            num_microbatches=len(local), seq_length=seq_length, micro_batch_size=mbs,
            forward_only=True, p2p_communicator=P2PCommunicator(pp_group=pp_group, config=_no_p2p_sync(config)),
            pg_collection=pg_collection)
        for entry in stored or []:
            sums[0] += entry["loss_sum"].double()
            sums[1] += entry["num_tokens"].double()
    dist.all_reduce(sums, group=pp_group)
    return sums[0], sums[1]
