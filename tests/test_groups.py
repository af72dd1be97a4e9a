"""Rank groups as pure arithmetic (no processes): literal hand-checked layouts, cross-checked with
MCore's RankGenerator, create_hierarchical_groups and HyperCommGrid; the a2a+p2p build gate; the
group builder and its log lines at world size 1."""

import itertools
import math

import pytest

from cpkit.errors import CPConfigError
from cpkit.parallel.group_info import require_hierarchical_groups
from cpkit.parallel.layout import CPLayout
from cpkit.parallel.rank_grid import GROUP_KINDS, groups_of_rank, hierarchical_levels, rank_coordinates, rank_groups
from cpkit.testing.fakes import fake_group


def hcp(world_size, hier, tp=1, **kw):
    return CPLayout(world_size=world_size, tp=tp, cp=math.prod(hier), cp_comm_type="a2a+p2p",
                    hierarchical_context_parallel_sizes=hier, **kw)


# ---------------------------------------------------------------------------------------------
# Literal layouts, checked by hand against rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank))

def test_a2a_p2p_2x2_on_4_ranks():
    g = rank_groups(hcp(4, [2, 2]))
    assert g["cp"] == [[0, 1, 2, 3]]
    assert g["hcp_a2a"] == [[0, 1], [2, 3]]
    assert g["hcp_p2p"] == [[0, 2], [1, 3]]
    assert g["tp"] == [[0], [1], [2], [3]] and g["dp"] == [[0], [1], [2], [3]]


def test_a2a_p2p_4x1_is_all_a2a():
    g = rank_groups(hcp(4, [4, 1]))
    assert g["hcp_a2a"] == [[0, 1, 2, 3]]
    assert g["hcp_p2p"] == [[0], [1], [2], [3]]


def test_a2a_p2p_1x4_is_all_p2p():
    g = rank_groups(hcp(4, [1, 4]))
    assert g["hcp_a2a"] == [[0], [1], [2], [3]]
    assert g["hcp_p2p"] == [[0, 1, 2, 3]]


