"""The head rules a layout without head counts leaves unchecked.

`CPLayout.violations()` skips every rule on num_attention_heads or num_query_groups whose count
is None, so that a layout can describe rank groups alone. A check that skipped a rule must say
so: `unchecked_head_rules(layout)` lists each skipped rule. The all-to-all ones (the heads per TP
rank divide the a2a size) are what refuses real a2a, a2a+p2p and eval-CP layouts, so
`cpkit layout check` exits non-zero on them unless the user accepts them unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpkit.parallel.layout import A2A, CPLayout, _all_positive

__all__ = ["HEAD_FLAGS", "UncheckedRule", "unchecked_head_rules"]

#: The `cpkit layout check` flag of each head-count field.
HEAD_FLAGS = {"num_attention_heads": "--num-heads", "num_query_groups": "--num-kv-heads"}


@dataclass(frozen=True)
class UncheckedRule:
    """One rule `CPLayout.violations()` skipped because a head count was not given."""

    field: str
    """The missing count: num_attention_heads or num_query_groups."""

    rule: str
    """What the count must satisfy, e.g. "num_query_groups/tp must be divisible by the a2a size 4"."""

    all_to_all: bool
    """True for an all-to-all rule (a2a scatters heads); False for the tp rule."""

    @property
    def flag(self) -> str:
        """The `cpkit layout check` flag that gives the missing count."""
        return HEAD_FLAGS[self.field]

    def to_dict(self) -> dict:
        """The rule, JSON-ready (`cpkit layout check --json` lists them under "unchecked")."""
        return {"field": self.field, "rule": self.rule, "all_to_all": self.all_to_all}


def _a2a_level(layout: CPLayout, a2a: int) -> str:
    """How `_check_a2a_heads` in cpkit.parallel.layout names the group (the same words in both places)."""
    return "cp" if A2A in layout.layer_comm_types and a2a == layout.cp else "a2a level"


def unchecked_head_rules(layout: CPLayout) -> list[UncheckedRule]:
    """The head rules of `layout` that `layout.violations()` could not check, because
    num_attention_heads or num_query_groups is None: heads divisible by tp (tp > 1), the heads per
    TP rank divisible by the a2a size (a2a size > 1) and the same at the eval CP size. A missing
    num_query_groups counts even where num_attention_heads is given: the check then takes
    MCore's default (no GQA), and a GQA model's fewer KV heads are what a2a refuses first. Empty
    when both counts are given or no rule applies (p2p and all_gather at tp 1)."""
    if not _all_positive(layout.world_size, layout.tp, layout.pp, layout.cp):
        return []  # the size violations come first; the head rules divide by the sizes
    missing = [f for f in HEAD_FLAGS if getattr(layout, f) is None]
    tp = layout.tp
    out: list[UncheckedRule] = []
    for field in missing:
        if tp > 1:
            out.append(UncheckedRule(field, f"{field} must be divisible by tp = {tp}", False))
        a2a = layout.a2a_size
        if a2a > 1:
            out.append(UncheckedRule(field, f"{field}/tp must be divisible by the a2a size {a2a} "
                                            f"({_a2a_level(layout, a2a)})", True))
        eval_cp = layout.eval_context_parallel_size
        if eval_cp is not None and _all_positive(eval_cp):  # violations() checks the eval layout whenever set
            ev = layout.eval_layout()
            if ev.a2a_size > 1:
                level = _a2a_level(ev, ev.a2a_size)
                out.append(UncheckedRule(field, f"at eval_context_parallel_size={eval_cp}: {field}/tp must be "
                                                f"divisible by the a2a size {ev.a2a_size} ({level})", True))
    return out
