"""Concrete fixes for an invalid layout (src/cpkit/layout_fixes.py::nearest_layouts): every offered
layout passes the same check, nearest first, and `cpkit layout check` prints them as commands."""

import json
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpkit.cli import main
from cpkit.layout import CP_COMM_TYPES, CPLayout
from cpkit.layout_fixes import changed_fields, nearest_layouts

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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts)
def test_every_offered_fix_passes_the_check_and_they_come_nearest_first(layout):
    if layout.num_query_groups is not None and layout.num_attention_heads is None:
        layout.num_query_groups = None
    fixes = nearest_layouts(layout, limit=5)
    for fix in fixes:
        assert fix.violations() == [], (layout, fix)
        assert fix.num_attention_heads == layout.num_attention_heads
        assert fix.num_query_groups == layout.num_query_groups
    counts = [len(changed_fields(layout, f)) for f in fixes if not (layout.cp > 1 and f.cp == 1)]
    assert counts == sorted(counts)
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
