"""Where a layout's CP groups fall across nodes, as pure arithmetic (no processes).

torchrun gives each node a contiguous block of global ranks: node n holds ranks
n*G .. n*G + G - 1 for G processes per node (LOCAL_WORLD_SIZE). Hierarchical CP is meant to run
its a2a level inside a node (NVLink) and its p2p level between nodes (InfiniBand); an a2a group
that spans nodes sends every all-to-all over the slower fabric. `check_topology` refuses that
(CPConfigError naming the groups and the fix); `node_report` lists, per node, the hierarchical
groups in rank order and which hops of the p2p rings cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpkit.errors import CPConfigError, Violation
from cpkit.layout import A2A, A2A_P2P, P2P, CPLayout
from cpkit.rank_grid import rank_groups

__all__ = ["NodeTopology", "a2a_groups", "p2p_rings", "cross_node_a2a", "cross_node_hops",
           "check_topology", "node_report", "format_node_report"]

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


def _a2a_fix(layout: CPLayout, topo: NodeTopology) -> str:
    g = topo.nproc_per_node
    if layout.uses_hierarchical:
        fits = [[a, layout.cp // a] for a in range(1, g + 1) if layout.cp % a == 0 and g % a == 0]
        smaller = f"hierarchical_context_parallel_sizes with an a2a size that divides {g}, e.g. {fits[-1]}"
    else:
        smaller = f'cp_comm_type "{A2A_P2P}" with hierarchical_context_parallel_sizes [a2a, cp // a2a], a2a dividing {g}'
    return (f"{smaller} (a2a inside a node, p2p between nodes); or pass {ALLOW_FLAG} to proceed "
            f"with the all-to-all over the inter-node network")


def check_topology(layout: CPLayout, topo: NodeTopology, *, allow_cross_node_a2a: bool = False) -> None:
    """Raise CPConfigError when an all-to-all group of `layout` spans nodes (unless allowed).

    The layout must already be valid (validate() first); `topo.world_size` must equal
    `layout.world_size`. The error names every spanning group with its nodes, and the fix.
    """
    if topo.world_size != layout.world_size:
        raise CPConfigError.single("world_size", layout.world_size,
                                   f"must equal the launched ranks {topo.world_size}",
                                   "give the layout the job's world size")
    spanning = cross_node_a2a(layout, topo)
    if not spanning or allow_cross_node_a2a:
        return
    field = "hierarchical_context_parallel_sizes" if layout.uses_hierarchical else "cp_comm_type"
    value = layout.hierarchical_context_parallel_sizes if layout.uses_hierarchical else layout.cp_comm_type
    shown = ", ".join(f"{g} (nodes {topo.nodes_of(g)})" for g in spanning)
    raise CPConfigError([Violation(
        field, value,
        f"a2a groups span nodes with nproc_per_node={topo.nproc_per_node}: {shown}",
        _a2a_fix(layout, topo))])


def node_report(layout: CPLayout, topo: NodeTopology) -> dict:
    """Per node, the CP (and hierarchical) groups touching it in rank order, and the p2p hops
    that cross nodes: {"nnodes", "nproc_per_node", "nodes": [{"node", "ranks", "cp", "hcp_a2a",
    "hcp_p2p"}], "cross_node_a2a", "cross_node_p2p_hops"}."""
    groups = rank_groups(layout)
    nodes = []
    for node in range(topo.nnodes):
        mine = set(topo.ranks_of_node(node))
        entry = {"node": node, "ranks": topo.ranks_of_node(node)}
        for kind in ("cp", "hcp_a2a", "hcp_p2p"):
            if kind in groups:
                entry[kind] = [g for g in groups[kind] if mine & set(g)]
        nodes.append(entry)
    return {"nnodes": topo.nnodes, "nproc_per_node": topo.nproc_per_node, "nodes": nodes,
            "cross_node_a2a": cross_node_a2a(layout, topo),
            "cross_node_p2p_hops": [list(h) for h in cross_node_hops(layout, topo)]}


def format_node_report(report: dict) -> list[str]:
    """Text lines of node_report(): one line per node and group kind, then the crossing hops."""
    lines = [f"topology: {report['nnodes']} node(s) x {report['nproc_per_node']} rank(s)"]
    for entry in report["nodes"]:
        r = entry["ranks"]
        head = f"  node {entry['node']} (ranks {r[0]}-{r[-1]}):"
        parts = [f"{kind} {entry[kind]}" for kind in ("cp", "hcp_a2a", "hcp_p2p") if kind in entry]
        lines.append(f"{head} " + "; ".join(parts))
    hops = report["cross_node_p2p_hops"]
    lines.append(f"  p2p ring hops crossing nodes: {', '.join(f'{a}->{b}' for a, b in hops) if hops else 'none'}")
    if report["cross_node_a2a"]:
        lines.append(f"  a2a groups spanning nodes (allowed): {report['cross_node_a2a']}")
    return lines
