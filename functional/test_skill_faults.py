"""A skill's Verify commands, run as written, fail on a fault in the feature they verify.

A skill's Verify list is a test selection: an agent runs it and trusts a pass. It once named
only tests that never ran sinks or windows, so a fault in a feature's path passed every command
the skill gave. Here one fault at a time is planted in a copy of the repository (a one-line
source change in a feature's main code path, as a mutation test plants it) and the Verify
commands of that feature's skill (`## ... Verify` section, the pytest commands that run on this
machine: GPU-only markers are left to GPU hosts) run in the copy as written, with `-x` so the
first failure ends them, the one measured to catch the fault (`Fault.caught_by`) first. At
least one must fail with pytest's "tests failed" (exit 1): a usage error or a collection error
would not show that the tests catch the fault.

    python -m pytest functional/test_skill_faults.py -m dist -rA
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # per command: a dist file on 2 busy cores, stopped at its first failure
_IGNORED = shutil.ignore_patterns(".git", ".venv*", "evidence", "bench-results", "__pycache__", "*.egg-info",
                                  ".pytest_cache", ".hypothesis", "gpu-results")


@dataclass(frozen=True)
class Fault:
    """One fault in a feature's main code path: `old` becomes `new` in `path` (each exactly once)."""

    skill: str
    path: str
    what: str
    old: str
    new: str
    caught_by: str | None = None
    """A test file the Verify command that catches this fault names (measured): that command runs
    first, the others in the order written only if it passes. Which command fails does not
    matter to the test; the commands that pass before it cost minutes."""


FAULTS = [
    Fault("context-parallel-attention", "src/cpkit/attention/a2a.py",
          "a2a's sink gradient halved (each rank's heads' share)",
          "dsink[heads] = sink_grad(dc, oc, lse, sink[heads])",
          "dsink[heads] = 0.5 * sink_grad(dc, oc, lse, sink[heads])",
          caught_by="functional/test_attention_features.py"),
    Fault("context-parallel-attention", "src/cpkit/attention/band.py",
          "a two-sided window sees one key fewer on its right",
          "return (0 if causal else (None if right is None else -right)), window.left",
          "return (0 if causal else (None if right is None else 1 - right)), window.left",
          caught_by="tests/test_ring_threads.py"),
    Fault("hierarchical-context-parallel", "src/cpkit/parallel/groups.py",
          "the hierarchical levels handed out in the wrong order",
          'groups["hcp"] = [a2a, p2p]', 'groups["hcp"] = [p2p, a2a]', caught_by="functional/test_groups.py"),
    Fault("eval-context-parallel", "src/cpkit/eval_cp/loop.py",
          "the eval loss summed over the eval dp group only (the cp ranks' shares dropped)",
          "    group = reduce_group(pg_collection)\n    device = group_device(group)",
          '    group = get_pg(pg_collection, "dp")\n    device = group_device(group)',
          caught_by="functional/test_eval_cp.py"),
    Fault("dynamic-context-parallel", "src/cpkit/dynamic/runtime.py",
          "a micro-batch's attention left on the static CP group",
          "    psp.cp_group = group\n", "    psp.cp_group = None\n",
          caught_by="tests/test_dynamic_runtime.py"),
    Fault("hybrid-context-parallel", "src/cpkit/hybrid/recurrent_cp.py",
          "chunkwise: the earlier ranks' parts folded in the wrong order",
          "        for r in range(group_rank(group)):\n            state = fold(every[r], state)",
          "        for r in reversed(range(group_rank(group))):\n            state = fold(every[r], state)",
          caught_by="functional/test_hybrid_gdn.py"),
    Fault("hybrid-context-parallel", "src/cpkit/hybrid/mamba.py",
          "Mamba-2 chunkwise: an earlier rank's state passed on without its decay",
          "    return part[..., :1].exp().unsqueeze(-1) * state + part[..., 1:].reshape(state.shape)",
          "    return state + part[..., 1:].reshape(state.shape)", caught_by="functional/test_hybrid_mamba.py"),
    Fault("hybrid-context-parallel", "src/cpkit/hybrid/recurrent_cp.py",
          "headwise: the gathered rows left in rank order instead of sequence order",
          "    return torch.argsort(held).to(device)", "    return torch.arange(held.numel()).to(device)",
          caught_by="functional/test_hybrid_gdn.py"),
    Fault("hybrid-context-parallel", "src/cpkit/hybrid/layout.py",
          "the relayout's backward sends the gradient along the forward route",
          "        return _move(grad.contiguous(), ctx.back, ctx.group), None, None, None",
          "        return grad, None, None, None", caught_by="functional/test_hybrid_layout.py"),
]

