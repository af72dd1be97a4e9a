"""Where a layout's CP groups fall across nodes, as pure arithmetic (no processes).

torchrun gives each node a contiguous block of global ranks: node n holds ranks
n*G .. n*G + G - 1 for G processes per node (LOCAL_WORLD_SIZE). Hierarchical CP is meant to run
its a2a level inside a node (NVLink) and its p2p level between nodes (InfiniBand); an a2a group
that spans nodes sends every all-to-all over the slower fabric. `check_topology` refuses that
(CPConfigError naming the groups and a fix, `a2a_fix`, that passes the same checks);
`topology_violations` gives the same violations as a list, next to the layout's own;
`node_report` lists, per node, the hierarchical groups in rank order and, per comm type, what
crosses nodes (p2p ring hops, all_gather and a2a groups).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpkit.errors import CPConfigError, Violation
from cpkit.parallel.layout import A2A, A2A_P2P, ALL_GATHER, CP_COMM_TYPES, P2P, CPLayout
from cpkit.parallel.rank_grid import rank_groups

__all__ = ["NodeTopology", "a2a_groups", "all_gather_groups", "p2p_rings", "cross_node_a2a", "cross_node_hops",
           "a2a_fix", "check_topology", "topology_violations", "node_report", "format_node_report"]

ALLOW_FLAG = "--allow-cross-node-a2a"


@dataclass(frozen=True)
class NodeTopology:
    """`world_size` ranks on nodes of `nproc_per_node` contiguous ranks each (torchrun's order)."""

    world_size: int
    """Number of ranks in the job."""

    nproc_per_node: int
    """Ranks per node (torchrun's --nproc-per-node, LOCAL_WORLD_SIZE in each rank)."""

    def __post_init__(self):
        if not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1:
            raise CPConfigError.single("nproc_per_node", self.nproc_per_node, "must be an integer >= 1",
                                       "give the number of processes (GPUs) per node")
        if self.world_size % self.nproc_per_node:
            raise CPConfigError.single(
                "nproc_per_node", self.nproc_per_node,
                f"must divide world_size={self.world_size} (every node runs the same number of ranks)",
                f"use a divisor of {self.world_size}, e.g. "
                f"{[g for g in range(1, self.world_size + 1) if self.world_size % g == 0]}")

    @property
    def nnodes(self) -> int:
        """Number of nodes."""
        return self.world_size // self.nproc_per_node

    def node_of(self, rank: int) -> int:
        """The node that holds global rank `rank`."""
        return rank // self.nproc_per_node

    def nodes_of(self, ranks) -> list[int]:
        """The sorted distinct nodes a group of ranks touches."""
        return sorted({self.node_of(r) for r in ranks})

    def ranks_of_node(self, node: int) -> list[int]:
        """The global ranks on `node`."""
        return list(range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node))


def a2a_groups(layout: CPLayout) -> list[list[int]]:
    """The all-to-all groups of a (valid) layout: each CP group for a2a, each level-0 group for
    a2a+p2p (both when layers mix them); empty when no layer uses all-to-all."""
    groups = rank_groups(layout)
    types = layout.layer_comm_types
    out = list(groups["cp"]) if A2A in types and layout.cp > 1 else []
    if A2A_P2P in types and layout.hierarchical_context_parallel_sizes[0] > 1:
        out += groups["hcp_a2a"]
    return out


def p2p_rings(layout: CPLayout) -> list[list[int]]:
    """The rings the p2p exchange runs over, in ring order: each CP group for p2p, each level-1
    group for a2a+p2p; rings of one rank are left out."""
    groups = rank_groups(layout)
    types = layout.layer_comm_types
    out = list(groups["cp"]) if P2P in types and layout.cp > 1 else []
    if A2A_P2P in types:
        out += [g for g in groups["hcp_p2p"] if len(g) > 1]
    return out


def cross_node_a2a(layout: CPLayout, topo: NodeTopology) -> list[list[int]]:
    """The all-to-all groups that span more than one node."""
    return [g for g in a2a_groups(layout) if len(topo.nodes_of(g)) > 1]


def cross_node_hops(layout: CPLayout, topo: NodeTopology) -> list[tuple[int, int]]:
    """Every hop (sender, receiver) of every p2p ring whose two ranks sit on different nodes,
    the closing hop (last rank back to the first) included."""
    hops = []
    for ring in p2p_rings(layout):
        for i, src in enumerate(ring):
            dst = ring[(i + 1) % len(ring)]
            if topo.node_of(src) != topo.node_of(dst) and (src, dst) not in hops:
                hops.append((src, dst))
    return hops


