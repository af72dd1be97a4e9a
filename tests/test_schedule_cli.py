"""`cpkit schedule`, run in-process through cpkit.cli.main."""

from __future__ import annotations

import json
import re

import pytest

from cpkit.cli import main
from cpkit.dynamic.candidates import error_band_text

README_EXAMPLE = ["schedule", "--dp-cp", "8", "--max-seq-len-per-rank", "1024",
         "--seq-lens", "4000,100,200,3000,800,50,1024,1025"]


def _grid(out: str) -> dict[str, list[str]]:
    """rank -> its cells, with a cell's wrapped continuation lines joined back on."""
    lines = out.split("\n\n")[1].splitlines()  # the grid block: header, rule, rows
    starts = [0] + [m.end() for m in re.finditer(r"\S+\s+", lines[0])]
    rows: dict[str, list[str]] = {}
    rank = None
    for line in lines[2:]:
        cols = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        if cols[0]:
            rank = cols[0]
            rows[rank] = cols[1:]
        else:
            rows[rank] = [c + more for c, more in zip(rows[rank], cols[1:])]
    return rows


def test_text_report_has_grid_sample_table_and_step_times(capsys):
    assert main(README_EXAMPLE) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("dynamic CP plan (cpkit): 8 samples over dp_cp_size=8, "
                          "max_seq_len_per_rank=1024")
    grid = _grid(out)
    assert sorted(grid, key=int) == [str(r) for r in range(8)]
    n_mb = len(grid["0"])
    assert all(len(cells) == n_mb for cells in grid.values())
    assert all(c == "-" or ("/cp" in c and c.startswith("s")) for cells in grid.values() for c in cells)
    assert "modeled step time" in out and "static CP" in out and "MCore" in out
    table = [line.split() for line in out.splitlines() if line.startswith("s") and
             line.split()[0][1:].isdigit()]
    assert [row[0] for row in table] == [f"s{i}" for i in range(8)]  # every sample, none cut
    for row, L in zip(table, [4000, 100, 200, 3000, 800, 50, 1024, 1025]):
        assert int(row[1]) == L and int(row[3]) >= int(row[2])  # got >= needs
    shown = {int(s[1:]) for cells in grid.values() for c in cells if c != "-"
             for s in c.split("/")[0].split(",") if s.startswith("s")}
    assert shown == set(range(8))


def test_packed_cells_wrap_and_never_leave_a_sample_out(capsys):
    lens = ",".join(["100"] * 10 + ["3000"])
    assert main(["schedule", "--dp-cp", "2", "--max-seq-len-per-rank", "4096", "--seq-lens", lens]) == 0
    out = capsys.readouterr().out
    cells = [c for cells in _grid(out).values() for c in cells if c != "-"]
    for cell in cells:
        ids = cell.split("/")[0].split(",")
        assert len(ids) == len(set(ids)) and "+" not in cell
    assert {s for c in cells for s in c.split("/")[0].split(",")} == {f"s{i}" for i in range(11)}
    assert max(len(line) for line in out.split("\n\n")[1].splitlines()) <= 100


