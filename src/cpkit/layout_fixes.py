"""Concrete fixes for an invalid CP layout: the nearest layouts that pass the same check.

A violation's text says what rule broke; `nearest_layouts(layout)` says what to run instead:
whole layouts, each of which passes `CPLayout.violations()` (and any extra `check` the caller
adds, such as the node placement of `cpkit layout check --nproc-per-node`). Nearest first: the
fewest fields changed, the comm type kept where possible, then the CP size closest to the one
asked for. The model's head counts are never changed (they are the model, not the layout).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterable, Optional

from cpkit.errors import Violation
from cpkit.layout import A2A_P2P, CP_COMM_TYPES, CPLayout, _all_positive, _is_int

__all__ = ["nearest_layouts", "changed_fields", "layout_flags", "describe_change"]

#: Fields a fix may change, in the order their flags are printed.
FIELDS = ("world_size", "tp", "pp", "cp", "cp_comm_type", "hierarchical_context_parallel_sizes", "seq_length",
          "eval_context_parallel_size")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if _is_int(n) and n >= 1 else []


def _next_multiple(value: int, step: int) -> int:
    return -(-value // step) * step


def _seq_step(layout: CPLayout) -> int:
    """The multiple a sequence length must be of in `layout` (train and eval CP sizes)."""
    step = 1
    for cp in {layout.cp, layout.eval_context_parallel_size or layout.cp}:
        if cp > 1:
            step = math.lcm(step, 2 * cp)
        if layout.sequence_parallel and layout.tp > 1:
            step = math.lcm(step, layout.tp * cp)
    return step


def _comm_choices(layout: CPLayout, cp: int) -> list[tuple[object, Optional[list[int]]]]:
    """(cp_comm_type, hierarchical sizes) pairs for CP size `cp`: the original first."""
    original = (layout.cp_comm_type, layout.hierarchical_context_parallel_sizes)
    out = [original]
    if A2A_P2P in layout.layer_comm_types or isinstance(layout.cp_comm_type, (list, tuple)):
        out += [(layout.cp_comm_type, [a, cp // a]) for a in _divisors(cp)]
    for comm in CP_COMM_TYPES:
        if comm == A2A_P2P:
            out += [(comm, [a, cp // a]) for a in _divisors(cp)]
        else:
            out.append((comm, None))
    seen, unique = set(), []
    for comm, hier in out:
        key = (str(comm), None if hier is None else tuple(hier))
        if key not in seen:
            seen.add(key)
            unique.append((comm, None if hier is None else list(hier)))
    return unique


def _candidates(layout: CPLayout) -> Iterable[CPLayout]:
    world = layout.world_size
    # tp and eval CP sizes near the ones asked for: a fix that multiplies tp by 64 helps nobody.
    near = lambda d, was: not _all_positive(was) or max(d, was) <= 8 * min(d, was)  # noqa: E731
    tps = sorted({d for d in _divisors(world) if near(d, layout.tp)} | {layout.tp}) if _is_int(world) else [layout.tp]
    for tp, pp in itertools.product(tps, {layout.pp, 1}):
        if not _all_positive(tp, pp):
            continue
        worlds = {world}
        cps = set(_divisors(world // (tp * pp))) if world % (tp * pp) == 0 else set()
        if _all_positive(layout.cp):
            cps.add(layout.cp)
            step = tp * pp * layout.cp
            worlds.add(_next_multiple(world, step))
        for cp, world_size in itertools.product(sorted(cps), sorted(worlds)):
            evals = [layout.eval_context_parallel_size]
            if layout.eval_context_parallel_size is not None and world_size % (tp * pp) == 0:
                evals += [d for d in _divisors(world_size // (tp * pp)) if near(d, layout.eval_context_parallel_size)]
            for (comm, hier), eval_cp in itertools.product(_comm_choices(layout, cp), dict.fromkeys(evals)):
                base = dataclasses.replace(layout, world_size=world_size, tp=tp, pp=pp, cp=cp, cp_comm_type=comm,
                                           hierarchical_context_parallel_sizes=hier, eval_context_parallel_size=eval_cp)
                yield base
                seq = layout.seq_length
                if _is_int(seq) and seq >= 1:
                    padded = _next_multiple(seq, _seq_step(base))
                    if padded != seq:
                        yield dataclasses.replace(base, seq_length=padded)


def changed_fields(before: CPLayout, after: CPLayout) -> list[str]:
    """The fields (of FIELDS) whose values differ between two layouts."""
    return [f for f in FIELDS if getattr(before, f) != getattr(after, f)]


def _degenerate(sizes) -> bool:
    """Hierarchical CP sizes with a level of 1 (one of the two levels does nothing)."""
    return isinstance(sizes, (list, tuple)) and 1 in sizes


def _distance(value, wanted) -> float:
    """How far a size is from the one asked for, on a log scale (0 when either is unusable)."""
    return abs(math.log2(value) - math.log2(wanted)) if _all_positive(value, wanted) else 0.0


def nearest_layouts(layout: CPLayout, limit: int = 3,
                    check: Callable[[CPLayout], list[Violation]] | None = None) -> list[CPLayout]:
    """Up to `limit` layouts near `layout` that pass `layout.violations()` (and `check`, when
    given, e.g. a node-placement check), nearest first: fewest fields changed, the comm type kept
    where possible, a CP size kept above 1 where it was, hierarchical sizes without a level of 1
    (which is the plain comm type, never faster), then the CP size and world size closest
    to the ones asked for. Head counts are never changed. Empty when `layout` is already valid
    or no such layout is found."""
    if not layout.violations() and not (check and check(layout)):
        return []
    scored = []
    seen = set()
    for cand in _candidates(layout):
        key = repr(cand)
        if key in seen:
            continue
        seen.add(key)
        changed = changed_fields(layout, cand)
        if not changed or cand.violations() or (check and check(cand)):
            continue
        comm_changed = "cp_comm_type" in changed
        lost_cp = _is_int(layout.cp) and layout.cp > 1 and cand.cp == 1
        # [1, p] or [a, 1] is the plain comm type in a2a+p2p's clothes, never faster: offered last.
        degenerate = _degenerate(cand.hierarchical_context_parallel_sizes) and not _degenerate(
            layout.hierarchical_context_parallel_sizes)
        scored.append(((lost_cp, len(changed), comm_changed, degenerate, "world_size" in changed,
                        _distance(cand.cp, layout.cp), -cand.cp,
                        _distance(cand.eval_context_parallel_size, layout.eval_context_parallel_size),
                        _distance(cand.tp, layout.tp), key), cand))
    scored.sort(key=lambda item: item[0])
    return [cand for _, cand in scored[:limit]]


_FLAGS = {
    "world_size": "--world-size", "tp": "--tp", "pp": "--pp", "cp": "--cp", "cp_comm_type": "--cp-comm-type",
    "hierarchical_context_parallel_sizes": "--hierarchical-cp-sizes", "seq_length": "--seq-length",
    "eval_context_parallel_size": "--eval-cp",
}


def _flag_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def layout_flags(layout: CPLayout) -> str:
    """The `cpkit layout check` flags that describe `layout` in full (unset fields left out)."""
    parts = []
    for field, flag in _FLAGS.items():
        value = getattr(layout, field)
        if value is None or (field in ("tp", "pp", "cp") and value == 1):
            continue
        if field == "cp_comm_type" and isinstance(value, (list, tuple)):
            value = ",".join(value)
        parts.append(f"{flag} {_flag_value(value)}")
    for field, flag in (("num_layers", "--num-layers"), ("num_attention_heads", "--num-heads"),
                        ("num_query_groups", "--num-kv-heads")):
        if getattr(layout, field) is not None:
            parts.append(f"{flag} {getattr(layout, field)}")
    if layout.sequence_parallel:
        parts.append("--sequence-parallel")
    return " ".join(parts)


def describe_change(before: CPLayout, after: CPLayout) -> str:
    """What a fix changes, field by field ("cp 3 -> 2, seq_length 4096 -> 4098")."""
    return ", ".join(f"{f} {_flag_value(getattr(before, f))} -> {_flag_value(getattr(after, f))}"
                     for f in changed_fields(before, after))
