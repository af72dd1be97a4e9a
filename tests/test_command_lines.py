"""The command lines beside `cpkit`: the benchmark launcher's help and errors, the timeline reader,
the units and hints the tables print, and no parser that accepts an abbreviated flag."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cpkit.bench.__main__ import BENCHMARKS, describe
from cpkit.bench.__main__ import main as bench_main
from cpkit.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


def test_bench_help_lists_every_benchmark_with_its_description(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert describe(name) and describe(name) in line


def test_a_misspelled_benchmark_is_an_invalid_choice(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["atention"])
    assert info.value.code == 2
    assert "invalid choice: 'atention'" in capsys.readouterr().err


def test_timeline_of_a_missing_file_is_a_usage_error(tmp_path, capsys):
    from cpkit.bench.timeline import main as timeline_main

    with pytest.raises(SystemExit) as info:
        timeline_main([str(tmp_path / "missing.trace.json")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "missing.trace.json: No such file or directory" in err and "Traceback" not in err


def test_timeline_reads_a_trace_file_and_prints_its_split(tmp_path, capsys):
    import json

    from cpkit.bench.timeline import main as timeline_main

    trace = tmp_path / "attn.p2p.rank0.trace.json"  # compute 0-100 us, NCCL 50-130 us: 30 us exposed
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "flash_fwd", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 50, "dur": 80}]}))
    assert timeline_main([str(trace)]) == 0
    assert capsys.readouterr().out == (f"{trace}: span 0.13 ms: compute 0.10, exposed comm 0.03, idle 0.00 "
                                       "(comm kernels 0.08 in all, 2 kernels)\n")


def test_the_attention_table_says_per_rank_on_cpu_and_per_gpu_on_cuda():
    from cpkit.bench.attention.attention import render

    cell = {"backend": "cpkit", "comm": "p2p", "kv_heads": 2, "cp": 2, "seq": 64, "error": None,
            "tflops_per_gpu": 0.01}
    assert "TFLOP/s per rank" in render([cell], [64], "cpu") and "per GPU" not in render([cell], [64], "cpu")
    assert "TFLOP/s per GPU" in render([cell], [64], "cuda")


def test_the_plot_hint_fits_a_checkout():
    from cpkit.bench.common import PLOT_SKIPPED

    assert "pip install matplotlib" in PLOT_SKIPPED and "cpkit[plot]" not in PLOT_SKIPPED


def test_eval_cp_plan_names_the_unit_of_its_time(capsys):
    assert main(["plan", "eval-cp", "--world-size", "16", "--tp", "2", "--pp", "2", "--cp-train", "1",
                 "--cp-eval", "2", "--eval-samples", "64", "--micro-batch-size", "1", "--seq-length", "4096"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layout"))
    assert "est. time (model units)" in header


def test_cards_status_upstream_of_a_missing_path_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "no-bridge"
    assert main(["cards", "status", "--upstream", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--upstream {missing}: no such file or folder" in err


def test_an_abbreviated_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["layout", "check", "--world-size", "8", "--cp", "2", "--seq-len", "4096"])
    assert info.value.code == 2
    assert "unrecognized arguments: --seq-len" in capsys.readouterr().err


def _parser_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            subparser = name == "add_parser" and node.args and isinstance(node.args[0], ast.Constant)
            if name == "ArgumentParser" or subparser:  # not a command module's add_parser(sub)
                yield node


def test_every_parser_refuses_abbreviations():
    """Every ArgumentParser and sub-parser in the package passes allow_abbrev=False: an
    abbreviation (`--seq-len` for `--seq-length`) is an error, not a silent match."""
    found, bad = 0, []
    for path in sorted(SRC.rglob("*.py")):
        for call in _parser_calls(ast.parse(path.read_text(encoding="utf-8"))):
            found += 1
            if not any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                       for k in call.keywords):
                bad.append(f"{path.relative_to(SRC)}:{call.lineno}")
    assert found >= 20 and bad == [], bad


def test_ctrl_c_on_validate_says_interrupted_exits_130_and_names_each_file_as_it_runs(monkeypatch, capsys):
    """pytest runs at its default verbosity (a line per test file, named as it starts), and Ctrl-C
    ends `cpkit validate` with one line, exit 130, no traceback and no table that would call the
    interrupted test a failure."""
    import cpkit.commands.validate as validate

    seen = {}

    def interrupted(root, args, **kwargs):
        seen["args"] = args
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run_pytest", interrupted)
    assert main(["validate"]) == 130
    out, err = capsys.readouterr()
    assert "-v" in seen["args"]
    assert "cpkit validate: interrupted (Ctrl-C)" in err and "not counted as a failure" in err
    assert "Traceback" not in out + err and "FAIL" not in out
