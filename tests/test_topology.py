"""Node topology rules: a2a groups inside a node, p2p ring hops across nodes (pure arithmetic)."""

import pytest

from cpkit.errors import CPConfigError
from cpkit.layout import CPLayout
from cpkit.topology import (NodeTopology, a2a_groups, check_topology, cross_node_a2a, cross_node_hops,
                            node_report, p2p_rings)


def _hcp(world, sizes, tp=1):
    return CPLayout(world_size=world, tp=tp, cp=world // tp, cp_comm_type="a2a+p2p",
                    hierarchical_context_parallel_sizes=sizes)


def test_nodes_are_contiguous_rank_blocks():
    topo = NodeTopology(16, 8)
    assert topo.nnodes == 2 and topo.node_of(7) == 0 and topo.node_of(8) == 1
    assert topo.ranks_of_node(1) == list(range(8, 16))
    assert topo.nodes_of([0, 8, 9]) == [0, 1]


@pytest.mark.parametrize("nproc", [3, 0])
def test_nproc_per_node_must_divide_the_world(nproc):
    with pytest.raises(CPConfigError) as exc:
        NodeTopology(4, nproc)
    assert exc.value.field == "nproc_per_node" and "fix:" in str(exc.value)


def test_a2a_level_inside_each_node_passes_and_p2p_crosses():
    layout, topo = _hcp(4, [2, 2]).validate(), NodeTopology(4, 2)
    check_topology(layout, topo)
    assert a2a_groups(layout) == [[0, 1], [2, 3]]
    assert p2p_rings(layout) == [[0, 2], [1, 3]]
    assert cross_node_hops(layout, topo) == [(0, 2), (2, 0), (1, 3), (3, 1)]


def test_a2a_of_4_over_two_nodes_of_2_is_refused_naming_groups_and_fix():
    layout, topo = _hcp(4, [4, 1]).validate(), NodeTopology(4, 2)
    assert cross_node_a2a(layout, topo) == [[0, 1, 2, 3]]
    with pytest.raises(CPConfigError) as exc:
        check_topology(layout, topo)
    msg = str(exc.value)
    assert exc.value.field == "hierarchical_context_parallel_sizes"
    assert "[0, 1, 2, 3] (nodes [0, 1])" in msg and "[2, 2]" in msg and "--allow-cross-node-a2a" in msg
    check_topology(layout, topo, allow_cross_node_a2a=True)  # the escape hatch


def test_plain_a2a_over_nodes_is_refused_and_fits_one_node():
    layout = CPLayout(world_size=4, cp=4, cp_comm_type="a2a").validate()
    with pytest.raises(CPConfigError) as exc:
        check_topology(layout, NodeTopology(4, 2))
    assert exc.value.field == "cp_comm_type" and '"a2a+p2p"' in str(exc.value)
    check_topology(layout, NodeTopology(4, 4))
    assert cross_node_hops(layout, NodeTopology(4, 4)) == []  # no p2p level


def test_tp_strides_the_cp_groups_but_keeps_a2a_inside_a_node():
    # 2 nodes x 8 GPUs, tp=2 cp=8 [4, 2]: a2a groups are every other rank of one node.
    layout, topo = _hcp(16, [4, 2], tp=2).validate(), NodeTopology(16, 8)
    check_topology(layout, topo)
    assert [0, 2, 4, 6] in a2a_groups(layout)
    assert all(len(topo.nodes_of(g)) == 1 for g in a2a_groups(layout))
    assert (0, 8) in cross_node_hops(layout, topo)
    # [8, 1] at tp=2 puts ranks 0, 2, ..., 14 in one a2a group: two nodes.
    with pytest.raises(CPConfigError, match=r"\[0, 2, 4, 6, 8, 10, 12, 14\] \(nodes \[0, 1\]\)"):
        check_topology(_hcp(16, [8, 1], tp=2).validate(), topo)


def test_p2p_ring_within_a_node_crosses_nothing_and_the_closing_hop_counts():
    layout = CPLayout(world_size=8, cp=4, cp_comm_type="p2p").validate()  # cp groups [0..3], [4..7]
    assert cross_node_hops(layout, NodeTopology(8, 4)) == []
    assert cross_node_hops(layout, NodeTopology(8, 2)) == [(1, 2), (3, 0), (5, 6), (7, 4)]


def test_node_report_lists_each_nodes_hierarchical_groups_in_rank_order():
    report = node_report(_hcp(4, [2, 2]).validate(), NodeTopology(4, 2))
    assert report["nnodes"] == 2
    assert report["nodes"][1] == {"node": 1, "ranks": [2, 3], "cp": [[0, 1, 2, 3]], "hcp_a2a": [[2, 3]],
                                  "hcp_p2p": [[0, 2], [1, 3]]}
    assert report["cross_node_p2p_hops"] == [[0, 2], [2, 0], [1, 3], [3, 1]]
    assert report["cross_node_a2a"] == []


def test_world_size_must_match_the_launch():
    with pytest.raises(CPConfigError, match="world_size=4"):
        check_topology(_hcp(4, [2, 2]).validate(), NodeTopology(8, 2))