def test_json_has_impl_microbatches_stats_and_violations(capsys):
    assert main(README_EXAMPLE + ["--json", "--vs-mcore"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) == {"impl", "microbatches", "stats", "violations"}
    assert plan["impl"] == "cpkit" and plan["violations"] == []
    stats = plan["stats"]
    assert stats["modeled_step_time_s"] <= stats["static_step_time_s"]
    assert stats["speedup_vs_static"] == stats["static_step_time_s"] / stats["modeled_step_time_s"]
    assert stats["speedup_vs_mcore"] == stats["mcore_step_time_s"] / stats["modeled_step_time_s"]
    samples = sorted(s for mb in plan["microbatches"] for g in mb["groups"] for s in g["samples"])
    assert samples == list(range(8))
    for mb in plan["microbatches"]:
        for g in mb["groups"]:
            assert set(g) == {"ranks", "samples", "cp_size"}
            assert len(g["ranks"]) == g["cp_size"] and g["ranks"][0] % g["cp_size"] == 0


def test_seq_lens_file_json_or_plain(tmp_path, capsys):
    plain = tmp_path / "lens.txt"
    plain.write_text("4000, 100\n200 3000\n")
    as_json = tmp_path / "lens.json"
    as_json.write_text("[4000, 100, 200, 3000]")
    base = ["schedule", "--dp-cp", "4", "--max-seq-len-per-rank", "1024", "--json"]
    assert main(base + ["--seq-lens-file", str(plain)]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(base + ["--seq-lens-file", str(as_json)]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a == b


def test_vpp_group_size_and_min_cp(capsys):
    argv = ["schedule", "--dp-cp", "8", "--max-seq-len-per-rank", "100", "--min-cp", "2",
            "--microbatch-group-size", "3", "--seq-lens", "50,50,50,50,150", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["microbatches"]) % 3 == 0
    assert all(g["cp_size"] >= 2 for mb in plan["microbatches"] for g in mb["groups"])


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "5000,1", "--dp-cp", "4"],
     "error: seq_lens[0]=5000: needs cp_size 8 (ceil(5000 / 8) <= max_seq_len_per_rank=1024) but "
     "the largest aligned CP group of dp_cp_size=4 has 4 ranks; fix: raise max_seq_len_per_rank "
     "to >= 1250, raise dp_cp_size to >= 8, or split the sequence"),
    (["--seq-lens", "100,abc", "--dp-cp", "4"], "error: --seq-lens: item 1 ('abc') is not an integer"),
    (["--seq-lens", ",", "--dp-cp", "4"], "error: --seq-lens: no sequence lengths given"),
    (["--seq-lens", "100", "--dp-cp", "0"],
     "error: dp_cp_size=0: must be an int >= 1; fix: pass e.g. 8"),
    (["--seq-lens", "100", "--dp-cp", "4", "--min-cp", "3"],
     "error: min_cp_size=3: must be a power of two >= 1; fix: pass 1, 2, 4, ..."),
    (["--seq-lens", "0", "--dp-cp", "4"],
     "error: seq_lens[0]=0: must be an int >= 1; fix: drop empty samples before scheduling"),
])
def test_invalid_input_exits_2_with_one_clear_line(capsys, argv, message):
    assert main(["schedule", "--max-seq-len-per-rank", "1024"] + argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [message]


def test_mcore_impl_on_a_valid_plan_exits_0(capsys):
    assert main(["schedule", "--impl", "mcore", "--dp-cp", "8", "--max-seq-len-per-rank", "4096",
                 "--seq-lens", "30000,9000,500,500,2000,16000,3000,1200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["impl"] == "mcore" and out["violations"] == []
    assert out["stats"]["mcore_step_time_s"] == out["stats"]["modeled_step_time_s"]


def test_mcore_impl_breaking_an_invariant_exits_1_naming_it(capsys):
    # One sample on 3 ranks: MCore spreads it over all 3 (no such aligned group).
    argv = ["schedule", "--impl", "mcore", "--dp-cp", "3", "--max-seq-len-per-rank", "1",
            "--seq-lens", "1"]
    assert main(argv + ["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["violations"] == [{"property": "aligned-groups",
                                  "detail": "micro-batch 0: group [0..2] has 3 ranks, not a "
                                            "power of two"}]
    assert main(argv) == 1
    assert "aligned-groups: micro-batch 0: group [0..2]" in capsys.readouterr().out


def test_mcore_crash_is_the_no_crash_violation_with_its_last_line(capsys):
    argv = ["schedule", "--impl", "mcore", "--dp-cp", "5", "--max-seq-len-per-rank", "1",
            "--seq-lens", "1,1"]
    assert main(argv + ["--json"]) == 1
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["microbatches"] == [] and err == ""
    assert result["violations"] == [{"property": "no-crash",
                                     "detail": "IndexError: list assignment index out of range"}]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "no-crash: IndexError" in out
    # cpkit on the same input: a valid plan, and MCore's crash in its stats
    assert main(argv[:2] + ["cpkit"] + argv[3:] + ["--json", "--vs-mcore"]) == 0
    assert "IndexError" in json.loads(capsys.readouterr().out)["stats"]["mcore_error"]


@pytest.mark.parametrize("impl", ["cpkit", "mcore"])
@pytest.mark.parametrize("lens, message", [
    ("0,5", "error: seq_lens[0]=0: must be an int >= 1; fix: drop empty samples before scheduling"),
    ("-3", "error: seq_lens[0]=-3: must be an int >= 1; fix: drop empty samples before scheduling"),
    ("2.5", "error: --seq-lens: item 0 ('2.5') is not an integer"),
    ("40000", "error: seq_lens[0]=40000: needs cp_size 16 (ceil(40000 / 16) <= "
              "max_seq_len_per_rank=4096) but the largest aligned CP group of dp_cp_size=8 has 8 "
              "ranks; fix: raise max_seq_len_per_rank to >= 5000, raise dp_cp_size to >= 16, or "
              "split the sequence"),
])
def test_bad_lengths_exit_2_with_one_line_for_both_impls(capsys, impl, lens, message):
    argv = ["schedule", "--impl", impl, "--dp-cp", "8", "--max-seq-len-per-rank", "4096",
            "--seq-lens", lens]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [message]


def test_mcore_impl_rejects_options_it_does_not_have(capsys):
    assert main(["schedule", "--impl", "mcore", "--dp-cp", "8", "--max-seq-len-per-rank", "64",
                 "--min-cp", "2", "--seq-lens", "10"]) == 2
    assert capsys.readouterr().err.startswith("error: --impl mcore: MCore's BalancedCPScheduler")


def test_missing_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    argv = ["schedule", "--dp-cp", "4", "--max-seq-len-per-rank", "8", "--seq-lens-file", str(missing)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"error: --seq-lens-file {missing}: No such file or directory"]


def test_lengths_are_required(capsys):
    with pytest.raises(SystemExit) as info:
        main(["schedule", "--dp-cp", "4", "--max-seq-len-per-rank", "8"])
    assert info.value.code == 2


# -- the verdict in the text: which plan won, ratios that read right -----------------------------

BAND = error_band_text()  # beside every ratio
LONG_TAIL = ["--dp-cp", "8", "--max-seq-len-per-rank", "4096", "--seq-lens", "30000,9000,500,500,2000,16000,3000,1200"]


def _step_line(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("modeled step time")]
    return line


def test_a_dynamic_win_names_its_candidate_and_how_much_faster(capsys):
    assert main(["schedule"] + LONG_TAIL + ["--json", "--vs-mcore"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert main(["schedule"] + LONG_TAIL + ["--vs-mcore"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dynamic CP plan (cpkit): ")
    line = _step_line(out)
    assert f"cpkit {stats['modeled_step_time_s'] * 1e3:.1f} ms ({stats['candidate']} candidate)" in line
    assert f"static CP {stats['static_step_time_s'] * 1e3:.1f} ms (cpkit {stats['speedup_vs_static']:.2f}x faster; {BAND})" in line
    assert f"MCore {stats['mcore_step_time_s'] * 1e3:.1f} ms (cpkit {stats['speedup_vs_mcore']:.2f}x faster; {BAND})" in line
    assert "(x" not in line


def test_a_static_win_is_said_in_the_header_and_the_step_times(capsys):
    argv = ["schedule", "--dp-cp", "8", "--max-seq-len-per-rank", "4096", "--seq-lens", "30000,100"]
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["candidate"] == "static"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("static CP plan (cpkit): 2 samples")
    assert "dynamic CP plan" not in out
    assert "static CP chosen (no dynamic candidate was modeled faster)" in _step_line(out)


def test_mcore_slower_than_static_reads_as_static_faster_and_not_against_itself(capsys):
    assert main(["schedule", "--impl", "mcore"] + LONG_TAIL) == 0
    line = _step_line(capsys.readouterr().out)
    assert re.search(r"modeled step time: MCore [\d.]+ ms; static CP [\d.]+ ms \(0\.\d\dx: static CP faster; "
                     + re.escape(BAND) + r"\)$", line), line
    assert "1.00" not in line


@pytest.mark.parametrize("ratio, worded", [(1.06, "(cpkit 1.06x faster; "), (0.95, "(0.95x: MCore faster; "),
                                           (1.001, "(1.00x: the same modeled time as cpkit; ")])
def test_each_ratio_says_which_plan_is_faster(ratio, worded):
    from cpkit.commands.schedule import format_plan
    from cpkit.dynamic.scheduler import schedule

    plan = schedule([3000, 100], dp_cp_size=2, max_seq_len_per_rank=4096)
    stats = {"modeled_step_time_s": 0.8, "static_step_time_s": 0.9, "speedup_vs_static": 0.9 / 0.8,
             "mcore_step_time_s": 0.8 * ratio, "speedup_vs_mcore": ratio, "candidate": "earliest-finish",
             "model": "m"}
    assert f"MCore {0.8 * ratio * 1e3:.1f} ms {worded}{BAND})" in format_plan(plan, stats, [], "cpkit")


def test_the_model_line_names_the_calibrations_host_and_versions_and_every_ratio_its_band(capsys):
    assert main(["schedule"] + LONG_TAIL + ["--vs-mcore"]) == 0
    out = capsys.readouterr().out
    assert "model: kernels-only model, hidden 4096" in out
    assert "host vm, torch 2.11.0+cu130, megatron-core 0.19.2" in out  # the shipped H200 file's
    assert BAND.startswith("error band") and _step_line(out).count(BAND) == 2  # static CP's and MCore's


# -- the model flags and a planner without torch --------------------------------------------------


def test_the_h100_calibrations_model_is_rebuilt_from_the_command_line():
    """The flags build the same ModelDims as the Python API for the model the shipped H100 replay
    calibration measured (its "dims"), SwiGLU included."""
    from importlib import resources

    from cpkit.cli import build_parser
    from cpkit.commands.schedule import model_dims_from_args
    from cpkit.dynamic.cost import ModelDims

    dims = json.loads(resources.files("cpkit.dynamic").joinpath("calibration_h100_replay.json").read_text())["dims"]
    api = ModelDims(**dims)
    flags = ["--hidden-size", "4096", "--num-heads", "32", "--num-kv-heads", "8", "--head-dim", "128",
             "--num-layers", "32", "--ffn-hidden-size", "14336", "--swiglu", "--bytes-per-element", "2"]
    args = build_parser().parse_args(["schedule", "--dp-cp", "8", "--max-seq-len-per-rank", "4096",
                                      "--seq-lens", "100"] + flags)
    assert model_dims_from_args(args) == api and api.gated_linear_unit


def test_swiglu_changes_the_modeled_step_time_and_is_named(capsys):
    assert main(["schedule"] + LONG_TAIL + ["--ffn-hidden-size", "14336", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["stats"]
    assert main(["schedule"] + LONG_TAIL + ["--ffn-hidden-size", "14336", "--swiglu", "--json"]) == 0
    gated = json.loads(capsys.readouterr().out)["stats"]
    assert gated["modeled_step_time_s"] > plain["modeled_step_time_s"]
    assert "SwiGLU MLP 14336" in gated["model"] and "MLP 14336" in plain["model"]


def _cli_with_torch_blocked(argv: list[str]):
    """`cpkit argv` in a fresh process in which importing torch fails (planning must not need it)."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    code = f"import sys; sys.modules['torch'] = None\nfrom cpkit.cli import main\nsys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})


def test_schedule_plans_with_torch_blocked():
    """Planning is pure Python: `cpkit schedule` runs in a process where importing torch fails;
    MCore's plan (torch code) is compared only on request."""
    proc = _cli_with_torch_blocked(["schedule"] + LONG_TAIL)
    assert proc.returncode == 0, proc.stderr
    assert "MCore not compared (--vs-mcore)" in proc.stdout


def test_a_step_calibration_plans_with_the_real_step_model_and_without_torch(tmp_path):
    """A calibration with a "step" section (python -m cpkit.bench dynamic_step writes one) times
    plans with cpkit.dynamic.step_model.StepModel, still without importing torch."""
    from cpkit.dynamic.cost import shipped_calibration_path
    from cpkit.dynamic.step_model import OpCounts, StepCosts

    data = json.loads(shipped_calibration_path().read_text())
    data["step"] = StepCosts(ops=OpCounts({1: (600.0, 300.0, 16.0, 0.0), 4: (1400.0, 300.0, 17.0, 0.0)}),
                             host_op_s=20e-6, sync_s=30e-6, mem_s_per_token=2e-9, reduce_opt_s=22e-3).to_dict()
    cal = tmp_path / "step_calibration.json"
    cal.write_text(json.dumps(data))
    proc = _cli_with_torch_blocked(["schedule"] + LONG_TAIL + ["--num-layers", "4", "--calibration", str(cal)])
    assert proc.returncode == 0, proc.stderr
    assert "model: real-step model, hidden 4096" in proc.stdout
    assert _step_line(proc.stdout).count(BAND) == 1  # static CP's ratio; MCore not compared
