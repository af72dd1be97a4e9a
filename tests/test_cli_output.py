"""What a person reads from `cpkit`: the help and version, `cpkit cards status` within 100
columns, and commands that need a repository failing with the reason outside one."""

import os
from pathlib import Path

import pytest

from cpkit import __version__
from cpkit.cards import format_status_table, status_report
from cpkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"cpkit {__version__}"


def test_help_describes_the_tool_and_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "context parallelism (CP) for megatron-core" in out
    for command in ("validate", "layout", "plan", "schedule", "cards", "skills"):
        assert f"    {command}" in out
    assert "Each subcommand lives in" not in out  # the module docstring is for developers


def test_cards_status_of_this_repository_fits_100_columns(capsys):
    assert main(["cards", "status", "--root", str(ROOT)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(map(len, lines)) <= 100, max(lines, key=len)


def test_long_result_goes_on_its_own_indented_lines():
    report = status_report(ROOT)
    row = next(r for r in report["rows"] if r["last_result"] and len(r["last_result"].get("detail", "")) > 100)
    text = format_status_table([row])
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100
    head = next(i for i, line in enumerate(lines) if line.startswith(f"  {row['id']}"))
    assert lines[head].split() == [row["id"], "claim:", f"{row['status']},", "needs", row["needs"]]
    assert lines[head + 1].startswith(f"      last result: {row['last_result']['outcome']} on ")
    words = " ".join(line.strip() for line in lines[head + 1:]).split()
    assert " ".join(row["last_result"]["detail"].split()) in " ".join(words)  # wrapped, nothing cut


@pytest.mark.parametrize("argv", [["cards", "status"], ["cards", "check"], ["skills", "check"], ["validate"]])
def test_repository_commands_outside_a_repository_fail_with_the_reason(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "is not inside a cpkit repository" in captured.err and "--root" in captured.err
    assert "no cards" not in captured.out


def test_root_that_is_not_a_repository_is_an_error(tmp_path, capsys):
    assert main(["cards", "status", "--root", str(tmp_path)]) == 2
    assert "is not a cpkit repository" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-m", "cpkit.cli", "cards", "status"], ["-m", "cpkit.validation.change_map"]])
def test_a_reader_that_leaves_early_gets_no_traceback(argv):
    """`cpkit cards status | head -1`: the closed pipe ends the command quietly, exit 0."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[1], bufsize=0)
    proc.stdout.read(1)
    proc.stdout.close()  # before the command has written everything
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


# What the command itself prints, then two warnings a user must still see: one of their own and
# one from megatron-core that is not a notice about missing optional packages.
_SCHEDULE_THEN_WARN = """
import sys, warnings
from cpkit.cli import main
code = main(sys.argv[1:])
warnings.warn("an unrelated warning", UserWarning)
warnings.warn_explicit("an MCore warning to act on", UserWarning, "megatron/core/x.py", 1, module="megatron.core.x")
sys.exit(code)
"""


def test_schedule_prints_no_mcore_notices_and_keeps_other_warnings():
    """`cpkit schedule` imports megatron-core (MCore's BalancedCPScheduler): its four "Transformer
    Engine and Apex are not installed" notices are gone, every other warning still shows."""
    import subprocess
    import sys

    argv = ["schedule", "--dp-cp", "2", "--max-seq-len-per-rank", "4096", "--seq-lens", "3000,100"]
    proc = subprocess.run([sys.executable, "-c", _SCHEDULE_THEN_WARN, *argv], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    assert proc.returncode == 0, proc.stderr
    assert "modeled step time" in proc.stdout
    assert "not installed" not in proc.stderr, proc.stderr
    assert "UserWarning: an unrelated warning" in proc.stderr
    assert "UserWarning: an MCore warning to act on" in proc.stderr


def test_setup_ends_with_cpkit_ready_and_no_mcore_notices():
    """scripts/setup.sh's last line (its check that everything imports) prints "cpkit ready" and
    none of megatron-core's notices about Transformer Engine and Apex."""
    import subprocess
    import sys

    last = (ROOT / "scripts" / "setup.sh").read_text().strip().splitlines()[-1]
    assert last.startswith('"$PY" -c '), last
    proc = subprocess.run(["bash", "-c", last], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, "PY": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cpkit ready: torch"), proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr
