"""`cpkit layout check`, run in-process through cpkit.cli.main."""

import json

import pytest

from cpkit.cli import main

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
    errors, _, fixes = err.partition("nearest layouts that pass this check (nearest first):\n")
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
            "--hierarchical-cp-sizes", "2,2"]
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
            "--hierarchical-cp-sizes", "4,1", "--nproc-per-node", "2"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: hierarchical_context_parallel_sizes=[4, 1]: a2a groups span nodes")
    assert "[0, 1, 2, 3] (nodes [0, 1])" in err and "[2, 2]" in err and "--allow-cross-node-a2a" in err
    assert main(argv + ["--allow-cross-node-a2a"]) == 0
    assert "a2a groups spanning nodes (allowed): [0, 1, 2, 3] (nodes [0, 1])" in capsys.readouterr().out


def test_nproc_per_node_prints_groups_per_node_and_crossing_hops(capsys):
    argv = ["layout", "check", "--world-size", "4", "--cp", "4", "--cp-comm-type", "a2a+p2p",
            "--hierarchical-cp-sizes", "2,2", "--nproc-per-node", "2"]
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
