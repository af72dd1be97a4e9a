"""Concrete fixes for an invalid CP layout: the nearest layouts that pass the same check.

A violation's text says what rule broke; `nearest_layouts(layout)` says what to run instead:
whole layouts, each of which passes `CPLayout.violations()` (and any extra `check` the caller
adds, such as the node placement of `cpkit layout check --nproc-per-node`), in the order the
skills recommend: CP kept above 1, the user's comm type before another, a real two-level split
before one with a level of 1 (the plain comm type under a2a+p2p's name), then the fewest fields
changed and the CP size closest to the one asked for. `offer_reason` says in words why each is
offered. The model's head counts are never changed (they are the model, not the layout).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterable, Optional

from cpkit.errors import Violation
from cpkit.hierarchical.head_rules import unchecked_head_rules
from cpkit.parallel.layout import A2A_P2P, COMM_TYPE_SPELLING_HINTS, CP_COMM_TYPES, CPLayout, _all_positive, _is_int

__all__ = ["nearest_layouts", "offer_reason", "changed_fields", "layout_flags", "describe_change"]

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


def _intended_comm(comm):
    """The comm type the user meant: a known misspelling ("allgather") read as MCore spells it."""
    if isinstance(comm, str):
        return COMM_TYPE_SPELLING_HINTS.get(comm.lower(), comm)
    if isinstance(comm, (list, tuple)):
        return [_intended_comm(c) for c in comm]
    return comm


def _offer_kind(before: CPLayout, after: CPLayout) -> int:
    """The skills' preference: 0 for the user's comm type with a real split, 1 for another comm
    type, 2 for a newly degenerate split ([1, p] is p2p, [a, 1] is a2a, through the hierarchical
    path and never faster than the plain type, so the plain type is offered before it)."""
    if _degenerate(after.hierarchical_context_parallel_sizes) and not _degenerate(
            before.hierarchical_context_parallel_sizes):
        return 2
    return 0 if after.cp_comm_type == _intended_comm(before.cp_comm_type) else 1


def _a2a_level(layout: CPLayout) -> int:
    """The a2a level of hierarchical sizes (0 without usable ones)."""
    hier = layout.hierarchical_context_parallel_sizes
    return hier[0] if isinstance(hier, (list, tuple)) and hier and _all_positive(hier[0]) else 0


def _lost_cp(before: CPLayout, after: CPLayout) -> bool:
    return _is_int(before.cp) and before.cp > 1 and after.cp == 1


def _comm_text(comm) -> str:
    return ",".join(map(str, comm)) if isinstance(comm, (list, tuple)) else str(comm)


def _heads_reason(before: CPLayout, after: CPLayout) -> str:
    """Why the heads allow `after`'s all-to-all (or that it has none, or that they were not given)."""
    a2a = after.a2a_size
    if a2a <= 1:
        return "no all-to-all, so no head rule" if before.a2a_size > 1 else ""
    missing = [f for f in ("num_attention_heads", "num_query_groups")
               if any(r.all_to_all and r.field == f for r in unchecked_head_rules(after))]
    per_rank = [f"{field}/tp = {getattr(after, field) // after.tp}"
                for field in ("num_attention_heads", "num_query_groups") if field not in missing
                and getattr(after, field) is not None]
    out = []
    if per_rank:
        out.append(f"heads divide the a2a size {a2a} ({', '.join(per_rank)})")
    if missing:
        out.append(f"{' and '.join(missing)} not given, so not checked against the a2a size {a2a}")
    return "; ".join(out)


def offer_reason(before: CPLayout, after: CPLayout) -> str:
    """Why `after` is offered in place of `before`, in words: the comm type kept or changed, the
    kind of hierarchical split, what the heads allow, and CP dropped where it was."""
    comm = _comm_text(after.cp_comm_type)
    if after.cp_comm_type == before.cp_comm_type:
        parts = [f"same comm type ({comm})"]
    elif after.cp_comm_type == _intended_comm(before.cp_comm_type):
        parts = [f"your comm type, spelled as MCore and TE spell it ({comm})"]
    else:
        parts = [f"another comm type ({comm}, not {_comm_text(before.cp_comm_type)})"]
    hier = after.hierarchical_context_parallel_sizes
    if after.uses_hierarchical and isinstance(hier, (list, tuple)) and len(hier) == 2:
        a, p = hier
        if _degenerate(hier):
            plain = "p2p" if a == 1 else "a2a"
            parts.append(f"a degenerate split [{a}, {p}]: plain {plain} through the hierarchical path, "
                         f"never faster than {plain}")
        else:
            parts.append(f"a real two-level split [{a}, {p}]")
    heads = _heads_reason(before, after)
    if heads:
        parts.append(heads)
    if _lost_cp(before, after):
        parts.append("cp 1: no context parallelism, the last resort")
    return "; ".join(parts)


def nearest_layouts(layout: CPLayout, limit: int = 3,
                    check: Callable[[CPLayout], list[Violation]] | None = None) -> list[CPLayout]:
    """Up to `limit` layouts near `layout` that pass `layout.violations()` (and `check`, when
    given, e.g. a node-placement check), best first as the skills rank them: a CP size kept above
    1 where it was; the user's comm type (a known misspelling read as meant), then another comm
    type, then hierarchical sizes newly given a level of 1 (the plain comm type under another
    name, never faster); then the fewest fields changed, the world size kept, the CP, eval CP and
    tp sizes closest to the ones asked for, and the a2a level closest to the one asked for (the
    larger one on a tie, as the skill picks it). Head counts are never changed. Empty when
    `layout` is already valid or no such layout is found. `offer_reason(layout, fix)` says why
    each one is offered."""
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
        scored.append(((_lost_cp(layout, cand), _offer_kind(layout, cand), len(changed), "world_size" in changed,
                        _distance(cand.cp, layout.cp), -cand.cp,
                        _distance(cand.eval_context_parallel_size, layout.eval_context_parallel_size),
                        _distance(cand.tp, layout.tp),
                        _distance(_a2a_level(cand), _a2a_level(layout)), -_a2a_level(cand), key), cand))
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
