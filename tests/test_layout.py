"""CPLayout validation: every constraint, good and bad layouts, every violation listed at once."""

import pytest

from cpkit.errors import CPConfigError
from cpkit.parallel.layout import CP_COMM_TYPES, CPLayout, validate_layout

LAYOUT_FIELDS = {
    "world_size", "tp", "pp", "cp", "cp_comm_type", "hierarchical_context_parallel_sizes",
    "seq_length", "num_layers", "num_attention_heads", "num_query_groups", "sequence_parallel",
    "eval_context_parallel_size",
}


def violations(**fields):
    """(field, value) of every violation of CPLayout(**fields)."""
    with pytest.raises(CPConfigError) as info:
        CPLayout(**fields).validate()
    found = info.value.violations
    assert all(v.field in LAYOUT_FIELDS for v in found), [v.field for v in found]
    return found


def fields_of(**fields):
    return sorted(v.field for v in violations(**fields))


GOOD = [
    dict(),
    dict(world_size=8, tp=2, pp=2, cp=2, seq_length=4096),
    dict(world_size=8, tp=2, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
         seq_length=4096, num_attention_heads=8, num_query_groups=8),
    dict(world_size=4, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1],
         num_attention_heads=4),
    dict(world_size=4, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[1, 4],
         num_attention_heads=2, num_query_groups=1),  # heads below cp: only the a2a level counts
    dict(world_size=16, tp=2, cp=4, cp_comm_type="a2a", seq_length=8192, num_attention_heads=16,
         num_query_groups=8, sequence_parallel=True),
    dict(world_size=4, cp=2, cp_comm_type=["p2p", "a2a", "all_gather"], num_layers=3),
    dict(world_size=8, cp=4, seq_length=4096, eval_context_parallel_size=8),
    dict(world_size=8, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
         num_attention_heads=2, eval_context_parallel_size=1),
    dict(world_size=2, cp=1, seq_length=7),  # cp=1: no sequence rule
    dict(world_size=2, tp=1, seq_length=7, sequence_parallel=True),  # sp is a no-op at tp=1
]


@pytest.mark.parametrize("fields", GOOD, ids=range(len(GOOD)))
def test_good_layouts_validate(fields):
    layout = CPLayout(**fields)
    assert layout.validate() is layout
    assert layout.is_valid()
    assert validate_layout(**fields) == layout


def test_dp_is_derived():
    assert CPLayout(world_size=16, tp=2, pp=2, cp=2).dp == 2
    assert CPLayout(world_size=8, tp=2, cp=4).dp == 1
    assert CPLayout(world_size=8, tp=0).dp == 0  # invalid sizes give 0, not ZeroDivisionError


