"""Concrete fixes for an invalid layout (src/cpkit/hierarchical/layout_fixes.py::nearest_layouts): every offered
layout passes the same check, nearest first, and `cpkit layout check` prints them as commands."""

import json
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpkit.cli import main
from cpkit.parallel.layout import COMM_TYPE_SPELLING_HINTS, CP_COMM_TYPES, CPLayout
from cpkit.hierarchical.layout_fixes import changed_fields, describe_change, nearest_layouts, offer_reason

ISSUE = ["layout", "check", "--world-size", "6", "--cp", "3", "--seq-length", "4096", "--num-heads", "12",
         "--num-kv-heads", "4", "--cp-comm-type", "a2a"]


def _fixes_from_stderr(err: str) -> list[list[str]]:
    """The argv of each `cpkit layout check ...` line the check printed as a fix."""
    return [shlex.split(line.strip())[1:] for line in err.splitlines() if line.strip().startswith("cpkit layout check")]


def test_cp_3_with_4_kv_heads_on_a2a_is_offered_cp_2_first(capsys):
    assert main(ISSUE) == 2
    fixes = _fixes_from_stderr(capsys.readouterr().err)
    assert fixes, "no concrete fix offered"
    first = fixes[0]
    assert first[first.index("--cp") + 1] == "2" and first[first.index("--cp-comm-type") + 1] == "a2a"
    assert first[first.index("--seq-length") + 1] == "4096"  # nothing else changed
    for argv in fixes:  # each printed command passes the check itself
        assert main(argv) == 0, argv
    capsys.readouterr()


def test_the_json_report_carries_the_fixes(capsys):
    assert main(ISSUE + ["--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    first = report["fixes"][0]
    assert first["changed"] == "cp 3 -> 2" and first["layout"]["cp"] == 2
    fields = {k: v for k, v in first["layout"].items() if k != "dp"}
    assert CPLayout(**fields).is_valid()


def test_fixes_respect_the_node_placement(capsys):
    argv = ["layout", "check", "--world-size", "8", "--cp", "8", "--cp-comm-type", "a2a", "--num-heads", "8",
            "--nproc-per-node", "4"]
    assert main(argv) == 2
    fixes = _fixes_from_stderr(capsys.readouterr().err)
    assert fixes and all("--nproc-per-node" in f for f in fixes)
    for f in fixes:
        assert main(f) == 0, f
    capsys.readouterr()


def test_a_valid_layout_needs_no_fix():
    assert nearest_layouts(CPLayout(world_size=8, cp=4, seq_length=4096)) == []


def test_heads_are_never_changed_and_cp_above_1_is_kept_where_it_can_be():
    layout = CPLayout(world_size=8, cp=8, cp_comm_type="a2a", num_attention_heads=12, num_query_groups=4,
                      seq_length=8192)
    fixes = nearest_layouts(layout, limit=10)
    assert fixes and all(f.num_attention_heads == 12 and f.num_query_groups == 4 for f in fixes)
    assert fixes[0].cp > 1 and fixes[0].cp_comm_type == "a2a" and fixes[0].cp == 4


layouts = st.builds(
    CPLayout,
    world_size=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
    tp=st.sampled_from([1, 2, 3, 4]),
    pp=st.sampled_from([1, 2]),
    cp=st.sampled_from([1, 2, 3, 4, 6, 8]),
    cp_comm_type=st.sampled_from(list(CP_COMM_TYPES) + ["ring"]),
    hierarchical_context_parallel_sizes=st.sampled_from([None, [2, 2], [1, 4], [2, 3], [4, 2]]),
    seq_length=st.sampled_from([None, 100, 4096, 4098, 8192]),
    num_attention_heads=st.sampled_from([None, 8, 12, 32]),
    num_query_groups=st.sampled_from([None, 1, 4, 8]),
    sequence_parallel=st.booleans(),
    eval_context_parallel_size=st.sampled_from([None, 1, 2, 3, 8]),
)


def _degenerate(layout: CPLayout) -> bool:
    return 1 in (layout.hierarchical_context_parallel_sizes or [])


def _preference(before: CPLayout, after: CPLayout) -> int:
    """The skills' order of fixes: 0 the user's comm type (a known misspelling read as meant), 1
    another comm type, 2 hierarchical sizes newly given a level of 1 (the plain type, renamed)."""
    if _degenerate(after) and not _degenerate(before):
        return 2
    meant = COMM_TYPE_SPELLING_HINTS.get(before.cp_comm_type, before.cp_comm_type)
    return 0 if after.cp_comm_type == meant else 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts)
def test_every_offered_fix_passes_the_check_and_they_come_in_the_skills_order(layout):
    if layout.num_query_groups is not None and layout.num_attention_heads is None:
        layout.num_query_groups = None
    fixes = nearest_layouts(layout, limit=5)
    for fix in fixes:
        assert fix.violations() == [], (layout, fix)
        assert fix.num_attention_heads == layout.num_attention_heads
        assert fix.num_query_groups == layout.num_query_groups
    ranks = [(layout.cp > 1 and f.cp == 1, _preference(layout, f), len(changed_fields(layout, f))) for f in fixes]
    assert ranks == sorted(ranks), (layout, fixes)
    if layout.is_valid():
        assert fixes == []


def test_a_hierarchical_fix_with_a_level_of_one_comes_after_a_real_two_level_split():
    """[1, 8] is plain p2p under another name (never faster, the skill says): with 28 heads and 4
    KV heads at tp 2, [2, 4] is the fix to offer first, and [1, 8] only after it."""
    layout = CPLayout(world_size=16, tp=2, cp=8, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 2],
                      num_attention_heads=28, num_query_groups=4)
    offered = [c.hierarchical_context_parallel_sizes for c in nearest_layouts(layout, limit=5)]
    assert offered[0] == [2, 4], offered
    assert [1, 8] not in offered or offered.index([1, 8]) > offered.index([2, 4]), offered


