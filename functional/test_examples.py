"""The examples a user copies into their own training loop (examples/, one per skill) run where
the user runs them: under torchrun (`python -m torch.distributed.run --nproc-per-node N`) at every
world size an example's docstring names, on gloo with the GPUs hidden (marker dist, CI) and on
NCCL with one GPU per rank (gpu2, gpu4); and as `python examples/<name>.py`, which spawns its gloo
ranks itself. Each example asserts its own numbers (loss and gradients against CP 1, with the
tolerances per dtype it states; a failed assert exits non-zero); the test checks the exit status,
that every rank used the expected backend and device, and the printed lines. A launch that runs
past the timeout is killed with all its ranks, and its output is reported; a launch dies with the
test run however it stops (cpkit.harness.children).

    python -m pytest -m "gpu2 or gpu4" functional/test_examples.py -rP   # NCCL, with each run's output
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpkit.harness.attribution import CONTEXT_ENV
from cpkit.harness.children import popen_tied
from cpkit.harness.launch_times import record_times

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

FLOAT = r"\d+\.\d{6}"
CHECKED = r"checked: loss and \d+ gradients .* torch\.float32, loss within 1e-05, gradients rtol 1e-05 atol 1e-05"


def _eval_cps(n: int) -> list[int]:
    """The eval CP sizes examples/eval_cp_in_your_loop.py evaluates at on n ranks: each of 2, 4, 8 dividing n."""
    return [cp for cp in (2, 4, 8) if n % cp == 0]


def _hcp_line(n: int) -> str:
    return r"HIERARCHICAL_CONTEXT_PARALLEL_GROUPS a2a=\[0, 1\] p2p=\[0" + (r", 2\]" if n == 4 else r"\]")


# name -> (the world sizes its docstring names, the lines it prints at world size n)
EXAMPLES = {
    "cp_attention_in_your_gpt.py": ((2, 4), lambda n: [
        CHECKED, rf"loss at cp {n}: {FLOAT}; at cp 1: {FLOAT}; largest gradient difference"]),
    "hierarchical_cp_in_your_gpt.py": ((2, 4), lambda n: [
        _hcp_line(n), CHECKED,
        rf"loss at cp {n} \(a2a\+p2p \[2, {n // 2}\]\): {FLOAT}; at cp 1: {FLOAT}; largest gradient difference"]),
    "dynamic_cp_in_your_loop.py": ((2, 4), lambda n: [
        r"plan: \d+ micro-batches, CP sizes \[1, 2\]", CHECKED,
        rf"loss with dynamic CP: {FLOAT}; each sequence alone at cp 1: {FLOAT}; largest gradient difference"]),
    "hybrid_cp_in_your_loop.py": ((2, 4), lambda n: [
        rf"checked: loss and \d+ gradients at cp {n} against cp 1, torch\.float32, loss within 1e-05 relative, "
        r"gradients rtol 0\.0001 atol 2e-05", rf"loss at cp {n} \(AGA: attention in zigzag, GDN chunkwise in contiguous\): {FLOAT}; at cp 1: {FLOAT}; "
        r"largest gradient difference"]),
    "eval_cp_in_your_loop.py": ((2, 4, 8), lambda n: [
        rf"train loss \(cp 1, {n} ranks\): {FLOAT}",
        *(rf"eval at cp {cp} x dp {n // cp}: samples " + "; ".join(
            rf"replica {d}: {d * 8 * cp // n}-{(d + 1) * 8 * cp // n - 1}" for d in range(n // cp)) + r" \(of 8\)"
          for cp in _eval_cps(n)),
        r"checked: eval loss over the 8 samples \(cpkit\.eval_cp\.loop\.evaluate\) at cp "
        + ", ".join(map(str, _eval_cps(n))) + r" against cp 1, torch\.float32, within 1e-05; each sample once; "
        r"training groups restored after each",
        r"eval loss " + "; ".join(rf"at cp {cp}: {FLOAT}" for cp in _eval_cps(n)) + rf"; at cp 1: {FLOAT}",
        r"rebound \d+ attributes, e\.g\. .+; restored: True"]),
    "bridge_a2a_p2p.py": ((2, 4), lambda n: [
        _hcp_line(n), CHECKED,
        rf"loss at cp {n} \(a2a\+p2p \[2, {n // 2}\], Bridge's groups\): {FLOAT}; at cp 1: {FLOAT}; "
        r"largest gradient difference"]),
}
NEEDS_BRIDGE = ("bridge_a2a_p2p.py",)  # runs Megatron-Bridge's code: skipped with the reason without it
GPU_MARKS = {2: pytest.mark.gpu2, 4: pytest.mark.gpu4}


def _cases(backend: str) -> list:
    """(example, world size) for every size it names; on NCCL those that fit the GPU tier's 4 GPUs,
    started together at the session's first test (cpkit_prefetch), beside the rank pools."""
    marks = {n: GPU_MARKS.get(n) if backend == "nccl" else pytest.mark.dist for n in (2, 4, 8)}
    early = [pytest.mark.cpkit_prefetch(start=_start_nccl_runs)] if backend == "nccl" else []
    return [pytest.param(name, n, id=f"{name}-{n}", marks=[marks[n], *early])
            for name, (sizes, _) in sorted(EXAMPLES.items()) for n in sizes if marks[n] is not None]


