"""The checks of `python -m cpkit.cluster`: each runs the scenario functions of the functional
tests (cpkit.testing.scenarios) on the job's ranks, with cases sized to its world and nodes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from cpkit.harness.pool_groups import GroupReuse
from cpkit.parallel.layout import CPLayout

__all__ = ["CHECKS", "FAULT_ENV", "JobShape", "Check", "build_check", "run_check"]

CHECKS = ("smoke", "attention", "hierarchical", "eval-cp", "dynamic-cp", "bench-attention")

# "<check>:<rank>" makes that rank raise at the start of that check, "<check>:<rank>:hang" makes it
# sleep there. Tests use it to prove that one raising (hung) rank ends every rank promptly (at the
# timeout) with its traceback (stack) in the report; no option exposes it.
FAULT_ENV = "_CPKIT_CLUSTER_FAULT"


@dataclass(frozen=True)
class JobShape:
    """What the checks need to know about the job."""

    backend: str
    world_size: int
    nproc_per_node: int
    layout: CPLayout
    allow_cross_node_a2a: bool

    def a2a_fits(self, size: int) -> bool:
        """Whether an all-to-all group of `size` consecutive ranks stays inside one node."""
        return self.allow_cross_node_a2a or self.nproc_per_node % size == 0

    @property
    def a2a_sizes(self) -> list[int]:
        """Sizes of consecutive-rank all-to-all groups the checks may build (they fit a node)."""
        return [a for a in range(1, self.world_size + 1) if self.world_size % a == 0 and self.a2a_fits(a)]

    @property
    def inner_a2a(self) -> int:
        """The a2a level of the checks' own hierarchical groups: the largest fitting proper divisor."""
        return max([a for a in self.a2a_sizes if a < self.world_size] or [1])


@dataclass
class Check:
    """A check: the scenario run for every case, and how rank 0 sums up the values."""

    name: str
    scenario: Callable[[Any], Any]
    cases: list
    note: str = ""
    summarize: Optional[Callable[[list], str]] = None


def _ids(cases) -> str:
    return ", ".join(c["id"] for c in cases)


def _smoke(job: JobShape) -> Check:
    from cpkit.testing.scenarios.groups import groups_case

    lay = job.layout
    case = dict(id=f"tp{lay.tp}-pp{lay.pp}-cp{lay.cp}", tp=lay.tp, pp=lay.pp, cp=lay.cp,
                cp_comm_type=lay.cp_comm_type, hier=lay.hierarchical_context_parallel_sizes)
    return Check("smoke", groups_case, [case],
                 summarize=lambda values: "groups match MCore and all-reduce on every group: "
                                          + "; ".join(values[0]))


def _attention(job: JobShape) -> Check:
    from cpkit.testing.scenarios.attention import attention_case, cluster_cases

    with_a2a = job.a2a_fits(job.world_size)
    note = "" if with_a2a else (f"a2a over all {job.world_size} ranks spans nodes: not run "
                                "(--allow-cross-node-a2a runs it); ")
    return Check("attention", attention_case,
                 cluster_cases(job.backend, job.world_size, job.inner_a2a, with_a2a=with_a2a), note)


def _hierarchical(job: JobShape) -> Check:
    from cpkit.testing.scenarios.hierarchical import cluster_cases, hierarchical_case

    sizes = job.a2a_sizes if job.world_size == 4 else [1, job.inner_a2a]
    return Check("hierarchical", hierarchical_case, cluster_cases(job.backend, job.world_size, sizes))


def _eval_cp(job: JobShape) -> Check:
    from cpkit.testing.scenarios.eval_cp import cluster_cases, eval_cp_scenario

    return Check("eval-cp", eval_cp_scenario, cluster_cases(job.backend, job.world_size, job.a2a_sizes))


def _dynamic_cp(job: JobShape) -> Check:
    from cpkit.testing.scenarios.dynamic_cp import cluster_cases, dynamic_case

    return Check("dynamic-cp", dynamic_case, cluster_cases(job.backend, job.world_size, job.a2a_sizes))


def _bench_attention(job: JobShape) -> Check:
    """The attention benchmark's own cells (cpkit.bench.attention.attention.run_cells), tiny on CPU."""
    from cpkit.bench.attention.attention import Settings, build_cases, render, run_cells

    gpu = job.backend == "nccl"
    world = job.world_size
    comms = ["p2p", "all_gather"] + (["a2a"] if job.a2a_fits(world) else []) + ["a2a+p2p"]
    base = 8 if gpu else 2
    kv_heads = base if base % world == 0 else world * -(-base // world)  # a2a over the world divides them
    seq = 32768 if gpu else 2 * world * max(1, 128 // world)
    settings = Settings(heads=max(32, kv_heads) if gpu else 2 * kv_heads, head_dim=128 if gpu else 16,
                        batch=1, dtype="bf16" if gpu else "fp32", device="cuda" if gpu else "cpu",
                        warmup=3 if gpu else 1, iters=10 if gpu else 2, hcp_a2a=job.inner_a2a,
                        world_size=world)
    cells = build_cases(["cpkit", "sdpa"], comms, [kv_heads], [world], [seq], job.inner_a2a, te_ok=False)

    def bench(case):
        results = run_cells(cells, settings)
        if results is None:  # ranks other than 0
            return None
        bad = [r for r in results if r["error"]]
        assert not bad, "cells failed: " + "; ".join(f"{r['backend']} {r['comm']}: {r['error']}" for r in bad)
        return render(results, [seq], "cuda" if gpu else "cpu")

    return Check("bench-attention", bench, [dict(id=f"{len(cells)}-cells-seq{seq}")],
                 summarize=lambda values: f"TFLOP/s per {'GPU' if gpu else 'rank'} (heads {settings.heads}, head dim "
                                          f"{settings.head_dim}, {settings.dtype}):\n{values[0]}")


_BUILDERS = {"smoke": _smoke, "attention": _attention, "hierarchical": _hierarchical,
             "eval-cp": _eval_cp, "dynamic-cp": _dynamic_cp, "bench-attention": _bench_attention}


def build_check(name: str, job: JobShape) -> Check:
    """The check `name` (one of CHECKS) for this job."""
    return _BUILDERS[name](job)


def run_check(check: Check, rank: int) -> dict:
    """Run every case of `check` on this rank, in order; raises at the first failing case (its id
    added to the message). Returns {"passed": True, "detail", "seconds"}."""
    if not check.cases:
        raise AssertionError(f"no case of {check.name} fits this job's world size and nodes")
    start = time.perf_counter()
    values = []
    with GroupReuse() as reuse:  # cases that ask for the same groups get them again, not new ones
        for case in check.cases:
            reuse.new_case()
            values.append(_run_case(check, case, rank))
    detail = check.summarize(values) if check.summarize else f"{len(check.cases)} case(s) passed: {_ids(check.cases)}"
    return {"passed": True, "detail": check.note + detail, "seconds": round(time.perf_counter() - start, 3)}


def _run_case(check: Check, case: dict, rank: int):
    fault = os.environ.get(FAULT_ENV, "")
    if fault == f"{check.name}:{rank}":
        raise RuntimeError(f"fault injected through {FAULT_ENV} on rank {rank} in {check.name}")
    if fault == f"{check.name}:{rank}:hang":
        time.sleep(1e6)
    try:
        return check.scenario(case)
    except BaseException as exc:
        exc.add_note(f"in case {case['id']} of check {check.name}")
        raise
