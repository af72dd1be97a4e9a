"""`cpkit layout check`, run in-process through cpkit.cli.main."""

import json
import re
import shlex
from pathlib import Path

import pytest

from cpkit.cli import main

FIXES_HEADER = "layouts that pass this check, best first (your comm type, a real two-level split, the fewest changes):\n"
HCP_8 = ["layout", "check", "--world-size", "8", "--tp", "2", "--cp", "4", "--cp-comm-type", "a2a+p2p",
         "--hierarchical-cp-sizes", "2,2", "--seq-length", "4096", "--num-heads", "8", "--num-kv-heads", "8"]


def test_valid_layout_prints_sizes_and_groups(capsys):
    assert main(HCP_8) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "world_size=8 tp=2 pp=1 cp=4 dp=1" in out
    assert "hierarchical_context_parallel_sizes=[2, 2]" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "[[" in line}
    assert "[[0, 1], [2, 3], [4, 5], [6, 7]]" in lines["tp"]
    assert "[[0, 2, 4, 6], [1, 3, 5, 7]]" in lines["cp"]
    assert "[[0], [1], [2], [3], [4], [5], [6], [7]]" in lines["dp"]
    assert "[[0, 2], [4, 6], [1, 3], [5, 7]]" in lines["hcp_a2a"]
    assert "[[0, 4], [2, 6], [1, 5], [3, 7]]" in lines["hcp_p2p"]


