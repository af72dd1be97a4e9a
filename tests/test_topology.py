"""Node topology rules: a2a groups inside a node, p2p ring hops across nodes (pure arithmetic)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkit.errors import CPConfigError
from cpkit.parallel.layout import CPLayout
from cpkit.hierarchical.topology import (NodeTopology, a2a_fix, a2a_groups, check_topology, cross_node_a2a, cross_node_hops,
                            format_node_report, node_report, p2p_rings, topology_violations)


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


# -- the fix an error suggests passes the same checks ------------------------------------------


def test_tp_filling_a_node_leaves_no_a2a_size_and_the_fix_says_so():
    # 4 nodes x 8, tp=8: each node holds one rank of every CP group, so no a2a group of 2 or more
    # ranks fits in a node; [4, 1] (the refused layout itself) must not come back as the fix.
    layout = CPLayout(world_size=32, tp=8, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1],
                      num_attention_heads=64, num_query_groups=32).validate()
    topo = NodeTopology(32, 8)
    fixed = a2a_fix(layout, topo)
    assert fixed.cp_comm_type == "p2p" and fixed.hierarchical_context_parallel_sizes is None
    check_topology(fixed.validate(), topo)
    with pytest.raises(CPConfigError) as exc:
        check_topology(layout, topo)
    fix = exc.value.violations[0].fix
    assert "no all-to-all size above 1 fits" in fix and 'cp_comm_type="p2p"' in fix
    assert "[4, 1]" not in fix


def test_the_fix_keeps_the_heads_divisible():
    # tp=2 on nodes of 8 allows a2a 4, but 4 KV heads / tp = 2 allow only a2a 2.
    layout = CPLayout(world_size=16, tp=2, cp=8, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[8, 1],
                      num_attention_heads=16, num_query_groups=4)
    found = topology_violations(layout, NodeTopology(16, 8))  # next to the layout's own head violation
    assert layout.violations() and len(found) == 1
    assert "hierarchical_context_parallel_sizes=[2, 4]" in found[0].fix
    assert a2a_fix(layout, NodeTopology(16, 8)).validate().hierarchical_context_parallel_sizes == [2, 4]


def test_plain_a2a_fix_moves_to_a2a_p2p_and_names_the_comm_type():
    layout = CPLayout(world_size=16, cp=16, cp_comm_type="a2a", num_attention_heads=32).validate()
    (found,) = topology_violations(layout, NodeTopology(16, 8))
    assert 'cp_comm_type="a2a+p2p" with hierarchical_context_parallel_sizes=[8, 2]' in found.fix


def test_a_fix_leaves_the_other_violations_to_their_own_fixes():
    # seq_length breaks a rule no comm type changes: the fix is still the largest a2a that fits.
    layout = CPLayout(world_size=16, cp=16, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[16, 1],
                      seq_length=100, num_attention_heads=8)
    fixed = a2a_fix(layout, NodeTopology(16, 8))
    assert fixed.hierarchical_context_parallel_sizes == [8, 2]
    assert {v.field for v in fixed.violations()} == {"seq_length"}


@st.composite
def _layouts_on_nodes(draw):
    """A layout on 1-4 nodes of 1-8 ranks whose p2p form is valid, with a2a or a2a+p2p of any size."""
    nproc = draw(st.sampled_from([1, 2, 4, 8, 8]))
    world = nproc * draw(st.sampled_from([1, 2, 4, 4]))
    tp = draw(st.sampled_from([d for d in (1, 1, 2, 2, 4, 8) if world % d == 0]))
    cp = draw(st.sampled_from([d for d in range(2, world // tp + 1) if (world // tp) % d == 0] or [1]))
    kv = tp * draw(st.sampled_from([1, 3, 4, 8, 16, 16]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    if draw(st.booleans()):
        a2a = draw(st.sampled_from([d for d in range(1, cp + 1) if cp % d == 0]))
        comm, hier = "a2a+p2p", [a2a, cp // a2a]
    else:
        comm, hier = "a2a", None
    layout = CPLayout(world_size=world, tp=tp, cp=cp, cp_comm_type=comm, hierarchical_context_parallel_sizes=hier,
                      num_attention_heads=heads, num_query_groups=kv,
                      seq_length=draw(st.sampled_from([None, 2 * cp * 64])))
    return layout, NodeTopology(world, nproc)


def _passes(layout, topo) -> bool:
    try:
        check_topology(layout.validate(), topo)
    except CPConfigError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(case=_layouts_on_nodes())
def test_every_suggested_fix_passes_the_same_checks_and_keeps_the_largest_a2a(case):
    layout, topo = case
    found = topology_violations(layout, topo)
    if not found:
        return
    fixed = a2a_fix(layout, topo)
    assert _passes(fixed, topo), (layout, fixed)
    # No a2a+p2p layout with a larger a2a size passes too.
    a2a = fixed.hierarchical_context_parallel_sizes[0] if fixed.uses_hierarchical else 1
    for bigger in (d for d in range(a2a + 1, layout.cp + 1) if layout.cp % d == 0):
        other = dataclasses.replace(layout, cp_comm_type="a2a+p2p",
                                    hierarchical_context_parallel_sizes=[bigger, layout.cp // bigger])
        assert not _passes(other, topo), (layout, other)
    (violation,) = found
    if a2a == 1:
        assert "no all-to-all size above 1 fits" in violation.fix and 'cp_comm_type="p2p"' in violation.fix
    else:
        assert f"hierarchical_context_parallel_sizes={fixed.hierarchical_context_parallel_sizes}" in violation.fix
    assert "--allow-cross-node-a2a" in violation.fix


# -- what crosses nodes, per comm type ---------------------------------------------------------


def test_all_gather_over_nodes_reports_its_groups_not_an_empty_ring():
    layout, topo = CPLayout(world_size=8, cp=8, cp_comm_type="all_gather").validate(), NodeTopology(8, 2)
    report = node_report(layout, topo)
    assert report["comm_types"] == ["all_gather"]
    assert report["cross_node_all_gather"] == [list(range(8))]
    lines = format_node_report(report)
    assert "  all_gather groups spanning nodes: [0, 1, 2, 3, 4, 5, 6, 7] (nodes [0, 1, 2, 3])" in lines
    assert not any("p2p ring hops" in line for line in lines)


def test_cp_of_one_reports_no_cp_communication():
    lines = format_node_report(node_report(CPLayout(world_size=4, tp=2).validate(), NodeTopology(4, 2)))
    assert lines[-1] == "  no CP communication (cp=1)"