def _structure(layout: CPLayout) -> CPLayout | None:
    """The layout without the rules that do not move ranks (sequence, heads, eval), or None when
    its sizes give no rank groups: lets the topology be judged next to a head or sequence
    violation, so that every violation is reported at once."""
    bare = dataclasses.replace(layout, seq_length=None, num_attention_heads=None, num_query_groups=None,
                               sequence_parallel=False, eval_context_parallel_size=None)
    return bare if bare.is_valid() else None


def _with_a2a_size(layout: CPLayout, a2a: int) -> CPLayout:
    """`layout` with every all-to-all layer on a2a+p2p [a2a, cp // a2a], or on p2p for a2a == 1."""
    if a2a == 1:
        types = [P2P if t in (A2A, A2A_P2P) else t for t in layout.layer_comm_types]
        hier = None
    else:
        types = [A2A_P2P if t == A2A else t for t in layout.layer_comm_types]
        hier = [a2a, layout.cp // a2a]
    comm = types[0] if isinstance(layout.cp_comm_type, str) else types
    return dataclasses.replace(layout, cp_comm_type=comm, hierarchical_context_parallel_sizes=hier)


def _messages(layout: CPLayout) -> set[str]:
    return {v.message for v in layout.violations()}


def a2a_fix(layout: CPLayout, topo: NodeTopology) -> CPLayout:
    """`layout` with the largest a2a size whose all-to-all groups all stay inside a node.

    Tries a2a+p2p with the largest a2a size first, down to p2p (a2a size 1, which always fits),
    and keeps the first candidate that passes every check `layout` can pass: no a2a group spans
    nodes, and no violation beyond those `layout` has on p2p (heads divisible by tp and by the
    a2a size, product = cp, ...). Comm types other than a2a and a2a+p2p are kept.
    """
    allowed = _messages(_with_a2a_size(layout, 1))  # what no comm type change can fix
    for a2a in sorted((d for d in range(2, layout.cp + 1) if layout.cp % d == 0), reverse=True):
        candidate = _with_a2a_size(layout, a2a)
        if _fits_node(candidate, topo) and _messages(candidate) <= allowed:
            return candidate
    return _with_a2a_size(layout, 1)


def _fits_node(layout: CPLayout, topo: NodeTopology) -> bool:
    bare = _structure(layout)
    return bare is not None and not cross_node_a2a(bare, topo)


def _describe_fix(layout: CPLayout, fixed: CPLayout, topo: NodeTopology) -> str:
    """The fix a2a_fix() found, in words: the field values, and why no larger a2a size works."""
    g, tp = topo.nproc_per_node, layout.tp
    comm = fixed.cp_comm_type if isinstance(fixed.cp_comm_type, str) else list(fixed.cp_comm_type)
    comm = f'"{comm}"' if isinstance(comm, str) else comm
    if fixed.uses_hierarchical:
        a2a, p2p = fixed.hierarchical_context_parallel_sizes
        change = "" if fixed.cp_comm_type == layout.cp_comm_type else f"cp_comm_type={comm} with "
        heads = " and divides the heads per TP rank" if layout.num_attention_heads is not None else ""
        return (f"{change}hierarchical_context_parallel_sizes={[a2a, p2p]} (the largest a2a size that keeps "
                f"each a2a group inside a node{heads}; p2p {p2p} between nodes)")
    sizes = [d for d in range(2, layout.cp + 1) if layout.cp % d == 0]
    placed = [d for d in sizes if _fits_node(_with_a2a_size(layout, d), topo)]
    if not placed:
        why = f"at tp={tp} with nproc_per_node={g} every a2a group of 2 or more CP ranks spans nodes"
    else:
        smallest, allowed = _with_a2a_size(layout, placed[0]), _messages(fixed)
        broken = next(v for v in smallest.violations() if v.message not in allowed)
        why = (f"a2a sizes {placed} fit inside a node but each breaks another rule, e.g. a2a size "
               f"{placed[0]}: {broken.field}={broken.value!r}: {broken.constraint}")
    return (f"no all-to-all size above 1 fits ({why}); use cp_comm_type={comm} "
            "without hierarchical_context_parallel_sizes (the ring alone, between nodes)")


def topology_violations(layout: CPLayout, topo: NodeTopology, *,
                        allow_cross_node_a2a: bool = False) -> list[Violation]:
    """The node-placement violations of `layout` on `topo`: an all-to-all group that spans nodes
    (unless allowed), with the fix from a2a_fix(). Works next to other violations (heads,
    sequence): empty only when the sizes give no rank groups, which validate() reports."""
    if topo.world_size != layout.world_size:
        return [Violation("world_size", layout.world_size, f"must equal the launched ranks {topo.world_size}",
                          "give the layout the job's world size")]
    bare = _structure(layout)
    spanning = cross_node_a2a(bare, topo) if bare is not None else []
    if not spanning or allow_cross_node_a2a:
        return []
    field = "hierarchical_context_parallel_sizes" if layout.uses_hierarchical else "cp_comm_type"
    value = layout.hierarchical_context_parallel_sizes if layout.uses_hierarchical else layout.cp_comm_type
    shown = ", ".join(f"{g} (nodes {topo.nodes_of(g)})" for g in spanning)
    fix = _describe_fix(layout, a2a_fix(layout, topo), topo)
    return [Violation(field, value, f"a2a groups span nodes with nproc_per_node={topo.nproc_per_node}: {shown}",
                      f"{fix}; or pass {ALLOW_FLAG} to proceed with the all-to-all over the inter-node network")]


def check_topology(layout: CPLayout, topo: NodeTopology, *, allow_cross_node_a2a: bool = False) -> None:
    """Raise CPConfigError when an all-to-all group of `layout` spans nodes (unless allowed).

    `topo.world_size` must equal `layout.world_size`. The error names every spanning group with
    its nodes, and a fix that passes this check and the layout's own (a2a_fix()).
    """
    found = topology_violations(layout, topo, allow_cross_node_a2a=allow_cross_node_a2a)
    if found:
        raise CPConfigError(found)


def all_gather_groups(layout: CPLayout) -> list[list[int]]:
    """The groups KV is all-gathered over: each CP group when some layer uses all_gather."""
    return list(rank_groups(layout)["cp"]) if ALL_GATHER in layout.layer_comm_types and layout.cp > 1 else []


def node_report(layout: CPLayout, topo: NodeTopology) -> dict:
    """Per node, the CP (and hierarchical) groups touching it in rank order, and what CP
    communication crosses nodes: {"nnodes", "nproc_per_node", "comm_types" (those the CP
    layers use; empty at cp=1), "nodes": [{"node", "ranks", "cp", "hcp_a2a", "hcp_p2p"}],
    "cross_node_a2a", "cross_node_all_gather" (groups spanning nodes), "cross_node_p2p_hops"}."""
    groups = rank_groups(layout)
    nodes = []
    for node in range(topo.nnodes):
        mine = set(topo.ranks_of_node(node))
        entry = {"node": node, "ranks": topo.ranks_of_node(node)}
        for kind in ("cp", "hcp_a2a", "hcp_p2p"):
            if kind in groups:
                entry[kind] = [g for g in groups[kind] if mine & set(g)]
        nodes.append(entry)
    comm_types = [t for t in CP_COMM_TYPES if t in layout.layer_comm_types] if layout.cp > 1 else []
    return {"nnodes": topo.nnodes, "nproc_per_node": topo.nproc_per_node, "comm_types": comm_types,
            "nodes": nodes,
            "cross_node_a2a": cross_node_a2a(layout, topo),
            "cross_node_all_gather": [g for g in all_gather_groups(layout) if len(topo.nodes_of(g)) > 1],
            "cross_node_p2p_hops": [list(h) for h in cross_node_hops(layout, topo)]}


def _spanning(groups: list[list[int]], nproc_per_node: int) -> str:
    if not groups:
        return "none"
    return ", ".join(f"{g} (nodes {sorted({r // nproc_per_node for r in g})})" for g in groups)


def format_node_report(report: dict) -> list[str]:
    """Text lines of node_report(): one line per node and group kind, then, for each comm type
    the CP layers use, what of it crosses nodes (ring hops, all-gather or all-to-all groups)."""
    lines = [f"topology: {report['nnodes']} node(s) x {report['nproc_per_node']} rank(s)"]
    for entry in report["nodes"]:
        r = entry["ranks"]
        head = f"  node {entry['node']} (ranks {r[0]}-{r[-1]}):"
        parts = [f"{kind} {entry[kind]}" for kind in ("cp", "hcp_a2a", "hcp_p2p") if kind in entry]
        lines.append(f"{head} " + "; ".join(parts))
    types, g = report["comm_types"], report["nproc_per_node"]
    if not types:
        lines.append("  no CP communication (cp=1)")
    if P2P in types or A2A_P2P in types:
        hops = report["cross_node_p2p_hops"]
        lines.append(f"  p2p ring hops crossing nodes: {', '.join(f'{a}->{b}' for a, b in hops) if hops else 'none'}")
    if ALL_GATHER in types:
        lines.append(f"  all_gather groups spanning nodes: {_spanning(report['cross_node_all_gather'], g)}")
    if A2A in types or A2A_P2P in types:
        spanning = report["cross_node_a2a"]
        lines.append(f"  a2a groups spanning nodes{' (allowed)' if spanning else ''}: {_spanning(spanning, g)}")
    return lines
