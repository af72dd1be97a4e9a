"""CPLayout: the sizes and CP comm type of one parallel layout, validated before anything is built.

`CPLayout.validate()` raises `CPConfigError` listing every violated constraint at once, each
naming the layout field, its value, the rule and the fix. Nothing here touches processes;
`cpkit.parallel.rank_grid.rank_groups(layout)` gives the rank groups a layout implies, as pure
arithmetic, and `cpkit.parallel.groups.build_pg_collection(layout)` builds the process groups from them
(both import this module, never the other way round).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Final, Literal, Optional, Union

from cpkit.errors import CPConfigError, Violation

__all__ = [
    "A2A",
    "A2A_P2P",
    "ALL_GATHER",
    "COMM_TYPE_SPELLING_HINTS",
    "CP_COMM_TYPES",
    "CPCommType",
    "CPLayout",
    "P2P",
    "validate_layout",
]

CPCommType = Literal["p2p", "all_gather", "a2a", "a2a+p2p"]
"""A CP communication type, spelled as MCore's TransformerConfig.cp_comm_type and TE spell it."""

P2P: Final = "p2p"
"""Ring attention: KV chunks passed around the CP group."""
ALL_GATHER: Final = "all_gather"
"""KV all-gathered over the CP group before attention."""
A2A: Final = "a2a"
"""Ulysses: all-to-all from sequence shards to head shards and back."""
A2A_P2P: Final = "a2a+p2p"
"""Hierarchical CP: a2a inside pg_collection.hcp[0], ring across hcp[1]."""

CP_COMM_TYPES: tuple[str, ...] = (P2P, ALL_GATHER, A2A, A2A_P2P)
"""Every CPCommType, in the order messages list them."""

# Misspellings common enough to deserve their own "did you mean" in every error that names them.
COMM_TYPE_SPELLING_HINTS = {
    "allgather": "all_gather",
    "all-gather": "all_gather",
    "ring": "p2p",
    "ulysses": "a2a",
    "a2a_p2p": "a2a+p2p",
    "a2a-p2p": "a2a+p2p",
    "hierarchical": "a2a+p2p",
}


