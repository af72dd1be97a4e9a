"""Each example fails on a fault in the code path its skill tells users to call.

An example that passes whatever that path does proves nothing about it (the eval-CP example once
summed its eval loss with cpkit.loss.global_loss, so a fault in the reduction of
cpkit.eval_cp.loop.evaluate passed it). Here each example runs under torchrun on gloo CPU ranks,
the way functional/test_examples.py runs it, with one fault planted in every rank: a small
runner replaces one function of that path, then runs the example as `__main__` (runpy), so no
source file changes. The example must exit non-zero with its own check naming the mismatch. One
control case runs an example through the same runner without a fault, to show that the runner
alone passes.

    python -m pytest functional/test_example_faults.py -m dist -rA
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from functional.test_examples import (EXAMPLES, GLOO_SIDE_BY_SIDE, NEEDS_BRIDGE, ROOT, _bridge_missing,
                                     _skip_without_bridge, launch_example)

TIMEOUT_S = 180  # per launch: one example at its smallest size runs in 10-30 s on 2 busy cores


@dataclass(frozen=True)
class Fault:
    """One fault in the code path an example's skill tells users to call."""

    path: str
    """That path, as path::symbol."""
    fault: str
    """What the planted code gets wrong."""
    plant: str
    """Python run in every rank before the example; `plant(module, name, new)` replaces a function."""
    failure: str
    """A pattern the example's stderr must match: its check that names the mismatch."""
    world_size: int = 2
    """Ranks: the smallest size the example takes at which the fault changes the result."""


FLOAT = r"\d+\.\d{6}"

FAULTS = {
    "eval_cp_in_your_loop.py": Fault(
        "src/cpkit/eval_cp/loop.py::evaluate",
        "the eval loss reduced over the eval dp group only (reduce_eval_loss's group): the sum over cp dropped",
        """
        from cpkit.compat import get_pg

        plant("cpkit.eval_cp.loop", "reduce_group", lambda pg_collection: get_pg(pg_collection, "dp"))
        """,
        rf"AssertionError: eval loss at cp 2 {FLOAT} differs from cp 1 {FLOAT}"),
    "cp_attention_in_your_gpt.py": Fault(
        "src/cpkit/attention/p2p.py::ring_forward",
        "the ring's LSE merge weighs every block received from another rank twice",
        """
        import math

        import cpkit.attention.p2p

        merge = cpkit.attention.p2p._merge_block
        plant("cpkit.attention.p2p", "_merge_block",
              lambda out, lse, case, o, l, seq, *rest: merge(out, lse, case, o, l + math.log(2.0), seq, *rest))
        """,
        rf"AssertionError: loss at cp 2 {FLOAT} differs from cp 1 {FLOAT}"),
    "dynamic_cp_in_your_loop.py": Fault(
        "src/cpkit/dynamic/runtime.py::dynamic_cp_step",
        "each rank's loss share divided by its own token count instead of the whole step's",
        """
        import cpkit.dynamic.runtime

        agree = cpkit.dynamic.runtime.agree_on_tokens

        def own_tokens(local_tokens, failure, group, device, caller):
            agree(local_tokens, failure, group, device, caller)  # the collective still runs on every rank
            return float(local_tokens)

        plant("cpkit.dynamic.runtime", "agree_on_tokens", own_tokens)
        """,
        rf"AssertionError: loss with dynamic CP {FLOAT} differs from each sequence alone at cp 1 {FLOAT}"),
    "hybrid_cp_in_your_loop.py": Fault(
        "src/cpkit/hybrid/gdn.py::gated_delta_rule_cp",
        "each rank's part of a sequence starts from a zero state: the earlier ranks' state is not passed on",
        """
        import cpkit.hybrid.gdn
        from cpkit.parallel.group_info import group_size

        rule = cpkit.hybrid.gdn.gated_delta_rule_cp

        def from_zero(q, k, v, beta, g, cu_seqlens, group, **options):
            cp = group_size(group)
            return rule(q, k, v, beta, g, [c // cp for c in cu_seqlens], None, **options)

        plant("cpkit.hybrid.gdn", "gated_delta_rule_cp", from_zero)
        """,
        rf"AssertionError: loss at cp 2 {FLOAT} differs from cp 1 {FLOAT}"),
    "hierarchical_cp_in_your_gpt.py": Fault(
        "src/cpkit/parallel/groups.py::build_pg_collection",
        "the hierarchical levels built in the wrong order: the strided p2p groups handed out as the a2a level",
        """
        import cpkit.parallel.groups

        groups_of = cpkit.parallel.groups.rank_groups

        def swapped(layout):
            groups = groups_of(layout)
            if "hcp_a2a" in groups:
                groups["hcp_a2a"], groups["hcp_p2p"] = groups["hcp_p2p"], groups["hcp_a2a"]
            return groups

        plant("cpkit.parallel.groups", "rank_groups", swapped)
        """,
        # the model's build-time check of the groups (cpkit.parallel.group_info.check_hierarchical_groups), on any rank
        r"pg_collection\.hcp=\[\[\d, \d\], \[\d, \d\]\]: the a2a group \(level 0\) must be CP positions \d\.\.\d "
        r"of CP group \[0, 1, 2, 3\]",
        world_size=4),  # [2, 2]: the swap changes only the order (at [2, 1] it changes the sizes too)
    "bridge_a2a_p2p.py": Fault(
        "src/cpkit/attention/a2a.py::a2a_attention",
        "the a2a level's gathered sequence left in arrival order (a2a_reorder skipped): chunks 0, 3, 1, 2",
        """
        import torch

        import cpkit.attention.a2a

        reorder = cpkit.attention.a2a.a2a_reorder

        def arrival_order(*args, **kwargs):
            rows = reorder(*args, **kwargs)
            return torch.arange(len(rows), device=rows.device)

        plant("cpkit.attention.a2a", "a2a_reorder", arrival_order)
        """,
        rf"AssertionError: loss at cp 2 \(a2a\+p2p \[2, 1\], Bridge's groups\) {FLOAT} differs from cp 1 {FLOAT}"),
}