def _skip_without_bridge(name: str) -> None:
    if name in NEEDS_BRIDGE:
        from cpkit.upstream.bridge import bridge_src

        src, why = bridge_src()
        if src is None:
            pytest.skip(why)


def launch_example(cmd: list[str], *, hide_gpus: bool, gpus: str | None = None,
                   timeout: float = TIMEOUT_S, test_id: str | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root (src/ on PYTHONPATH) in a session of its own, tied to
    the test run (cpkit.harness.children.popen_tied); on a timeout kill the whole session (torchrun and
    its ranks) and fail with the output so far. Returns the finished process, whatever its exit
    status (the launch time is recorded with cpkit.harness.launch_times). `test_id`: the test that
    checks this launch, when another test's start-up runs it (a fixture starting launches side by
    side): while a coverage map is recorded its work is credited to that test, not to whichever
    test is running when the launch starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    if test_id is not None and CONTEXT_ENV in env:
        env[CONTEXT_ENV] = test_id
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    started = time.time()
    proc = popen_tied(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        record_times([dict(example=" ".join(cmd[2:]), gpus=gpus, seconds=round(time.time() - started, 2),
                           t0=round(started, 2), t1=round(time.time(), 2), ok=proc.returncode == 0)])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[2:])} ran past {timeout} s:\n{out}\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(cmd: list[str], *, hide_gpus: bool, gpus: str | None = None, test_id: str | None = None) -> str:
    """launch_example, failing with stdout and stderr on a non-zero exit. Returns stdout."""
    done = launch_example(cmd, hide_gpus=hide_gpus, gpus=gpus, test_id=test_id)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, f"{' '.join(cmd[2:])} exited {done.returncode}:\n{out}\n{err[-6000:]}"
    # An example a user copies prints what it checked, not notices they cannot act on.
    from cpkit.notices import KNOWN_NOTICES

    noise = [n for n in KNOWN_NOTICES if n in err]
    assert not noise, f"{' '.join(cmd[2:])} printed megatron-core notices {noise}:\n{err[-3000:]}"
    return out


def _check_output(name: str, n: int, out: str, backend: str) -> None:
    device = "cpu" if backend == "gloo" else "cuda:{r}"
    ranks = "; ".join(f"rank {r}: {backend} on {device.format(r=r)}" for r in range(n))
    assert f"ranks: {ranks}\n" in out, f"examples/{name} on {n} ranks: expected '{ranks}':\n{out}"
    for pattern in EXAMPLES[name][1](n):
        assert re.search(pattern, out), f"examples/{name} on {n} ranks did not print /{pattern}/:\n{out}"