@dataclass
class CPLayout:
    """One parallel layout as MCore sees it: rank order tp-cp-dp-pp, dp derived from the rest."""

    world_size: int = 1
    """Number of ranks in the job (torch.distributed world size)."""

    tp: int = 1
    """Tensor-parallel size (MCore `tensor_model_parallel_size`)."""

    pp: int = 1
    """Pipeline-parallel size (MCore `pipeline_model_parallel_size`)."""

    cp: int = 1
    """Context-parallel size (MCore `context_parallel_size`): the sequence is split over cp ranks."""

    cp_comm_type: Union[str, list[str]] = P2P
    """CP communication: one of CP_COMM_TYPES for every layer, or a list with one entry per layer."""

    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    """For a2a+p2p only: [a2a size, p2p size], product == cp. a2a runs inside contiguous CP ranks
    (level 0, meant for the NVLink domain), p2p across them (level 1)."""

    seq_length: Optional[int] = None
    """Full sequence length (before CP sharding); None skips the sequence rules."""

    num_layers: Optional[int] = None
    """Number of transformer layers; needed when cp_comm_type is a per-layer list."""

    num_attention_heads: Optional[int] = None
    """Number of query heads; None skips the head rules."""

    num_query_groups: Optional[int] = None
    """Number of KV heads (GQA); None means num_attention_heads, as in MCore."""

    sequence_parallel: bool = False
    """MCore sequence parallelism (takes effect with tp > 1): activations split over tp*cp ranks."""

    eval_context_parallel_size: Optional[int] = None
    """CP size used for evaluation (eval-time CP); None evaluates at `cp`."""

    # ------------------------------------------------------------------------------------------
    # Derived sizes

    @property
    def model_parallel_size(self) -> int:
        """tp * pp * cp: the ranks one model replica spans."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size, world_size // (tp*pp*cp); meaningful once validate() passes (0 when
        the sizes are not positive)."""
        mp = self.model_parallel_size if _all_positive(self.tp, self.pp, self.cp) else 0
        return self.world_size // mp if mp > 0 and _is_int(self.world_size) else 0

    @property
    def layer_comm_types(self) -> list[str]:
        """The comm type of each layer (one entry when cp_comm_type is a single string)."""
        if isinstance(self.cp_comm_type, str):
            return [self.cp_comm_type]
        if isinstance(self.cp_comm_type, (list, tuple)):
            return list(self.cp_comm_type)
        return []  # not a comm type at all; validate() reports it

    @property
    def uses_hierarchical(self) -> bool:
        """True when some layer uses a2a+p2p."""
        return A2A_P2P in self.layer_comm_types

    @property
    def a2a_size(self) -> int:
        """Size of the all-to-all (head-scattering) group: cp for a2a, the level-0 size for
        a2a+p2p, 1 when no layer uses all-to-all."""
        sizes = {1}
        types = self.layer_comm_types
        if A2A in types:
            sizes.add(self.cp)
        if A2A_P2P in types and _valid_hier(self.hierarchical_context_parallel_sizes):
            sizes.add(self.hierarchical_context_parallel_sizes[0])
        return max(sizes)

    # ------------------------------------------------------------------------------------------
    # Validation

    def violations(self) -> list[Violation]:
        """Every violated constraint (empty when the layout is valid)."""
        out: list[Violation] = []
        sizes_ok = _check_sizes(self, out)
        _check_comm_type(self, out)
        _check_hierarchical(self, out, sizes_ok)
        if sizes_ok:  # the rules below divide by the sizes
            _check_world(self, out)
            _check_sequence(self, out, cp=self.cp, field="seq_length", value=self.seq_length)
            _check_heads(self, out)
            _check_eval(self, out)
        return out

    def validate(self) -> "CPLayout":
        """Raise CPConfigError listing every violation; return self when the layout is valid."""
        found = self.violations()
        if found:
            raise CPConfigError(found)
        return self

    def is_valid(self) -> bool:
        """True when validate() would pass."""
        return not self.violations()

    # ------------------------------------------------------------------------------------------
    # Other layouts

    def with_cp(self, cp: int) -> "CPLayout":
        """The same job at another CP size (e.g. the eval layout): dp absorbs the change.

        For a2a+p2p the a2a level becomes gcd(old a2a size, cp), so heads that divided the old
        a2a group still divide the new one; the p2p level takes the rest. The returned layout has
        no eval_context_parallel_size of its own.
        """
        hier = self.hierarchical_context_parallel_sizes
        if self.uses_hierarchical and _valid_hier(hier) and _all_positive(cp):
            a2a = math.gcd(hier[0], cp)
            hier = [a2a, cp // a2a]
        return dataclasses.replace(
            self,
            cp=cp,
            hierarchical_context_parallel_sizes=list(hier) if hier is not None else None,
            eval_context_parallel_size=None,
        )

    def eval_layout(self) -> "CPLayout":
        """The layout used for evaluation: with_cp(eval_context_parallel_size), or self."""
        if self.eval_context_parallel_size is None:
            return self
        return self.with_cp(self.eval_context_parallel_size)

    @classmethod
    def from_transformer_config(
        cls,
        config: Any,
        world_size: int,
        *,
        seq_length: Optional[int] = None,
        eval_context_parallel_size: Optional[int] = None,
    ) -> "CPLayout":
        """A layout from an MCore TransformerConfig (or ModelParallelConfig) and the world size.

        TransformerConfig has no sequence length (it lives in the training args), so pass
        `seq_length` to get the sequence rules. cp_comm_type None (MCore's default) is "p2p".
        """
        comm = getattr(config, "cp_comm_type", None)
        hier = getattr(config, "hierarchical_context_parallel_sizes", None)
        return cls(
            world_size=world_size,
            tp=config.tensor_model_parallel_size,
            pp=config.pipeline_model_parallel_size,
            cp=config.context_parallel_size,
            cp_comm_type=list(comm) if isinstance(comm, (list, tuple)) else (comm or P2P),
            hierarchical_context_parallel_sizes=list(hier) if hier is not None else None,
            seq_length=seq_length,
            num_layers=getattr(config, "num_layers", None),
            num_attention_heads=getattr(config, "num_attention_heads", None),
            num_query_groups=getattr(config, "num_query_groups", None),
            sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
            eval_context_parallel_size=eval_context_parallel_size,
        )

    def to_dict(self) -> dict:
        """Fields plus the derived dp, JSON-ready."""
        out = dataclasses.asdict(self)
        out["dp"] = self.dp
        return out


def validate_layout(**fields: Any) -> CPLayout:
    """Build a CPLayout from keyword fields and validate it; raises CPConfigError."""
    return CPLayout(**fields).validate()


# ----------------------------------------------------------------------------------------------
# The rules, one concern each. Each appends Violations; none raises.


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_positive(*values: Any) -> bool:
    return all(_is_int(v) and v >= 1 for v in values)


def _valid_hier(hier: Any) -> bool:
    return isinstance(hier, (list, tuple)) and len(hier) == 2 and _all_positive(*hier)


def _next_multiple(value: int, step: int) -> int:
    return -(-value // step) * step


def _check_sizes(layout: CPLayout, out: list[Violation]) -> bool:
    """Sizes are integers >= 1; returns whether world_size, tp, pp and cp are usable."""
    core_ok = True
    for name in ("world_size", "tp", "pp", "cp"):
        value = getattr(layout, name)
        if not _all_positive(value):
            core_ok = False
            out.append(Violation(name, value, "must be an integer >= 1", f"set {name} to 1 or more"))
    for name in ("seq_length", "num_layers", "num_attention_heads", "num_query_groups",
                 "eval_context_parallel_size"):
        value = getattr(layout, name)
        if value is not None and not _all_positive(value):
            out.append(Violation(name, value, "must be an integer >= 1 (or None)",
                                 f"set {name} to 1 or more, or leave it unset"))
    return core_ok


def _check_world(layout: CPLayout, out: list[Violation]) -> None:
    mp = layout.model_parallel_size
    if layout.world_size % mp:
        out.append(Violation(
            "world_size", layout.world_size,
            f"must be divisible by tp*pp*cp = {layout.tp}*{layout.pp}*{layout.cp} = {mp}",
            f"use a world_size that is a multiple of {mp} (e.g. {_next_multiple(layout.world_size, mp)}), "
            "or change tp, pp or cp",
        ))


def _check_comm_type(layout: CPLayout, out: list[Violation]) -> None:
    """cp_comm_type spelling and, for a per-layer list, its length."""
    value = layout.cp_comm_type
    if isinstance(value, str):
        entries = [value]
    elif isinstance(value, (list, tuple)) and value:
        entries = list(value)
        if layout.num_layers is None:
            out.append(Violation("num_layers", None,
                                 "a per-layer cp_comm_type list needs num_layers",
                                 f"set num_layers (the list has {len(entries)} entries)"))
        elif len(entries) != layout.num_layers:
            out.append(Violation(
                "cp_comm_type", value,
                f"a per-layer list needs num_layers = {layout.num_layers} entries, got {len(entries)}",
                f"give exactly {layout.num_layers} entries, or one string for all layers"))
    else:
        out.append(Violation("cp_comm_type", value,
                             f"must be one of {list(CP_COMM_TYPES)} or a non-empty per-layer list",
                             'e.g. cp_comm_type="p2p"'))
        return
    for i, entry in enumerate(entries):
        if entry in CP_COMM_TYPES:
            continue
        where = "" if isinstance(value, str) else f" (layer {i})"
        hint = COMM_TYPE_SPELLING_HINTS.get(str(entry).lower()) if isinstance(entry, str) else None
        fix = f'use "{hint}" (MCore and TE spell it so)' if hint else f"use one of {list(CP_COMM_TYPES)}"
        out.append(Violation("cp_comm_type", value,
                             f"{entry!r}{where} is not a CP comm type {list(CP_COMM_TYPES)}", fix))


def _factor_pairs(cp: int) -> list[list[int]]:
    return [[a, cp // a] for a in range(1, cp + 1) if cp % a == 0]


def _check_hierarchical(layout: CPLayout, out: list[Violation], sizes_ok: bool) -> None:
    hier = layout.hierarchical_context_parallel_sizes
    field = "hierarchical_context_parallel_sizes"
    if not layout.uses_hierarchical:
        if hier is not None:
            out.append(Violation(field, hier, 'is only used by cp_comm_type "a2a+p2p"',
                                 'remove it, or set cp_comm_type="a2a+p2p"'))
        return
    pairs = _factor_pairs(layout.cp) if sizes_ok else []
    example = f" with product cp={layout.cp}, e.g. one of {pairs}" if pairs else " with product cp"
    if hier is None:
        out.append(Violation(
            field, None,
            'cp_comm_type "a2a+p2p" needs [a2a size, p2p size]; without it CP communication is '
            "not hierarchical (older stacks silently skipped it, giving wrong gradients)",
            f"set {field}=[a2a, p2p]{example}"))
        return
    if not isinstance(hier, (list, tuple)) or len(hier) != 2:
        out.append(Violation(field, hier, 'a2a+p2p needs exactly 2 levels: [a2a size, p2p size]',
                             f"give two sizes{example}"))
        return
    if not _all_positive(*hier):
        out.append(Violation(field, hier, "every level size must be an integer >= 1",
                             f"give two positive sizes{example}"))
        return
    if sizes_ok and hier[0] * hier[1] != layout.cp:
        out.append(Violation(field, hier,
                             f"the product {hier[0]}*{hier[1]} = {hier[0] * hier[1]} must equal cp = {layout.cp}",
                             f"use sizes{example}, or change cp"))


def _check_sequence(layout: CPLayout, out: list[Violation], *, cp: int, field: str, value: Any) -> None:
    """Sequence rules at CP size `cp`; violations are reported under `field` with `value`."""
    seq = layout.seq_length
    if seq is None:
        return
    # Under seq_length the value is already in the message; under the eval field, say which.
    at = "" if field == "seq_length" else f"at {field}={cp}: seq_length={seq} "
    if cp > 1 and seq % (2 * cp):
        step = 2 * cp
        out.append(Violation(
            field, value,
            f"{at}must be divisible by 2*cp = {step} (each CP rank holds two "
            "chunks, for load balance under the causal mask)",
            f"pad seq_length to a multiple of {step} (e.g. {_next_multiple(seq, step)})"))
    if layout.sequence_parallel and layout.tp > 1 and seq % (layout.tp * cp):
        step = layout.tp * cp
        out.append(Violation(
            field, value,
            f"{at}must be divisible by tp*cp = {step} with sequence_parallel",
            f"pad seq_length to a multiple of {step} (e.g. {_next_multiple(seq, step)}), "
            "or turn sequence_parallel off"))


def _check_heads(layout: CPLayout, out: list[Violation]) -> None:
    """Heads divide over tp, and the per-TP-rank heads over the a2a group."""
    tp = layout.tp
    for name, count in _head_counts(layout):
        if count % tp:
            out.append(Violation(name, count, f"must be divisible by tp = {tp}",
                                 f"use a multiple of {tp}, or change tp"))
    _check_a2a_heads(layout, out, a2a=layout.a2a_size)


def _head_counts(layout: CPLayout) -> list[tuple[str, int]]:
    heads = layout.num_attention_heads
    if heads is None:
        return []
    groups = layout.num_query_groups if layout.num_query_groups is not None else heads
    counts = [("num_attention_heads", heads)]
    if layout.num_query_groups is not None:
        counts.append(("num_query_groups", groups))
    return counts


def _check_a2a_heads(layout: CPLayout, out: list[Violation], *, a2a: int,
                     eval_cp: Optional[int] = None) -> None:
    """All-to-all scatters each TP rank's heads over the a2a group: heads/tp % a2a == 0.

    With `eval_cp`, the violation is reported under eval_context_parallel_size."""
    if a2a <= 1:
        return
    tp = layout.tp
    level = "cp" if A2A in layout.layer_comm_types and a2a == layout.cp else "a2a level"
    for name, count in _head_counts(layout):
        if count % tp:
            continue  # reported by the tp rule
        per_rank = count // tp
        if per_rank % a2a:
            field, value = (name, count) if eval_cp is None else ("eval_context_parallel_size", eval_cp)
            at = "" if eval_cp is None else f"at eval_context_parallel_size={eval_cp}: "
            out.append(Violation(
                field, value,
                f"{at}all-to-all scatters heads over the a2a group: {name}/tp = {per_rank} must be "
                f"divisible by the a2a size {a2a} ({level})",
                "use p2p (ring) or a2a+p2p with a smaller a2a level, or change the head count or tp"))


def _check_eval(layout: CPLayout, out: list[Violation]) -> None:
    eval_cp = layout.eval_context_parallel_size
    if eval_cp is None or not _all_positive(eval_cp):
        return
    field = "eval_context_parallel_size"
    mp = layout.tp * layout.pp * eval_cp
    if layout.world_size % mp:
        out.append(Violation(
            field, eval_cp,
            f"world_size={layout.world_size} must be divisible by tp*pp*eval_cp = {mp}",
            f"use an eval CP size that divides world_size/(tp*pp) = {layout.world_size / (layout.tp * layout.pp):g}"))
    ev = layout.eval_layout()
    _check_sequence(ev, out, cp=eval_cp, field=field, value=eval_cp)
    _check_a2a_heads(ev, out, a2a=ev.a2a_size, eval_cp=eval_cp)