@pytest.mark.parametrize("name", ["world_size", "tp", "pp", "cp"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_core_sizes_must_be_positive_integers(name, bad):
    found = violations(**{name: bad})
    assert [v.field for v in found] == [name]
    assert found[0].value == bad


@pytest.mark.parametrize("name", ["seq_length", "num_layers", "num_attention_heads", "num_query_groups",
                                  "eval_context_parallel_size"])
def test_optional_sizes_must_be_positive(name):
    assert fields_of(**{name: 0}) == [name]


def test_world_size_divisible_by_tp_pp_cp():
    (v,) = violations(world_size=12, tp=2, pp=2, cp=2)
    assert (v.field, v.value) == ("world_size", 12)
    assert "tp*pp*cp = 2*2*2 = 8" in v.message and "16" in v.fix


@pytest.mark.parametrize("comm", CP_COMM_TYPES)
def test_every_comm_type_is_accepted(comm):
    hier = [2, 2] if comm == "a2a+p2p" else None
    CPLayout(world_size=4, cp=4, cp_comm_type=comm, hierarchical_context_parallel_sizes=hier).validate()


def test_allgather_is_rejected_with_the_right_spelling():
    (v,) = violations(world_size=2, cp=2, cp_comm_type="allgather")
    assert v.field == "cp_comm_type" and v.value == "allgather"
    assert '"all_gather"' in v.fix


@pytest.mark.parametrize("bad", ["ring", "nccl", "", None, [], 3])
def test_unknown_comm_type(bad):
    assert fields_of(world_size=2, cp=2, cp_comm_type=bad) == ["cp_comm_type"]


def test_per_layer_list_needs_num_layers_entries_each_valid():
    found = violations(world_size=2, cp=2, cp_comm_type=["p2p", "allgather", "a2a"], num_layers=2)
    assert [v.field for v in found] == ["cp_comm_type", "cp_comm_type"]
    assert "num_layers = 2 entries, got 3" in found[0].message
    assert "(layer 1)" in found[1].message
    assert fields_of(world_size=2, cp=2, cp_comm_type=["p2p", "a2a"]) == ["num_layers"]


def test_a2a_p2p_needs_hierarchical_sizes():
    (v,) = violations(world_size=4, cp=4, cp_comm_type="a2a+p2p")
    assert v.field == "hierarchical_context_parallel_sizes" and v.value is None
    assert "[2, 2]" in v.fix  # suggests the factorizations of cp


@pytest.mark.parametrize("hier", [[2, 3], [4, 4], [1, 1]])
def test_hierarchical_product_must_equal_cp(hier):
    (v,) = violations(world_size=4, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=hier)
    assert v.field == "hierarchical_context_parallel_sizes" and v.value == hier
    assert "must equal cp = 4" in v.message


@pytest.mark.parametrize("hier", [[4], [2, 2, 1], [0, 4], "2,2"])
def test_hierarchical_needs_two_positive_levels(hier):
    assert fields_of(world_size=4, cp=4, cp_comm_type="a2a+p2p",
                     hierarchical_context_parallel_sizes=hier) == ["hierarchical_context_parallel_sizes"]


@pytest.mark.parametrize("comm", ["p2p", "a2a", "all_gather", ["p2p", "a2a"]])
def test_hierarchical_sizes_without_a2a_p2p_are_an_error(comm):
    (v,) = violations(world_size=4, cp=4, cp_comm_type=comm, num_layers=2,
                      hierarchical_context_parallel_sizes=[2, 2])
    assert v.field == "hierarchical_context_parallel_sizes"


def test_per_layer_list_with_a2a_p2p_needs_sizes_too():
    assert fields_of(world_size=4, cp=4, cp_comm_type=["p2p", "a2a+p2p"], num_layers=2) == [
        "hierarchical_context_parallel_sizes"]
    CPLayout(world_size=4, cp=4, cp_comm_type=["p2p", "a2a+p2p"], num_layers=2,
             hierarchical_context_parallel_sizes=[2, 2]).validate()


def test_seq_length_divisible_by_2cp():
    (v,) = violations(world_size=4, cp=4, seq_length=4100)
    assert (v.field, v.value) == ("seq_length", 4100)
    assert "2*cp = 8" in v.message and "4104" in v.fix
    CPLayout(world_size=4, cp=4, seq_length=4104).validate()


def test_sequence_parallel_needs_seq_divisible_by_tp_cp():
    # 2*cp = 4 divides 36 but tp*cp = 8 does not
    (v,) = violations(world_size=8, tp=4, cp=2, seq_length=36, sequence_parallel=True)
    assert v.field == "seq_length" and "tp*cp = 8" in v.message
    CPLayout(world_size=8, tp=4, cp=2, seq_length=36).validate()  # fine without sp
    # both rules can fail together, each reported
    assert fields_of(world_size=8, tp=4, cp=2, seq_length=6, sequence_parallel=True) == ["seq_length"] * 2


def test_heads_and_query_groups_divisible_by_tp():
    found = violations(world_size=4, tp=4, num_attention_heads=6, num_query_groups=2)
    assert [(v.field, v.value) for v in found] == [("num_attention_heads", 6), ("num_query_groups", 2)]


def test_a2a_heads_divisible_by_cp():
    found = violations(world_size=4, cp=4, cp_comm_type="a2a", num_attention_heads=6, num_query_groups=2)
    assert [(v.field, v.value) for v in found] == [("num_attention_heads", 6), ("num_query_groups", 2)]
    # p2p and all_gather do not split heads
    CPLayout(world_size=4, cp=4, cp_comm_type="p2p", num_attention_heads=6, num_query_groups=2).validate()


def test_a2a_heads_per_tp_rank_divisible_by_cp():
    # 8 heads over tp=2 leaves 4 per TP rank: a2a over cp=4 works, over cp=8 not
    CPLayout(world_size=8, tp=2, cp=4, cp_comm_type="a2a", num_attention_heads=8).validate()
    (v,) = violations(world_size=16, tp=2, cp=8, cp_comm_type="a2a", num_attention_heads=8)
    assert v.field == "num_attention_heads" and "num_attention_heads/tp = 4" in v.message


def test_a2a_p2p_heads_divisible_by_the_a2a_level_only():
    base = dict(world_size=8, cp=8, cp_comm_type="a2a+p2p", num_attention_heads=4, num_query_groups=2)
    CPLayout(**base, hierarchical_context_parallel_sizes=[2, 4]).validate()
    found = violations(**base, hierarchical_context_parallel_sizes=[4, 2])
    assert [v.field for v in found] == ["num_query_groups"]
    assert "a2a size 4" in found[0].message


def test_eval_cp_world_size_divisible():
    (v,) = violations(world_size=8, tp=2, cp=2, eval_context_parallel_size=3)
    assert (v.field, v.value) == ("eval_context_parallel_size", 3)


def test_eval_cp_sequence_and_head_rules():
    # valid at cp=2, not at eval cp=4: seq 12 % 8 and heads 2 % 4
    found = violations(world_size=4, cp=2, cp_comm_type="a2a", seq_length=12, num_attention_heads=2,
                       eval_context_parallel_size=4)
    assert [v.field for v in found] == ["eval_context_parallel_size"] * 2
    assert "seq_length=12" in found[0].message and "2*cp = 8" in found[0].message
    assert "a2a size 4" in found[1].message
    CPLayout(world_size=4, cp=2, cp_comm_type="a2a", seq_length=12, num_attention_heads=2,
             eval_context_parallel_size=1).validate()


def test_every_violation_is_listed_at_once():
    found = violations(world_size=6, tp=2, cp=4, cp_comm_type=["allgather", "a2a+p2p"],
                       hierarchical_context_parallel_sizes=[2, 3], seq_length=100, num_attention_heads=6,
                       sequence_parallel=True, eval_context_parallel_size=3)
    assert sorted({v.field for v in found}) == sorted([
        "num_layers", "cp_comm_type", "hierarchical_context_parallel_sizes", "world_size", "seq_length",
        "num_attention_heads", "eval_context_parallel_size"])
    err = CPConfigError(found)
    assert str(err).startswith(f"{len(found)} CP configuration errors")
    assert all(v.to_dict()["field"] in LAYOUT_FIELDS for v in found)


def test_error_is_a_value_error_with_fix():
    with pytest.raises(ValueError, match="fix: "):
        CPLayout(world_size=3, cp=2).validate()


def test_with_cp_keeps_the_job_and_moves_dp():
    layout = CPLayout(world_size=8, tp=2, cp=4, seq_length=4096, eval_context_parallel_size=2)
    ev = layout.with_cp(2)
    assert (ev.cp, ev.dp, ev.tp, ev.world_size, ev.eval_context_parallel_size) == (2, 2, 2, 8, None)
    assert layout.eval_layout() == ev
    assert CPLayout(world_size=4, cp=4).eval_layout().cp == 4


@pytest.mark.parametrize("hier,new_cp,expected", [
    ([2, 2], 2, [2, 1]), ([2, 2], 8, [2, 4]), ([4, 1], 2, [2, 1]), ([1, 4], 2, [1, 2]), ([2, 2], 1, [1, 1]),
])
def test_with_cp_rescales_hierarchical_sizes(hier, new_cp, expected):
    layout = CPLayout(world_size=8, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=hier)
    ev = layout.with_cp(new_cp)
    assert ev.hierarchical_context_parallel_sizes == expected
    ev.validate()


def test_from_transformer_config():
    from megatron.core.transformer import TransformerConfig

    # MCore accepts a2a+p2p with sizes whose product is not cp; CPLayout does not.
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               context_parallel_size=4, cp_comm_type="a2a+p2p",
                               hierarchical_context_parallel_sizes=[2, 3])
    layout = CPLayout.from_transformer_config(config, 4, seq_length=4096)
    assert (layout.world_size, layout.tp, layout.pp, layout.cp) == (4, 1, 1, 4)
    assert (layout.num_layers, layout.num_attention_heads, layout.num_query_groups) == (2, 8, 2)
    assert layout.cp_comm_type == "a2a+p2p" and layout.seq_length == 4096
    assert [v.field for v in layout.violations()] == ["hierarchical_context_parallel_sizes"]

    plain = CPLayout.from_transformer_config(
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8), 2, eval_context_parallel_size=2)
    assert plain.cp_comm_type == "p2p"  # MCore's None means p2p
    assert plain.num_query_groups == 8 and plain.dp == 2 and plain.eval_context_parallel_size == 2
    plain.validate()