_SECTION = re.compile(r"^## [^\n]*\bVerify\b[^\n]*\n(.*?)(?=^## |\Z)", re.M | re.S)
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def verify_commands(skill: str, root: Path = ROOT) -> list[list[str]]:
    """The pytest commands of a skill's Verify section that run without GPUs, as argv."""
    text = (root / "skills" / skill / "SKILL.md").read_text()
    section = _SECTION.search(text)
    if section is None:
        raise AssertionError(f"skills/{skill}/SKILL.md has no '## ... Verify' section")
    out = []
    for fence in _FENCE.findall(section.group(1)):
        for line in fence.splitlines():
            argv = shlex.split(line.split(" #")[0]) if line.strip() else []
            if argv[:1] == ["pytest"] or argv[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
                args = argv[argv.index("pytest") + 1:]
                marker = args[args.index("-m") + 1] if "-m" in args[:-1] else ""
                if "gpu" not in marker:
                    out.append(args)
    return out


def run_order(fault: Fault, commands: list[list[str]]) -> list[list[str]]:
    """`commands` with those naming `fault.caught_by` first, each group in the order written."""
    first = [args for args in commands if fault.caught_by in args]
    return first + [args for args in commands if args not in first]


def test_every_skill_has_a_verify_section_that_runs_here():
    for skill in sorted({f.skill for f in FAULTS}):
        assert verify_commands(skill), f"skills/{skill}/SKILL.md: no pytest command in its Verify section"


def test_every_fault_applies_to_the_code_as_it_is():
    for fault in FAULTS:
        assert (ROOT / fault.path).read_text().count(fault.old) == 1, (fault.path, fault.old)


def test_a_fault_s_catching_command_is_one_its_skill_runs_here():
    """A stale `caught_by` would not fail the fault test, only make it slow: it names a file of one
    of the skill's Verify commands that run without GPUs."""
    for fault in FAULTS:
        if fault.caught_by is not None:
            assert any(fault.caught_by in args for args in verify_commands(fault.skill)), (fault.skill, fault.caught_by)


def test_gpu_only_verify_commands_are_left_to_gpu_hosts(tmp_path):
    (tmp_path / "skills" / "probe").mkdir(parents=True)
    (tmp_path / "skills" / "probe" / "SKILL.md").write_text(
        '## Verify\n```bash\npytest a.py -m dist\npython -m pytest b.py -m "gpu2 or gpu4" -q\n'
        "python3 -m pytest c.py -q\npytest d.py -m gpu1  # kernels\n```\n")
    assert verify_commands("probe", tmp_path) == [["a.py", "-m", "dist"], ["c.py", "-q"]]


@pytest.mark.dist
@pytest.mark.parametrize("fault", FAULTS, ids=[f"{f.skill}:{f.path.rsplit('/', 1)[1]}" for f in FAULTS])
def test_the_skills_verify_commands_fail_on_a_fault_in_its_feature(fault, tmp_path):
    copy = Path(shutil.copytree(ROOT, tmp_path / "repo", ignore=_IGNORED))
    source = copy / fault.path
    source.write_text(source.read_text().replace(fault.old, fault.new))
    env = {**os.environ, "PYTHONPATH": f"{copy / 'src'}{os.pathsep}{copy}"}
    runs = []
    for args in run_order(fault, verify_commands(fault.skill)):
        proc = subprocess.run([sys.executable, "-m", "pytest", *args, "-x", "-q", "-p", "no:cacheprovider"],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        runs.append((args, proc.returncode, proc.stdout[-1500:]))
        if proc.returncode == 1:
            if fault.caught_by is not None and fault.caught_by not in args:
                warnings.warn(f"{fault.what}: caught by `pytest {' '.join(args)}`, not by the command naming "
                              f"caught_by={fault.caught_by!r}, which ran first; update caught_by")
            return
    report = "\n".join(f"pytest {' '.join(a)} -> exit {rc}\n{tail}" for a, rc, tail in runs)
    pytest.fail(f"{fault.what} ({fault.path}) passed every Verify command of skills/{fault.skill}/SKILL.md:\n{report}")


def _collected(args: list[str]) -> set[str]:
    """The node ids a Verify command selects on this machine (pytest --collect-only, as written)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_attention_verify_commands_run_every_variant_of_its_feature_table():
    """Every (feature, layout, comm type) the skill's feature table marks "tested here" has a test
    among the Verify commands' selection that compares its output and gradients (or, for the
    refused odd THD lengths, checks the error), and a card item's covered_by names that test."""
    from cpkit.cards.schema import load_cards
    from functional.test_attention_features import COMMS, FEATURE_MATRIX

    with ThreadPoolExecutor(max_workers=len(verify_commands("context-parallel-attention"))) as pool:
        selected = set().union(*pool.map(_collected, verify_commands("context-parallel-attention")))
    test = "functional/test_attention_features.py::test_cp_attention_feature_matches_reference"
    missing = [(feature, fmt, comm) for feature, fmts in FEATURE_MATRIX.items() for fmt in fmts for comm in COMMS
               if not any(node.startswith(test + "[gloo") and f"-{comm}" in node and node.endswith(f"-{feature}-{fmt}]")
                          for node in selected)]
    assert missing == []
    covered = {entry for card in load_cards(ROOT, "context-parallel-attention")[0] for item in card.follow_up_validation
               for entry in item.covered_by}
    assert test in covered