def test_a2a_p2p_2x2_with_tp2_on_8_ranks():
    g = rank_groups(hcp(8, [2, 2], tp=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["dp"] == [[r] for r in range(8)]
    # level 0: contiguous CP positions (0,1) and (2,3); level 1: positions (0,2) and (1,3)
    assert g["hcp_a2a"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert g["hcp_p2p"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert g["tp_cp"] == [list(range(8))]


def test_a2a_p2p_2x2_with_dp2_on_8_ranks():
    g = rank_groups(hcp(8, [2, 2]))
    assert g["cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [list(range(8))]
    assert g["hcp_a2a"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["hcp_p2p"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_a2a_p2p_2x2_with_tp2_dp2_on_16_ranks():
    g = rank_groups(hcp(16, [2, 2], tp=2))
    assert g["tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["dp"] == [[r, r + 8] for r in range(8)]
    assert g["dp_cp"] == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert g["tp_cp"] == [list(range(8)), list(range(8, 16))]
    assert g["tp_dp_cp"] == [list(range(16))]
    assert g["hcp_a2a"] == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert g["hcp_p2p"] == [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]


def test_pipeline_and_embedding_groups():
    g = rank_groups(CPLayout(world_size=8, tp=2, pp=4))
    assert g["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["mp"] == [list(range(8))]
    assert g["embd"] == [[0, 6], [1, 7]]  # first and last stage
    assert g["pos_embd"] == [[0], [1]]  # first stage
    g1 = rank_groups(CPLayout(world_size=2, cp=2))
    assert g1["embd"] == [[0], [1]] and g1["pos_embd"] == [[0], [1]]


def test_p2p_layout_has_no_hierarchical_groups():
    g = rank_groups(CPLayout(world_size=4, tp=2, cp=2))
    assert set(g) == set(GROUP_KINDS) - {"hcp_a2a", "hcp_p2p"}
    assert g["cp"] == [[0, 2], [1, 3]]


def test_rank_groups_validates_first():
    with pytest.raises(CPConfigError):
        rank_groups(CPLayout(world_size=4, cp=4, cp_comm_type="a2a+p2p"))


def test_groups_of_rank_and_coordinates():
    layout = hcp(16, [2, 2], tp=2)
    mine = groups_of_rank(rank_groups(layout), 13)
    assert mine["tp"] == [12, 13] and mine["cp"] == [9, 11, 13, 15] and mine["dp"] == [5, 13]
    assert mine["hcp_a2a"] == [13, 15] and mine["hcp_p2p"] == [9, 13]
    assert rank_coordinates(layout, 13) == {"tp": 1, "cp": 2, "dp": 1, "pp": 0}
    middle = groups_of_rank(rank_groups(CPLayout(world_size=4, pp=4)), 1)
    assert "embd" not in middle and "pos_embd" not in middle


def test_every_rank_in_exactly_one_group_per_kind():
    for layout in [hcp(16, [2, 2], tp=2), CPLayout(world_size=24, tp=2, pp=3, cp=2)]:
        for kind, groups in rank_groups(layout).items():
            if kind in ("embd", "pos_embd"):
                continue
            assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), kind


# ---------------------------------------------------------------------------------------------
# Cross-checks against MCore's own arithmetic (no processes)

LAYOUTS = [
    (ws, tp, pp, cp)
    for ws, tp, pp, cp in itertools.product([1, 2, 4, 8, 16, 24], [1, 2, 4], [1, 2, 3], [1, 2, 4, 8])
    if ws % (tp * pp * cp) == 0
]
TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "mp": "tp-pp", "tp_cp": "tp-cp",
          "dp_cp": "dp-cp", "tp_dp_cp": "tp-dp-cp"}


def test_axis_groups_equal_mcore_rank_generator():
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    assert len(LAYOUTS) > 40
    for ws, tp, pp, cp in LAYOUTS:
        layout = CPLayout(world_size=ws, tp=tp, pp=pp, cp=cp)
        mine = rank_groups(layout)
        gen = RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for kind, token in TOKENS.items():
            assert mine[kind] == gen.get_ranks(token), (ws, tp, pp, cp, kind)
        assert mine["embd"] == [default_embedding_ranks(p) for p in gen.get_ranks("pp")]


@pytest.mark.parametrize("sizes", [[2, 2], [4, 1], [1, 4], [2, 4], [4, 2], [2, 2, 2]])
def test_hierarchical_levels_equal_mcore_create_hierarchical_groups(monkeypatch, sizes):
    import megatron.core.parallel_state as ps

    made = []
    # Record the memberships MCore would create instead of creating process groups.
    monkeypatch.setattr(ps, "create_group", lambda ranks, **kw: made.append(list(ranks)) or tuple(ranks))
    cp_group = list(range(1, 2 * math.prod(sizes), 2))  # a strided CP group, as with tp=2
    ps.create_hierarchical_groups(cp_group[0], cp_group, sizes)
    assert [g for level in hierarchical_levels(cp_group, sizes) for g in level] == made


def test_hierarchical_groups_of_layouts_equal_mcore(monkeypatch):
    import megatron.core.parallel_state as ps

    for layout in [hcp(4, [2, 2]), hcp(8, [2, 2], tp=2), hcp(16, [2, 2], tp=2), hcp(16, [4, 2], pp=2)]:
        made = []
        monkeypatch.setattr(ps, "create_group", lambda ranks, **kw: made.append(list(ranks)) or tuple(ranks))
        g = rank_groups(layout)
        for cp_group in g["cp"]:
            ps.create_hierarchical_groups(cp_group[0], cp_group, layout.hierarchical_context_parallel_sizes)
        assert sorted(made) == sorted(g["hcp_a2a"] + g["hcp_p2p"])


def test_axis_groups_equal_hyper_comm_grid_membership(monkeypatch):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.hyper_comm_grid import HyperCommGrid

    for ws, tp, pp, cp in LAYOUTS:
        monkeypatch.setenv("WORLD_SIZE", str(ws))  # lets the grid enumerate without processes
        layout = CPLayout(world_size=ws, tp=tp, pp=pp, cp=cp)
        grid = HyperCommGrid([tp, cp, layout.dp, pp], ["tp", "cp", "dp", "pp"])
        mine = rank_groups(layout)
        for kind, token in TOKENS.items():
            theirs = grid.get_rank_enum(token.split("-") if "-" in token else token)
            assert sorted(map(sorted, theirs)) == sorted(map(sorted, mine[kind])), (ws, tp, pp, cp, kind)


# ---------------------------------------------------------------------------------------------
# The a2a+p2p build gate (fake-backend groups: real ProcessGroups over no processes)

def group_of(size):
    """A fake group over global ranks 0..size-1 (this process is rank 0)."""
    return fake_group(range(size))


def pgc(**groups):
    from cpkit.compat import new_pg_collection

    return new_pg_collection(**groups)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "all_gather", ["p2p", "a2a"]])
def test_gate_is_a_no_op_without_a2a_p2p(comm, world1):
    assert require_hierarchical_groups(pgc(cp=group_of(4)), comm) is None
    assert require_hierarchical_groups(None, comm) is None


@pytest.mark.parametrize("comm", ["a2a+p2p", ["p2p", "a2a+p2p"]])
def test_gate_fails_when_hcp_is_missing(comm, world1):
    with pytest.raises(CPConfigError) as info:
        require_hierarchical_groups(pgc(cp=group_of(4)), comm)
    assert [v.field for v in info.value.violations] == ["pg_collection.hcp"]
    assert "build_pg_collection" in info.value.violations[0].fix


def test_gate_fails_without_collection_or_cp(world1):
    with pytest.raises(CPConfigError) as info:
        require_hierarchical_groups(None, "a2a+p2p")
    assert [v.field for v in info.value.violations] == ["pg_collection.cp", "pg_collection.hcp"]


@pytest.mark.parametrize("hcp_value", [
    [group_of(4)],                              # one level
    [group_of(2), group_of(2), group_of(1)],  # three levels
    [group_of(2), None],                        # a level missing
    group_of(4),                                # not a list
])
def test_gate_fails_for_not_two_groups(hcp_value, world1):
    with pytest.raises(CPConfigError, match="exactly two groups"):
        require_hierarchical_groups(pgc(cp=group_of(4), hcp=hcp_value), "a2a+p2p")


@pytest.mark.parametrize("sizes", [(2, 1), (1, 1), (4, 4), (2, 3)])
def test_gate_fails_when_sizes_do_not_multiply_to_cp(sizes, world1):
    with pytest.raises(CPConfigError, match="multiply to the cp group size 4"):
        require_hierarchical_groups(pgc(cp=group_of(4), hcp=[group_of(s) for s in sizes]), "a2a+p2p")


def test_gate_checks_the_configured_sizes(world1):
    groups = pgc(cp=group_of(4), hcp=[group_of(4), group_of(1)])
    with pytest.raises(CPConfigError) as info:
        require_hierarchical_groups(groups, "a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    assert info.value.field == "hierarchical_context_parallel_sizes"


def test_gate_passes_and_returns_the_two_groups(world1):
    a2a, p2p = fake_group([0, 1]), fake_group([0, 2])
    out = require_hierarchical_groups(pgc(cp=group_of(4), hcp=[a2a, p2p]), "a2a+p2p",
                                      hierarchical_context_parallel_sizes=[2, 2])
    assert out == (a2a, p2p)


def test_gate_fails_when_the_a2a_group_is_strided(world1):
    # Sizes fit (2 x 2 = 4) but the levels are swapped: this rank's CP position would not be
    # p2p_rank * a2a_size + a2a_rank, and the chunks it holds would not be the ones a2a+p2p assumes.
    a2a, p2p = fake_group([0, 2]), fake_group([0, 1])
    with pytest.raises(CPConfigError, match="a2a group \\(level 0\\) must be CP positions 0..1"):
        require_hierarchical_groups(pgc(cp=group_of(4), hcp=[a2a, p2p]), "a2a+p2p")


def test_gate_passes_on_a_rank_that_is_not_the_first_of_its_a2a_block(monkeypatch, world1):
    # Seen from global rank 1 of a 2x2 layout: CP position 1, a2a block positions 0..1 (ranks 0, 1),
    # p2p positions 1, 3 (ranks 1, 3).
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    a2a, p2p = fake_group([0, 1], rank=1), fake_group([1, 3], rank=0)
    out = require_hierarchical_groups(pgc(cp=fake_group([0, 1, 2, 3], rank=1), hcp=[a2a, p2p]), "a2a+p2p")
    assert out == (a2a, p2p)
    with pytest.raises(CPConfigError, match="p2p group \\(level 1\\) must be CP positions 1, 1\\+2"):
        require_hierarchical_groups(pgc(cp=fake_group([0, 1, 2, 3], rank=1),
                                        hcp=[a2a, fake_group([0, 1], rank=1)]), "a2a+p2p")

def test_build_pg_collection_validates_the_layout_first(world1):
    from cpkit.parallel.groups import build_pg_collection

    pgc = build_pg_collection(CPLayout(world_size=1))
    assert (pgc.tp.size(), pgc.cp.size(), pgc.dp.size(), pgc.pp.size()) == (1, 1, 1, 1)
    with pytest.raises(CPConfigError, match="world_size"):
        build_pg_collection(CPLayout(world_size=2, cp=2))  # a layout for another world
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        build_pg_collection(CPLayout(world_size=1, cp_comm_type="a2a+p2p"))


# ---------------------------------------------------------------------------------------------
# build_pg_collection and describe_groups at world size 1 (a real gloo group over one process)

_SET_FIELDS = ("tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp", "embd", "pos_embd", "ep",
               "intra_dist_opt", "intra_dp_cp", "expt_dp", "intra_expt_dp", "expt_tp", "tp_ep",
               "tp_ep_pp")


@pytest.mark.parametrize("use_grid", [True, False])
def test_build_pg_collection_sets_every_documented_field(use_grid, world1):
    from cpkit.compat import get_pg
    from cpkit.parallel.group_info import members
    from cpkit.parallel.groups import build_pg_collection

    pgs = build_pg_collection(CPLayout(world_size=1), use_hyper_comm_grid=use_grid)
    assert {f: members(get_pg(pgs, f)) for f in _SET_FIELDS} == {f: (0,) for f in _SET_FIELDS}
    assert get_pg(pgs, "hcp") is None
    hier = build_pg_collection(hcp(1, [1, 1]), use_hyper_comm_grid=use_grid)
    assert members(get_pg(hier, "hcp")) == ((0,), (0,))


def test_the_axis_groups_come_from_hyper_comm_grid_unless_turned_off(monkeypatch, caplog, world1):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    from cpkit.parallel.groups import build_pg_collection

    made = []
    create_pg = HyperCommGrid.create_pg

    def recording(self, dims, **kwargs):
        made.append(tuple(dims))
        return create_pg(self, dims, **kwargs)

    monkeypatch.setattr(HyperCommGrid, "create_pg", recording)
    with caplog.at_level("WARNING", logger="cpkit.parallel.groups"):
        build_pg_collection(CPLayout(world_size=1))
        assert sorted(made) == sorted([("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp"),
                                       ("tp", "cp"), ("cp", "dp"), ("tp", "cp", "dp")])
        made.clear()
        build_pg_collection(CPLayout(world_size=1), use_hyper_comm_grid=False)
        assert made == []
    assert caplog.records == []  # no "groups differ" warning when no grid is asked for


def test_describe_groups_names_every_set_group_and_the_hierarchical_levels(world1):
    from cpkit.parallel.groups import HCP_LOG_PREFIX, build_pg_collection, describe_groups

    lines = describe_groups(build_pg_collection(hcp(1, [1, 1])))
    assert lines == [
        "PROCESS_GROUPS rank=0 world_size=1",
        "tp TENSOR_MODEL_PARALLEL_GROUP ranks=[0]",
        "cp CONTEXT_PARALLEL_GROUP ranks=[0]",
        "dp DATA_PARALLEL_GROUP ranks=[0]",
        "pp PIPELINE_MODEL_PARALLEL_GROUP ranks=[0]",
        "mp MODEL_PARALLEL_GROUP ranks=[0]",
        "tp_cp TENSOR_AND_CONTEXT_PARALLEL_GROUP ranks=[0]",
        "dp_cp DATA_PARALLEL_GROUP_WITH_CP ranks=[0]",
        "tp_dp_cp TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP ranks=[0]",
        "embd EMBEDDING_GROUP ranks=[0]",
        "pos_embd POSITION_EMBEDDING_GROUP ranks=[0]",
        f"{HCP_LOG_PREFIX} a2a=[0] p2p=[0]",
    ]


def test_log_groups_logs_the_lines_at_info_on_rank_0(caplog, world1):
    import logging

    from cpkit.parallel.groups import build_pg_collection, describe_groups, log_groups

    pgs = build_pg_collection(CPLayout(world_size=1))
    log = logging.getLogger("cpkit.test_log_groups")
    with caplog.at_level("INFO", logger=log.name):
        lines = log_groups(pgs, log)
    assert lines == describe_groups(pgs) and len(lines) == 11
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", line) for line in lines]


def test_a_hyper_comm_grid_that_disagrees_is_not_used_and_the_kind_is_logged(monkeypatch, caplog, world1):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    from cpkit.parallel.group_info import members
    from cpkit.parallel.groups import build_pg_collection

    monkeypatch.setattr(HyperCommGrid, "get_rank_enum", lambda self, dims: [[0, 1]])  # not [[0]]
    monkeypatch.setattr(HyperCommGrid, "create_pg", lambda self, dims, **kwargs: pytest.fail("grid used"))
    with caplog.at_level("WARNING", logger="cpkit.parallel.groups"):
        pgs = build_pg_collection(CPLayout(world_size=1))
    assert (members(pgs.tp), members(pgs.cp), members(pgs.dp_cp)) == ((0,), (0,), (0,))
    warned = [r.getMessage().split()[1] for r in caplog.records]
    assert warned == ["tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp"]


def test_log_groups_on_another_rank_logs_nothing_and_returns_an_empty_list(monkeypatch, caplog, world1):
    import torch.distributed as dist

    from cpkit.parallel.groups import build_pg_collection, log_groups

    pgs = build_pg_collection(CPLayout(world_size=1))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with caplog.at_level("INFO", logger="cpkit.parallel.groups"):
        assert log_groups(pgs) == []
    assert caplog.records == []
