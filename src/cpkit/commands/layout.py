"""`cpkit layout check`: validate a CP layout and print the rank groups it would create.

Exit 0 when the layout is valid, 2 with one line per violation on stderr otherwise (with
`--nproc-per-node`, an a2a group spanning nodes is one), followed by the layouts that pass, best
first, each with why it is offered. Without --num-heads/--num-kv-heads the head rules cannot run:
the check lists them, and an all-to-all one (a2a, a2a+p2p, an a2a eval CP size) is a violation
unless `--no-heads` accepts the layout with them unchecked. `--json` prints {"valid", "errors":
[{"field", "value", "message"}], "unchecked", "dp", "groups", ...} instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from cpkit.errors import CPConfigError, Violation
from cpkit.hierarchical.head_rules import HEAD_FLAGS, UncheckedRule, unchecked_head_rules
from cpkit.parallel.layout import CPLayout, P2P
from cpkit.hierarchical.layout_fixes import describe_change, layout_flags, nearest_layouts, offer_reason
from cpkit.parallel.rank_grid import rank_groups
from cpkit.hierarchical.topology import ALLOW_FLAG, NodeTopology, format_node_report, node_report, topology_violations

__all__ = ["add_parser", "layout_from_args", "check"]

NO_HEADS_FLAG = "--no-heads"

# Kinds printed in text mode (JSON has them all), with a note on what each is.
_SHOWN = (
    ("tp", ""),
    ("cp", ""),
    ("dp", ""),
    ("pp", ""),
    ("hcp_a2a", "level 0: a2a, contiguous inside each CP group"),
    ("hcp_p2p", "level 1: p2p, strided across the a2a groups"),
)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,2, got {text!r}")


def _comm_type(text: str):
    parts = [p.strip() for p in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def add_parser(sub) -> None:
    """Register `cpkit layout` and its `check` subcommand."""
    p = sub.add_parser("layout", allow_abbrev=False, help="check a CP layout and show its rank groups",
                       description=__doc__.splitlines()[0])
    layout_sub = p.add_subparsers(dest="layout_command", required=True)
    c = layout_sub.add_parser(
        "check", allow_abbrev=False, help="validate sizes, comm type, sequence and heads; print the rank groups",
        description="Validate a CP layout (every violation listed) and print the rank groups "
                    "MCore's default order tp-cp-dp-pp gives it.")
    c.add_argument("--world-size", type=int, required=True, help="number of ranks")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    c.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    c.add_argument("--cp", type=int, default=1, help="context-parallel size")
    c.add_argument("--cp-comm-type", type=_comm_type, default=P2P,
                   help="p2p | all_gather | a2a | a2a+p2p, or a comma-separated list per layer")
    c.add_argument("--hierarchical-cp-sizes", type=_int_list, default=None,
                   help="for a2a+p2p: a2a size,p2p size (product = cp), e.g. 2,2")
    c.add_argument("--seq-length", type=int, default=None, help="full sequence length")
    c.add_argument("--num-layers", type=int, default=None, help="transformer layers (for per-layer comm types)")
    c.add_argument("--num-heads", type=int, default=None, help="attention (query) heads")
    c.add_argument("--num-kv-heads", type=int, default=None,
                   help="KV heads / query groups (GQA; the same as --num-heads without GQA)")
    c.add_argument(NO_HEADS_FLAG, action="store_true",
                   help="accept an a2a, a2a+p2p or a2a eval layout without head counts, its head rules "
                        "unchecked (they are listed)")
    c.add_argument("--sequence-parallel", action="store_true", help="MCore sequence parallelism (tp > 1)")
    c.add_argument("--eval-cp", type=int, default=None, help="CP size used for evaluation")
    c.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (torchrun's --nproc-per-node): refuse a2a groups that span nodes, "
                        "list the p2p ring hops that cross nodes and the groups on each node")
    c.add_argument(ALLOW_FLAG, action="store_true",
                   help="with --nproc-per-node: accept a2a groups that span nodes")
    c.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    c.set_defaults(func=check)


def layout_from_args(args: argparse.Namespace) -> CPLayout:
    """The CPLayout the `check` flags describe (not validated)."""
    return CPLayout(
        world_size=args.world_size,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        cp_comm_type=args.cp_comm_type,
        hierarchical_context_parallel_sizes=args.hierarchical_cp_sizes,
        seq_length=args.seq_length,
        num_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        sequence_parallel=args.sequence_parallel,
        eval_context_parallel_size=args.eval_cp,
    )


def _eval_report(layout: CPLayout) -> dict | None:
    if layout.eval_context_parallel_size is None:
        return None
    ev = layout.eval_layout()
    groups = rank_groups(ev)
    return {
        "cp": ev.cp,
        "dp": ev.dp,
        "hierarchical_context_parallel_sizes": ev.hierarchical_context_parallel_sizes,
        "groups": {k: groups[k] for k, _ in _SHOWN if k in groups},
    }


def check(args: argparse.Namespace) -> int:
    """Handler of `cpkit layout check`: 0 when valid, 2 otherwise (every violation listed, the
    node placement's and the missing head counts' with the layout's own)."""
    layout = layout_from_args(args)
    topo, violations = _node_topology(layout, args)
    violations = layout.violations() + violations
    if topo is not None:
        violations += topology_violations(layout, topo, allow_cross_node_a2a=args.allow_cross_node_a2a)
    unchecked = unchecked_head_rules(layout)
    heads = _head_count_violations(layout, unchecked, args)
    if violations or heads:
        # Missing head counts alone are fixed by flags, not by another layout.
        fixes = nearest_layouts(layout, check=lambda cand: _placement_violations(cand, args)) if violations else []
        violations += heads
        if args.json:
            print(json.dumps({"valid": False, "errors": [v.to_dict() for v in violations],
                              "unchecked": [r.to_dict() for r in unchecked], "dp": layout.dp, "groups": {},
                              "fixes": [{"changed": describe_change(layout, f), "why": offer_reason(layout, f),
                                         "command": _command(f, args), "layout": f.to_dict()} for f in fixes]},
                             indent=2))
        for v in violations:
            print(f"error: {v.message}", file=sys.stderr)
        if fixes:
            print("layouts that pass this check, best first (your comm type, a real two-level split, "
                  "the fewest changes):", file=sys.stderr)
            for f in fixes:
                print(f"  {_command(f, args)}\n      changes: {describe_change(layout, f)}\n"
                      f"      why: {offer_reason(layout, f)}", file=sys.stderr)
        return 2
    groups = rank_groups(layout)
    evaluation = _eval_report(layout)
    topology = node_report(layout, topo) if topo is not None else None
    if args.json:
        report = {"valid": True, "errors": [], "unchecked": [r.to_dict() for r in unchecked], "dp": layout.dp,
                  "groups": groups, "layout": layout.to_dict()}
        if evaluation is not None:
            report["eval"] = evaluation
        if topology is not None:
            report["topology"] = topology
        print(json.dumps(report, indent=2))
        return 0
    _print_text(layout, groups, evaluation, unchecked)
    if topology is not None:
        print("\n".join(format_node_report(topology)))
    return 0


def _head_count_violations(layout: CPLayout, unchecked: list[UncheckedRule],
                           args: argparse.Namespace) -> list[Violation]:
    """One violation per head count whose absence left an all-to-all rule unchecked (none with
    --no-heads), and --no-heads given where nothing is left unchecked."""
    if args.no_heads:
        if all(getattr(layout, f) is not None for f in HEAD_FLAGS):
            return [Violation("no_heads", True, "both head counts are given, so no head rule is left unchecked",
                              f"drop {NO_HEADS_FLAG}")]
        return []
    out = []
    for field in HEAD_FLAGS:
        rules = [r.rule for r in unchecked if r.field == field and r.all_to_all]
        if rules:
            out.append(Violation(
                field, None,
                f"not given, so the all-to-all head rule{'s' if len(rules) > 1 else ''} could not run: "
                + "; ".join(rules),
                f"pass the model's counts, --num-heads N --num-kv-heads K (K = N without GQA), "
                f"or {NO_HEADS_FLAG} to accept the layout with these rules unchecked"))
    return out


def _placement_violations(layout: CPLayout, args: argparse.Namespace) -> list[Violation]:
    """The node-placement violations of `layout` under the --nproc-per-node flags (none without them)."""
    topo, violations = _node_topology(layout, args)
    if topo is not None:
        violations += topology_violations(layout, topo, allow_cross_node_a2a=args.allow_cross_node_a2a)
    return violations


def _command(layout: CPLayout, args: argparse.Namespace) -> str:
    """The `cpkit layout check` command line for `layout`, with this call's placement flags and
    --no-heads where head counts are missing and an all-to-all rule needs them."""
    extra = ""
    if args.nproc_per_node is not None:
        extra = f" --nproc-per-node {args.nproc_per_node}" + (f" {ALLOW_FLAG}" if args.allow_cross_node_a2a else "")
    if any(r.all_to_all for r in unchecked_head_rules(layout)):
        extra += f" {NO_HEADS_FLAG}"  # so that the command passes; the head counts, once given, check it
    return f"cpkit layout check {layout_flags(layout)}{extra}"


def _node_topology(layout: CPLayout, args: argparse.Namespace) -> tuple[NodeTopology | None, list[Violation]]:
    """The nodes --nproc-per-node describes (None without it), or the violations of the flag."""
    if args.nproc_per_node is None:
        return None, []
    try:
        return NodeTopology(layout.world_size, args.nproc_per_node), []
    except CPConfigError as exc:
        return None, list(exc.violations)


def _print_text(layout: CPLayout, groups: dict, evaluation: dict | None, unchecked: list[UncheckedRule]) -> None:
    print(f"valid layout ({len(unchecked)} head rule(s) not checked, listed below)" if unchecked else "valid layout")
    print(f"  world_size={layout.world_size} tp={layout.tp} pp={layout.pp} cp={layout.cp} "
          f"dp={layout.dp} (tp*pp*cp = {layout.model_parallel_size})")
    comm = layout.cp_comm_type
    line = f"  cp_comm_type={comm if isinstance(comm, str) else ','.join(comm)}"
    if layout.uses_hierarchical:
        a2a, p2p = layout.hierarchical_context_parallel_sizes
        line += f" hierarchical_context_parallel_sizes=[{a2a}, {p2p}] (a2a={a2a}, p2p={p2p})"
    print(line)
    if evaluation is not None:
        hier = evaluation["hierarchical_context_parallel_sizes"]
        print(f"  eval: cp={evaluation['cp']} dp={evaluation['dp']}"
              + (f" hierarchical_context_parallel_sizes={hier}" if layout.uses_hierarchical else ""))
    if unchecked:
        missing = " ".join(dict.fromkeys(r.flag for r in unchecked))
        print(f"not checked (no {missing}; pass the model's counts to check them):")
        for rule in unchecked:
            print(f"  {rule.rule}")
    print("rank groups (global ranks; MCore order tp-cp-dp-pp):")
    _print_groups(groups, "  ")
    if evaluation is not None:
        print(f"eval rank groups (cp={evaluation['cp']}):")
        _print_groups(evaluation["groups"], "  ")


def _print_groups(groups: dict, indent: str) -> None:
    for kind, note in _SHOWN:
        if kind in groups:
            suffix = f"  ({note})" if note else ""
            print(f"{indent}{kind:<8} {groups[kind]}{suffix}")