def test_json_report_of_a_valid_layout(capsys):
    assert main(HCP_8 + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is True and report["errors"] == [] and report["dp"] == 1
    assert report["groups"]["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert report["groups"]["hcp_p2p"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert report["layout"]["hierarchical_context_parallel_sizes"] == [2, 2]


def test_invalid_layout_exits_2_with_one_line_per_violation(capsys):
    argv = ["layout", "check", "--world-size", "6", "--tp", "2", "--cp", "4", "--cp-comm-type", "allgather",
            "--hierarchical-cp-sizes", "2,3", "--seq-length", "100"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    errors, _, fixes = err.partition(FIXES_HEADER)
    lines = errors.strip().splitlines()
    assert len(lines) == 4 and fixes.strip().startswith("cpkit layout check --world-size")
    assert all(line.startswith("error: ") for line in lines)
    fields = [line.split()[1].split("=")[0] for line in lines]
    assert fields == ["cp_comm_type", "hierarchical_context_parallel_sizes", "world_size", "seq_length"]
    assert '"all_gather"' in lines[0]


def test_json_report_of_an_invalid_layout(capsys):
    argv = ["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "a2a+p2p", "--json"]
    assert main(argv) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is False and report["groups"] == {} and report["dp"] == 1
    (error,) = report["errors"]
    assert set(error) == {"field", "value", "message"}
    assert error["field"] == "hierarchical_context_parallel_sizes" and error["value"] is None


def test_missing_hierarchical_sizes_names_the_fix(capsys):
    assert main(["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "a2a+p2p"]) == 2
    err = capsys.readouterr().err
    assert "hierarchical_context_parallel_sizes" in err and "[2, 2]" in err


def test_heads_and_sequence_parallel_flags(capsys):
    base = ["layout", "check", "--world-size", "8", "--tp", "4", "--cp", "2", "--seq-length", "36"]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base + ["--sequence-parallel"]) == 2
    assert "tp*cp = 8" in capsys.readouterr().err
    assert main(["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "a2a",
                 "--num-heads", "8", "--num-kv-heads", "2"]) == 2
    assert "num_query_groups=2" in capsys.readouterr().err


def test_per_layer_comm_types(capsys):
    argv = ["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "p2p,a2a+p2p",
            "--hierarchical-cp-sizes", "2,2", "--num-heads", "8", "--num-kv-heads", "2"]
    assert main(argv) == 2
    assert "num_layers" in capsys.readouterr().err
    assert main(argv + ["--num-layers", "2"]) == 0
    assert "hcp_a2a" in capsys.readouterr().out


def test_eval_cp(capsys):
    assert main(HCP_8 + ["--eval-cp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["eval"]["cp"] == 2 and report["eval"]["dp"] == 2
    assert report["eval"]["hierarchical_context_parallel_sizes"] == [2, 1]
    assert report["eval"]["groups"]["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert main(HCP_8 + ["--eval-cp", "3"]) == 2
    assert "eval_context_parallel_size=3" in capsys.readouterr().err


def test_bad_flag_values_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["layout", "check", "--world-size", "4", "--hierarchical-cp-sizes", "2,x"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["layout"])  # the subcommand is required


def test_nproc_per_node_refuses_a2a_over_two_nodes(capsys):
    argv = ["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "a2a+p2p",
            "--hierarchical-cp-sizes", "4,1", "--num-heads", "8", "--num-kv-heads", "4", "--nproc-per-node", "2"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: hierarchical_context_parallel_sizes=[4, 1]: a2a groups span nodes")
    assert "[0, 1, 2, 3] (nodes [0, 1])" in err and "[2, 2]" in err and "--allow-cross-node-a2a" in err
    assert main(argv + ["--allow-cross-node-a2a"]) == 0
    assert "a2a groups spanning nodes (allowed): [0, 1, 2, 3] (nodes [0, 1])" in capsys.readouterr().out


def test_nproc_per_node_prints_groups_per_node_and_crossing_hops(capsys):
    argv = ["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "a2a+p2p",
            "--hierarchical-cp-sizes", "2,2", "--num-heads", "8", "--num-kv-heads", "4", "--nproc-per-node", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "  node 1 (ranks 2-3): cp [[0, 1, 2, 3]]; hcp_a2a [[2, 3]]; hcp_p2p [[0, 2], [1, 3]]" in out
    assert "  p2p ring hops crossing nodes: 0->2, 2->0, 1->3, 3->1" in out
    assert main(argv + ["--json"]) == 0
    topology = json.loads(capsys.readouterr().out)["topology"]
    assert topology["cross_node_p2p_hops"] == [[0, 2], [2, 0], [1, 3], [3, 1]]


def test_nproc_per_node_lists_the_cross_node_a2a_next_to_the_head_violations(capsys):
    # 16 KV heads over an a2a group of 32 and that group over 4 nodes: both at once, each with a fix.
    argv = ["layout", "check", "--world-size", "32", "--cp", "32", "--cp-comm-type", "a2a+p2p",
            "--hierarchical-cp-sizes", "32,1", "--num-heads", "32", "--num-kv-heads", "16", "--nproc-per-node", "8"]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, errors
    assert errors[0].startswith("error: num_query_groups=16: all-to-all scatters heads")
    assert errors[1].startswith("error: hierarchical_context_parallel_sizes=[32, 1]: a2a groups span nodes")
    assert "fix: hierarchical_context_parallel_sizes=[8, 4]" in errors[1]
    assert main(argv + ["--json"]) == 2
    assert len(json.loads(capsys.readouterr().out)["errors"]) == 2


def test_nproc_per_node_that_does_not_divide_the_world_is_listed_with_the_rest(capsys):
    argv = ["layout", "check", "--world-size", "12", "--cp", "12", "--cp-comm-type", "a2a",
            "--num-heads", "8", "--nproc-per-node", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads=8: all-to-all" in err and "nproc_per_node=8: must divide world_size=12" in err


def test_all_gather_over_nodes_names_its_spanning_groups_not_an_empty_ring(capsys):
    argv = ["layout", "check", "--world-size", "32", "--tp", "8", "--cp", "4", "--cp-comm-type", "all_gather",
            "--nproc-per-node", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "p2p ring hops crossing nodes" not in out
    assert "  all_gather groups spanning nodes: [0, 8, 16, 24] (nodes [0, 1, 2, 3]), [1, 9, 17, 25]" in out


# The README's cluster example before head counts were required: a2a+p2p [4, 2] at tp 2 on 2 nodes.
NO_HEADS = ["layout", "check", "--world-size", "16", "--tp", "2", "--cp", "8", "--cp-comm-type", "a2a+p2p",
            "--hierarchical-cp-sizes", "4,2", "--nproc-per-node", "8"]


def test_a2a_p2p_without_head_counts_exits_2_naming_the_rules_and_the_flags(capsys):
    assert main(NO_HEADS) == 2
    out, err = capsys.readouterr()
    assert out == "" and "valid layout" not in err
    errors = err.strip().splitlines()
    assert [line.split(":")[0] for line in errors] == ["error", "error"], err
    assert errors[0].startswith("error: num_attention_heads=None: not given, so the all-to-all head rule could not run: "
                                "num_attention_heads/tp must be divisible by the a2a size 4 (a2a level)")
    assert errors[1].startswith("error: num_query_groups=None: not given")
    assert "num_query_groups/tp must be divisible by the a2a size 4" in errors[1]
    assert all("--num-heads N --num-kv-heads K" in line and "--no-heads" in line for line in errors)
    # The user's own counts: 28 heads, 4 KV heads do not divide over 4 at tp 2; 32 and 8 do.
    assert main(NO_HEADS + ["--num-heads", "28", "--num-kv-heads", "4"]) == 2
    assert "num_query_groups/tp = 2 must be divisible by the a2a size 4" in capsys.readouterr().err
    assert main(NO_HEADS + ["--num-heads", "32", "--num-kv-heads", "8"]) == 0
    assert capsys.readouterr().out.startswith("valid layout\n")


def test_no_heads_accepts_the_layout_and_still_lists_what_was_not_checked(capsys):
    assert main(NO_HEADS + ["--no-heads"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == "valid layout (4 head rule(s) not checked, listed below)"
    start = lines.index("not checked (no --num-heads --num-kv-heads; pass the model's counts to check them):")
    assert lines[start + 1:start + 5] == [
        "  num_attention_heads must be divisible by tp = 2",
        "  num_attention_heads/tp must be divisible by the a2a size 4 (a2a level)",
        "  num_query_groups must be divisible by tp = 2",
        "  num_query_groups/tp must be divisible by the a2a size 4 (a2a level)"]
    assert main(NO_HEADS + ["--no-heads", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is True
    assert [(r["field"], r["all_to_all"]) for r in report["unchecked"]] == [
        ("num_attention_heads", False), ("num_attention_heads", True),
        ("num_query_groups", False), ("num_query_groups", True)]


def test_kv_heads_missing_is_refused_for_a2a_because_gqa_fails_there_first(capsys):
    # 32 heads divide over cp 8 at tp 1; a GQA model's 4 KV heads would not.
    argv = ["layout", "check", "--world-size", "8", "--cp", "8", "--cp-comm-type", "a2a", "--num-heads", "32"]
    assert main(argv) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: num_query_groups=None: not given")
    assert main(argv + ["--num-kv-heads", "32"]) == 0
    capsys.readouterr()
    assert main(argv + ["--num-kv-heads", "4"]) == 2


@pytest.mark.parametrize("flags, not_checked", [
    (["--cp-comm-type", "p2p"], []),
    (["--cp-comm-type", "all_gather"], []),
    (["--cp-comm-type", "p2p", "--tp", "2"], ["num_attention_heads must be divisible by tp = 2",
                                             "num_query_groups must be divisible by tp = 2"]),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "1,4"], []),  # an a2a level of 1: no all-to-all
])
def test_layouts_without_an_all_to_all_pass_without_heads(flags, not_checked, capsys):
    assert main(["layout", "check", "--world-size", "8", "--cp", "4", *flags]) == 0
    out = capsys.readouterr().out
    assert out.startswith("valid layout (2 head rule(s)" if not_checked else "valid layout\n")
    assert all(f"  {rule}\n" in out for rule in not_checked)
    assert ("not checked" in out) == bool(not_checked)


def test_no_heads_with_both_counts_given_is_refused_and_its_fix_passes(capsys):
    argv = NO_HEADS + ["--num-heads", "32", "--num-kv-heads", "8"]
    assert main(argv + ["--no-heads"]) == 2
    assert capsys.readouterr().err.strip() == ("error: no_heads=True: both head counts are given, so no head rule "
                                               "is left unchecked; fix: drop --no-heads")
    assert main(argv) == 0
    capsys.readouterr()


def test_fixes_offered_without_head_counts_pass_the_same_check(capsys):
    argv = NO_HEADS[:-2] + ["--hierarchical-cp-sizes", "4,3", "--nproc-per-node", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: hierarchical_context_parallel_sizes=[4, 3]" in err and "error: num_attention_heads=None" in err
    fixes = [shlex.split(line.strip())[1:] for line in err.splitlines() if line.startswith("  cpkit layout check")]
    assert fixes and all(f[-1] == "--no-heads" for f in fixes)  # a2a+p2p fixes: their head rules are unchecked
    assert fixes[0][fixes[0].index("--hierarchical-cp-sizes") + 1] == "4,2"  # the a2a level asked for, kept
    for argv in fixes:
        assert main(argv) == 0, argv
    capsys.readouterr()


def _documented_checks() -> list[tuple[str, str]]:
    """(file, command) of every complete `cpkit layout check` line in the README and the skills
    (ones with `...` or a placeholder are templates, not commands)."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in [root / "README.md", *sorted(root.glob("skills/*/SKILL.md"))]:
        for command in re.findall(r"cpkit layout check [^`\n#]*", path.read_text(encoding="utf-8")):
            if "..." not in command and "<" not in command and re.search(r"--world-size \d", command):
                found.append((path.relative_to(root).as_posix(), command.strip()))
    return found


@pytest.mark.parametrize("where, command", _documented_checks())
def test_every_layout_check_the_docs_show_passes(where, command, capsys):
    """A command a reader copies passes as printed, head counts included where an a2a rule needs them."""
    assert main(shlex.split(command)[1:]) == 0, (where, command, capsys.readouterr().err)
    capsys.readouterr()


def test_the_docs_show_layout_checks():
    assert len(_documented_checks()) >= 6
