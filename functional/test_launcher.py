"""The multi-rank launcher itself: results, failures named by rank, timeouts, case grids."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from cpkit.testing import LaunchTimeout, RankFailure, device, dist_params, launch, run_cases


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.getpid()


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from {bad_rank}")
    dist.barrier()  # the healthy rank waits here until the launcher stops it
    return "unreachable"


def _hang_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(600)
    return dist.get_rank()


def _case(case):
    t = torch.ones(1)
    dist.all_reduce(t)
    # Failures come after the collectives, like a correctness assertion at the end of a case.
    if case == "fail-rank1" and dist.get_rank() == 1:
        raise AssertionError("mismatch on rank 1")
    if case == "fail-all":
        raise AssertionError(f"mismatch on rank {dist.get_rank()}")
    return (case, t.item())


def _all_reduce_on_device():
    dev = device()
    t = torch.full((4,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(t)
    return str(dev), t.cpu().tolist()


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.dist
def test_results_come_back_per_rank_and_no_process_survives():
    out = launch(_rank_and_sum, 2, timeout=120)
    assert [(r, s) for r, s, _ in out] == [(0, 3.0), (1, 3.0)]
    time.sleep(0.2)
    assert not any(_pid_alive(pid) for _, _, pid in out)


@pytest.mark.dist
def test_raising_rank_is_named_with_traceback_and_others_stopped():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank, 2, args=(1,), timeout=120)
    assert info.value.rank == 1
    assert "rank 1 of 2 failed first" in str(info.value)
    assert "ValueError: boom from 1" in str(info.value)
    assert time.monotonic() - start < 60  # rank 0 was stopped, not left in its barrier


@pytest.mark.dist
def test_hanging_rank_fails_within_timeout_with_stack():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_rank, 2, args=(0,), timeout=15)
    assert time.monotonic() - start < 45
    assert info.value.hung_ranks == [0]
    assert "_hang_on_rank" in str(info.value)  # the stack dump names where it hangs


@pytest.mark.dist
def test_case_grid_reports_each_case_separately():
    cases = ["ok-a", "fail-all", "ok-b", "fail-rank1", "after"]
    res = run_cases(_case, cases, 2, timeout=120)
    assert res["ok-a"].check().values == {0: ("ok-a", 2.0), 1: ("ok-a", 2.0)}
    res["ok-b"].check()
    assert sorted(res["fail-all"].errors) == [0, 1]
    assert sorted(res["fail-rank1"].errors) == [1]
    with pytest.raises(AssertionError, match="mismatch on rank 1"):
        res["fail-rank1"].check()
    # After a one-sided failure the ranks may be out of step: later cases are not run.
    assert "not run" in res["after"].errors[0]


@pytest.mark.parametrize("backend,world_size", dist_params((2, 4)))
def test_all_reduce_smoke(backend, world_size):
    """NCCL (gpu2/gpu4) or gloo (dist) smoke test: each rank on its own device, right sum."""
    out = launch(_all_reduce_on_device, world_size, backend=backend, timeout=120)
    total = float(sum(range(1, world_size + 1)))
    assert [values for _, values in out] == [[total] * 4] * world_size
    expected = [f"cuda:{r}" for r in range(world_size)] if backend == "nccl" else ["cpu"] * world_size
    assert [dev for dev, _ in out] == expected