def _command(name: str, n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", f"examples/{name}"]


_NCCL_RUNS: dict = {}  # (name, n) -> Future of its output: every NCCL example starts at the first one's test


def _start_nccl_runs() -> None:
    """Start every NCCL example that will run, side by side (each pays its own imports and NCCL
    start-up, 20-30 s, so one after another they cost minutes): 2-rank runs alternate between the
    GPU pairs, 4-rank runs take the first four GPUs. Failures surface in each example's own test."""
    from concurrent.futures import ThreadPoolExecutor

    from cpkit.upstream.bridge import bridge_src
    from cpkit.devices import cuda_device_count

    count = cuda_device_count()
    pool = ThreadPoolExecutor(max_workers=6, thread_name_prefix="cpkit-example")
    pairs = [f"{i},{i + 1}" for i in range(0, count - 1, 2)] or [None]
    for i, param in enumerate(_cases("nccl")):
        name, n = param.values
        if count < n or (name in NEEDS_BRIDGE and bridge_src()[0] is None):
            continue
        gpus = pairs[i % len(pairs)] if n == 2 else ",".join(str(g) for g in range(n))
        _NCCL_RUNS[(name, n)] = pool.submit(_run, _command(name, n), hide_gpus=False, gpus=gpus)
    pool.shutdown(wait=False)


GLOO_SIDE_BY_SIDE = 3
"""gloo launches run at once on CPU: each spends seconds in single-threaded start-up (torchrun,
imports, rendezvous) that another launch's ranks fill (three 2-rank examples: 43 s one after
another, 28 s side by side on 2 cores)."""


@pytest.fixture(scope="module")
def gloo_runs(request):
    """Every gloo launch this session selected, started at the first one's test, GLOO_SIDE_BY_SIDE
    at a time in the order they run: (name, n) -> Future of its output. Failures surface in each
    example's own test; a launch still running when the run stops dies with it (kill_all)."""
    from concurrent.futures import ThreadPoolExecutor

    selected = [(item.callspec.params, item.nodeid) for item in request.session.items
                if getattr(item, "module", None) is request.module
                and item.originalname == "test_example_under_torchrun_on_gloo"]
    pool = ThreadPoolExecutor(max_workers=GLOO_SIDE_BY_SIDE, thread_name_prefix="cpkit-example")
    runs = {(p["name"], p["n"]): pool.submit(_run, _command(p["name"], p["n"]), hide_gpus=True, test_id=nodeid)
            for p, nodeid in selected if not (p["name"] in NEEDS_BRIDGE and _bridge_missing())}
    yield runs
    pool.shutdown(wait=False, cancel_futures=True)  # a run stopped early (-x) does not wait for them


def _bridge_missing() -> bool:
    from cpkit.upstream.bridge import bridge_src

    return bridge_src()[0] is None


def _torchrun(name: str, n: int, backend: str, gloo_runs: dict | None = None) -> None:
    _skip_without_bridge(name)
    if backend == "nccl":
        if not _NCCL_RUNS:
            _start_nccl_runs()
        out = _NCCL_RUNS[(name, n)].result()
    else:
        out = gloo_runs[(name, n)].result()
    print(out)  # the evidence: each rank's backend and device, what was checked, the numbers (-rP shows it)
    _check_output(name, n, out, backend)


def test_every_example_is_tested():
    assert sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_a_launch_started_for_another_test_is_credited_to_its_own_test(monkeypatch):
    """While a coverage map is recorded, a launch a fixture starts ahead of its test runs under
    that test's context, not the context of the test running when it starts; without a
    recording, nothing is added to its environment."""
    probe = [sys.executable, "-c", f"import os; print(os.environ.get({CONTEXT_ENV!r}, '-'))"]
    monkeypatch.setenv(CONTEXT_ENV, "functional/test_examples.py::the_test_running_now")
    done = launch_example(probe, hide_gpus=True, test_id="functional/test_examples.py::its_own_test")
    assert done.stdout.strip() == "functional/test_examples.py::its_own_test"
    monkeypatch.delenv(CONTEXT_ENV)
    assert launch_example(probe, hide_gpus=True, test_id="x").stdout.strip() == "-"


def test_every_example_names_its_world_sizes_and_nccl():
    """The sizes tested are the ones the example accepts, and it says how it runs on GPUs."""
    for name, (sizes, _) in EXAMPLES.items():
        text = (ROOT / "examples" / name).read_text()
        assert f"WORLD_SIZES = {sizes}" in text, f"examples/{name}: WORLD_SIZES differs from the test's {sizes}"
        assert "nccl" in text and "cpkit.testing" not in text, f"examples/{name}"


@pytest.mark.parametrize("name,n", _cases("gloo"))
def test_example_under_torchrun_on_gloo(name, n, gloo_runs):
    _torchrun(name, n, "gloo", gloo_runs)


@pytest.mark.parametrize("name,n", _cases("nccl"))
def test_example_under_torchrun_on_nccl(name, n):
    _torchrun(name, n, "nccl")


@pytest.mark.dist
def test_example_spawns_its_own_gloo_ranks():
    """`python examples/<name>.py` without torchrun: the example's own launch (cpkit.harness.launch) of
    gloo ranks on CPU, the same in every example."""
    name = "cp_attention_in_your_gpt.py"
    out = _run([sys.executable, f"examples/{name}"], hide_gpus=False)
    _check_output(name, 2, out, "gloo")


@pytest.mark.dist
def test_an_unsupported_world_size_is_refused_with_the_fix():
    """One rank (the cheapest size no example takes): refused before any group is built."""
    err = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "examples/cp_attention_in_your_gpt.py"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
             "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    assert err.returncode != 0
    assert ("world_size=1: examples/cp_attention_in_your_gpt.py runs on 2 or 4 ranks; "
            "fix: torchrun --nproc-per-node 2 examples/cp_attention_in_your_gpt.py") in err.stderr, err.stderr[-4000:]