def test_hierarchical_hint_lists_every_factor_pair_of_cp():
    (v,) = violations(world_size=4, cp=4, cp_comm_type="a2a+p2p")
    assert "e.g. one of [[1, 4], [2, 2], [4, 1]]" in v.fix
    (v,) = violations(world_size=6, cp=6, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    assert "[[1, 6], [2, 3], [3, 2], [6, 1]]" in v.fix


def test_a2a_head_violation_names_the_level_it_scatters_over():
    (v,) = violations(world_size=4, cp=4, cp_comm_type="a2a", num_attention_heads=6)
    assert (v.field, v.value) == ("num_attention_heads", 6)
    assert v.constraint.endswith("divisible by the a2a size 4 (cp)")
    (v,) = violations(world_size=8, cp=8, cp_comm_type="a2a+p2p", num_attention_heads=2,
                      hierarchical_context_parallel_sizes=[4, 2])
    assert (v.field, v.value) == ("num_attention_heads", 2)
    assert v.constraint.endswith("divisible by the a2a size 4 (a2a level)")


def test_eval_a2a_head_violation_is_reported_under_the_eval_size():
    found = violations(world_size=4, cp=2, cp_comm_type="a2a", num_attention_heads=2, eval_context_parallel_size=4)
    assert [(v.field, v.value) for v in found] == [("eval_context_parallel_size", 4)]
    assert found[0].constraint.startswith("at eval_context_parallel_size=4: all-to-all scatters heads")


# ---------------------------------------------------------------------------------------------
# What violations() cannot check without head counts (src/cpkit/hierarchical/head_rules.py)

HEADLESS = [
    dict(cp=4, cp_comm_type="p2p"),
    dict(cp=4, tp=2, cp_comm_type="all_gather"),
    dict(cp=4, cp_comm_type="a2a"),
    dict(cp=4, tp=2, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
    dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[1, 4]),
    dict(cp=2, cp_comm_type="a2a", eval_context_parallel_size=4),
    dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 1], eval_context_parallel_size=2),
]


@pytest.mark.parametrize("fields", HEADLESS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_unchecked_head_rules_are_the_ones_that_fire_on_bad_counts(fields):
    """Counts of tp pass the tp rule and leave one head per TP rank, which every all-to-all rule
    (a2a size > 1) refuses: the all-to-all rules listed as unchecked are exactly those."""
    from cpkit.hierarchical.head_rules import unchecked_head_rules

    layout = CPLayout(world_size=16, **fields)
    assert layout.is_valid()
    unchecked = unchecked_head_rules(layout)
    tp = layout.tp
    assert [r.rule for r in unchecked if not r.all_to_all] == (
        [f"{f} must be divisible by tp = {tp}" for f in ("num_attention_heads", "num_query_groups")] if tp > 1 else [])
    fired = CPLayout(world_size=16, num_attention_heads=tp, num_query_groups=tp, **fields).violations()
    assert len(fired) == len([r for r in unchecked if r.all_to_all]), (fired, unchecked)
    assert unchecked_head_rules(CPLayout(world_size=16, num_attention_heads=64, num_query_groups=64, **fields)) == []
    only_heads = unchecked_head_rules(CPLayout(world_size=16, num_attention_heads=64, **fields))
    assert {r.field for r in only_heads} <= {"num_query_groups"}