RUNNER = '''\
"""Run the example argv[1] (argv[2:] its arguments) as __main__ with a fault planted first."""
import importlib
import runpy
import sys

from cpkit.notices import quiet_known_notices

quiet_known_notices()  # as the example does, before megatron-core is imported


def plant(module, name, new):
    """Replace `module`.`name` with `new`; the name must exist (a rename fails here, not silently)."""
    target = importlib.import_module(module)
    getattr(target, name)
    setattr(target, name, new)


{plant}

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _run_planted(folder: Path, name: str, plant: str, n: int, test_id: str | None = None):
    """The example under torchrun on n gloo ranks through the runner with `plant` (written to `folder`);
    `test_id`: the test that checks it (launch_example)."""
    runner = folder / "planted.py"
    runner.write_text(RUNNER.format(plant=textwrap.dedent(plant).strip()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(runner),
           f"examples/{name}"]
    return launch_example(cmd, hide_gpus=True, timeout=TIMEOUT_S, test_id=test_id)


CONTROL = "eval_cp_in_your_loop.py"
"""The example the control case runs through the runner with nothing planted."""


@pytest.fixture(scope="module")
def planted_runs(request, tmp_path_factory):
    """Every launch of this file the session selected (each fault, the control), started at the
    first one's test, GLOO_SIDE_BY_SIDE at a time (functional/test_examples.py says why): key (the
    example's name, or None for the control) -> Future of the finished process."""
    from concurrent.futures import ThreadPoolExecutor

    mine = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    wanted = [(item.callspec.params["name"], item.nodeid) for item in mine
              if item.originalname == "test_the_example_fails_on_a_fault_in_its_path"]
    pool = ThreadPoolExecutor(max_workers=GLOO_SIDE_BY_SIDE, thread_name_prefix="cpkit-example-fault")
    runs = {}
    for name, nodeid in wanted:
        if name in NEEDS_BRIDGE and _bridge_missing():
            continue
        fault = FAULTS[name]
        runs[name] = pool.submit(_run_planted, tmp_path_factory.mktemp("planted"), name, fault.plant, fault.world_size,
                                 nodeid)
    control = [item.nodeid for item in mine if item.originalname == "test_the_runner_without_a_fault_passes"]
    if control:
        runs[None] = pool.submit(_run_planted, tmp_path_factory.mktemp("control"), CONTROL, "", 2, control[0])
    yield runs
    pool.shutdown(wait=False, cancel_futures=True)  # a run stopped early (-x) does not wait for them


def test_every_example_has_a_planted_fault():
    assert sorted(FAULTS) == sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    for name, fault in FAULTS.items():
        assert fault.world_size in EXAMPLES[name][0], f"{name}: world size {fault.world_size} is not one it takes"
        path, symbol = fault.path.split("::")
        assert re.search(rf"^(def|class) {symbol}\b", (ROOT / path).read_text(), re.M), fault.path


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(FAULTS))
def test_the_example_fails_on_a_fault_in_its_path(name, planted_runs):
    _skip_without_bridge(name)
    fault = FAULTS[name]
    done = planted_runs[name].result()
    report = f"examples/{name} with {fault.path} faulted ({fault.fault}):\n{done.stdout}\n{done.stderr[-6000:]}"
    assert done.returncode != 0, f"passed with the fault planted: {report}"
    assert re.search(fault.failure, done.stderr), f"did not fail on /{fault.failure}/: {report}"
    print(re.search(fault.failure + ".*", done.stderr).group(0))  # the evidence (-rA shows it)


@pytest.mark.dist
def test_the_runner_without_a_fault_passes(planted_runs):
    """The control: the same runner, nothing planted, and the example passes its checks."""
    name = CONTROL
    done = planted_runs[None].result()
    assert done.returncode == 0, f"examples/{name} through the runner exited {done.returncode}:\n{done.stderr[-6000:]}"
    for pattern in EXAMPLES[name][1](2):
        assert re.search(pattern, done.stdout), f"examples/{name} did not print /{pattern}/:\n{done.stdout}"
