"""Unit tests of the CP group registry (cpkit.dynamic.registry): pure rank arithmetic, the
creation order, and one real torch.distributed world of size 1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkit.dynamic import schedule
from cpkit.dynamic.plan import CPGroupAssignment
from cpkit.dynamic.registry import (
    GroupRegistry,
    aligned_blocks,
    build_group_registry,
    hierarchical_layout,
    registry_layout,
    tp_cp_layout,
)
from cpkit.errors import CPConfigError


def test_aligned_blocks_of_six_ranks():
    assert aligned_blocks(6) == [
        (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5),
        (2, 0), (2, 2), (2, 4),
        (4, 0),
    ]


def test_aligned_blocks_size_range():
    assert aligned_blocks(8, min_cp_size=2) == [
        (2, 0), (2, 2), (2, 4), (2, 6), (4, 0), (4, 4), (8, 0),
    ]
    assert aligned_blocks(8, min_cp_size=4, max_cp_size=4) == [(4, 0), (4, 4)]
    assert aligned_blocks(1) == [(1, 0)]


@pytest.mark.parametrize("args, field", [
    ((0,), "dp_cp_size"),
    ((8, 3), "min_cp_size"),
    ((6, 8), "min_cp_size"),
    ((8, 4, 2), "max_cp_size"),
    ((8, 1, 16), "max_cp_size"),
])
def test_aligned_blocks_rejects_bad_sizes(args, field):
    with pytest.raises(CPConfigError) as info:
        aligned_blocks(*args)
    assert info.value.field == field


@settings(max_examples=100, derandomize=True, deadline=None, database=None)
@given(st.integers(1, 64), st.lists(st.integers(1, 200), min_size=1, max_size=30))
def test_every_group_a_plan_uses_is_in_the_registry(n, lens):
    largest = 1 << (n.bit_length() - 1)
    lens = [min(L, largest * 16) for L in lens]
    plan = schedule(lens, dp_cp_size=n, max_seq_len_per_rank=16)
    blocks = set(aligned_blocks(n))
    for mb in plan.microbatches:
        for g in mb.groups:
            assert (g.cp_size, g.first_rank) in blocks


def test_layout_maps_positions_to_global_ranks_per_replica():
    layout = registry_layout([[0, 2, 4, 6], [1, 3, 5, 7]], min_cp_size=2)
    assert [(b.replica, b.cp_size, b.first, b.global_ranks) for b in layout] == [
        (0, 2, 0, (0, 2)), (0, 2, 2, (4, 6)), (0, 4, 0, (0, 2, 4, 6)),
        (1, 2, 0, (1, 3)), (1, 2, 2, (5, 7)), (1, 4, 0, (1, 3, 5, 7)),
    ]


@pytest.mark.parametrize("lists", [[], [[]], [[0, 1], [2]], [[0, 1], [1, 2]]])
def test_layout_rejects_bad_rank_lists(lists):
    with pytest.raises(CPConfigError):
        registry_layout(lists)


class _FakeNewGroup:
    """Records new_group calls; returns a token naming the ranks."""

    def __init__(self):
        self.calls = []

    def __call__(self, ranks, **kwargs):
        self.calls.append((tuple(ranks), kwargs))
        return ("group", tuple(ranks))


def test_every_rank_creates_all_groups_in_the_same_order():
    lists = [[0, 2, 4, 6], [1, 3, 5, 7]]
    fakes = {}
    registries = {}
    for rank in range(8):
        fakes[rank] = _FakeNewGroup()
        registries[rank] = build_group_registry(lists, rank, new_group=fakes[rank], backend="gloo")
    calls = [fakes[r].calls for r in range(8)]
    assert all(c == calls[0] for c in calls)  # same groups, same order, on every rank
    assert len(calls[0]) == 2 * len(aligned_blocks(4))
    assert all(kwargs == {"backend": "gloo"} for _, kwargs in calls[0])

    reg = registries[5]  # rank 5 is position 2 of the second DPxCP group
    assert reg.dp_cp_ranks == (1, 3, 5, 7)
    assert reg.sizes == (1, 2, 4)
    assert reg.get(2, 2) == ("group", (5, 7))
    assert reg.get(4, 0) == ("group", (1, 3, 5, 7))
    assert reg.global_ranks(2, 2) == (5, 7)
    assert reg.for_assignment(CPGroupAssignment(ranks=(2, 3), samples=(0,), cp_size=2)) == (
        "group", (5, 7))


@pytest.mark.parametrize("key", [(2, 1), (8, 0), (3, 0), (1, 4)])
def test_lookup_of_a_block_that_does_not_exist_names_it(key):
    reg = build_group_registry([[0, 1, 2, 3]], 0, new_group=_FakeNewGroup())
    with pytest.raises(CPConfigError) as info:
        reg.get(*key)
    assert info.value.value == key
    assert "sizes [1, 2, 4]" in str(info.value)


def test_rank_outside_every_group_is_rejected():
    with pytest.raises(CPConfigError) as info:
        build_group_registry([[0, 1]], 5, new_group=_FakeNewGroup())
    assert info.value.field == "rank"


def test_real_process_group_on_world_of_one(world1):
    import torch.distributed as dist

    reg = build_group_registry([[0]], 0, backend="gloo")
    assert isinstance(reg, GroupRegistry)
    group = reg.get(1, 0)
    assert dist.get_world_size(group) == 1
    assert dist.get_process_group_ranks(group) == [0]


def test_tp_cp_groups_are_the_union_of_the_blocks_tp_groups():
    # tp=2, dp_cp=2: DPxCP groups [0, 2] and [1, 3], tp groups [0, 1] and [2, 3].
    dp_cp, tp = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    assert tp_cp_layout(registry_layout(dp_cp), tp) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    fakes = {r: _FakeNewGroup() for r in range(4)}
    regs = {r: build_group_registry(dp_cp, r, new_group=fakes[r], tp_rank_lists=tp) for r in range(4)}
    assert all(fakes[r].calls == fakes[0].calls for r in range(4))
    # Both tp ranks of a block share one tp x cp group (created once, not once per DPxCP group).
    assert regs[0].tp_cp_groups[(2, 0)] == regs[1].tp_cp_groups[(2, 0)] == ("group", (0, 1, 2, 3))
    assert regs[3].tp_cp_for(CPGroupAssignment(ranks=(1,), samples=(0,), cp_size=1)) == ("group", (2, 3))
    assert regs[0].hcp_groups == {}


def test_tp_cp_layout_rejects_a_rank_without_a_tp_group():
    with pytest.raises(CPConfigError) as info:
        tp_cp_layout(registry_layout([[0, 2], [1, 3]]), [[0, 1]])
    assert info.value.field == "tp_rank_lists"
    assert "[2]" in str(info.value)


def test_hierarchical_pairs_only_on_blocks_of_their_size():
    layout = registry_layout([[0, 1, 2, 3]])
    found = hierarchical_layout(layout, [2, 2])
    assert [(s.cp_size, s.first, a2a, p2p) for s, a2a, p2p in found] == [
        (4, 0, [[0, 1], [2, 3]], [[0, 2], [1, 3]])]  # a2a contiguous, p2p strided (MCore, TE)
    regs = {r: build_group_registry([[0, 1, 2, 3]], r, new_group=_FakeNewGroup(), hierarchical_sizes=[2, 2])
            for r in range(4)}
    assert regs[2].hcp_groups == {(4, 0): (("group", (2, 3)), ("group", (0, 2)))}
    assert regs[2].hcp_for(CPGroupAssignment(ranks=(2, 3), samples=(0,), cp_size=2)) is None


@pytest.mark.parametrize("sizes", [[4], [1, 4], [2, 2, 1], [2.0, 2]])
def test_hierarchical_sizes_must_be_two_ints_of_at_least_two(sizes):
    with pytest.raises(CPConfigError) as info:
        hierarchical_layout(registry_layout([[0, 1, 2, 3]]), sizes)
    assert info.value.field == "hierarchical_sizes"