# The user's layout of the issue: 28 heads and 4 KV heads at tp 2 do not divide over an a2a level of 4.
USERS = ["layout", "check", "--world-size", "16", "--tp", "2", "--cp", "8", "--cp-comm-type", "a2a+p2p",
         "--hierarchical-cp-sizes", "4,2", "--num-heads", "28", "--num-kv-heads", "4", "--nproc-per-node", "8"]


def test_each_offered_layout_says_why_it_is_offered(capsys):
    assert main(USERS) == 2
    lines = capsys.readouterr().err.splitlines()
    commands = [i for i, line in enumerate(lines) if line.startswith("  cpkit layout check")]
    assert len(commands) == 3
    for i in commands:
        assert lines[i + 1].startswith("      changes: ") and lines[i + 2].startswith("      why: "), lines[i:i + 3]
    assert lines[commands[0] + 2] == ("      why: same comm type (a2a+p2p); a real two-level split [2, 4]; heads divide "
                                      "the a2a size 2 (num_attention_heads/tp = 14, num_query_groups/tp = 2)")
    assert main(USERS + ["--json"]) == 2
    fixes = json.loads(capsys.readouterr().out)["fixes"]
    assert [f["why"].split(";")[0] for f in fixes] == ["same comm type (a2a+p2p)"] * 3


def test_the_users_comm_type_comes_before_another_even_with_more_changes():
    """a2a at cp 8 with the eval at cp 8 keeps a2a by changing two fields (cp and eval cp); all_gather
    or p2p would change one. The skill's order offers the user's comm type first."""
    layout = CPLayout(world_size=16, tp=2, cp=8, cp_comm_type="a2a", num_attention_heads=28, num_query_groups=4,
                      eval_context_parallel_size=8)
    fixes = nearest_layouts(layout, limit=50)
    comms = [f.cp_comm_type for f in fixes]
    assert comms[0] == "a2a" and changed_fields(layout, fixes[0]) == ["cp", "eval_context_parallel_size"], comms
    assert comms.index("all_gather") > max(i for i, c in enumerate(comms) if c == "a2a"), comms
    assert offer_reason(layout, fixes[0]).startswith("same comm type (a2a); heads divide the a2a size 2")
    other = next(f for f in fixes if f.cp_comm_type == "p2p")
    assert offer_reason(layout, other) == "another comm type (p2p, not a2a); no all-to-all, so no head rule"


def test_a_misspelled_comm_type_is_read_as_meant():
    layout = CPLayout(world_size=8, cp=4, cp_comm_type="allgather", seq_length=4096)
    first = nearest_layouts(layout)[0]
    assert first.cp_comm_type == "all_gather"
    assert offer_reason(layout, first) == "your comm type, spelled as MCore and TE spell it (all_gather)"


def test_the_plain_comm_type_comes_before_a_split_with_a_level_of_one():
    """[1, 8] is p2p through the hierarchical path, never faster than p2p: p2p is offered first."""
    layout = CPLayout(world_size=16, tp=2, cp=8, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4, 2],
                      num_attention_heads=28, num_query_groups=4)
    fixes = nearest_layouts(layout, limit=50)
    degenerate = next(i for i, f in enumerate(fixes) if f.hierarchical_context_parallel_sizes == [1, 8])
    plain = next(i for i, f in enumerate(fixes) if f.cp_comm_type == "p2p" and f.tp == 2)
    assert plain < degenerate, [describe_change(layout, f) for f in fixes]
    assert offer_reason(layout, fixes[degenerate]) == (
        "same comm type (a2a+p2p); a degenerate split [1, 8]: plain p2p through the hierarchical path, "
        "never faster than p2p; no all-to-all, so no head rule")
