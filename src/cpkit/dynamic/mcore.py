"""MCore's dynamic ("hybrid") CP scheduler as a second implementation behind cpkit's plan type.

`megatron/core/pipeline_parallel/hybrid_cp_schedule.py::BalancedCPScheduler` (megatron-core >=
0.16) gives each sample its smallest power-of-two CP size and packs. `mcore_schedule` runs its
`get_groups_and_subsamples` on a stand-in DPxCP group of N ranks (the scheduler only asks the
group for its size) and converts the per-rank sample lists of every micro-batch into CP groups:
ranks that hold the same samples form one group. MCore runs a group's samples one after another
(a forward/backward each, hybrid_context_parallel_forward_backward), so the plan has
packed=False: memory holds one sample at a time and the cost model times them in turn. The result is checked like cpkit's plans
(cpkit.dynamic.invariants); nothing here repairs it.

A crash inside MCore becomes `SchedulerCrash` carrying the exception's last line; a call that
does not return within `timeout_s` seconds of CPU time (hangs were reported at non-power-of-two DPxCP sizes; its
outer loop never ends when no sample fits N) becomes `SchedulerCrash` too, on the main thread
of a POSIX process (elsewhere the call is not timed).
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Sequence

from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan

__all__ = ["MCORE_SCHEDULER", "SchedulerCrash", "groups_from_rank_lists", "mcore_schedule"]

MCORE_SCHEDULER = "megatron/core/pipeline_parallel/hybrid_cp_schedule.py::BalancedCPScheduler"


class SchedulerCrash(Exception):
    """The scheduler raised or did not return; `detail` is one line saying what happened.

    `hang`: it did not return in time; `inputs`: the call's arguments (the message repeats
    them), when the caller gave them; `error_type`: the class name of the exception upstream.
    """

    def __init__(self, detail: str, *, hang: bool = False, inputs: dict | None = None,
                 error_type: str | None = None):
        super().__init__(detail if inputs is None else f"{detail} (input: {inputs})")
        self.detail = detail
        self.hang = hang
        self.inputs = inputs
        self.error_type = error_type


class _StandInGroup:
    """The DPxCP process group as BalancedCPScheduler uses it: only its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        """Number of ranks."""
        return self._size


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that MCore's code cannot swallow it."""


@contextmanager
def _time_limit(seconds: float | None):
    """Raise _Timeout in the main thread after `seconds` of this process's CPU time (SIGPROF).
    CPU time, not wall time: a hang is a loop that keeps computing, while on a loaded host a
    millisecond call can wait longer than the limit for a core (a 0.5-s wall-clock alarm failed
    calls that never hung). A timer already set is restored afterwards with the time it had left."""
    if seconds is None or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        yield
        return

    def _raise(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGPROF, _raise)
    start = time.process_time()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_PROF, seconds)
    if 0 < outer_delay < seconds:  # the outer timer is due first: keep its deadline
        signal.setitimer(signal.ITIMER_PROF, outer_delay)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
        if outer_delay > 0:
            left = max(outer_delay - (time.process_time() - start), 1e-3)
            signal.setitimer(signal.ITIMER_PROF, left, outer_interval)


def _last_line(err: BaseException) -> str:
    lines = traceback.format_exception_only(type(err), err)
    text = "".join(lines).strip().splitlines()
    return text[-1] if text else type(err).__name__


def groups_from_rank_lists(
    per_rank: Sequence[Sequence[int]],
) -> tuple[CPGroupAssignment, ...]:
    """One micro-batch of per-rank sample lists as CP groups: ranks with the same sample list
    form one group (in first-rank order); idle ranks are in none."""
    by_samples: dict[tuple[int, ...], list[int]] = {}
    for rank, samples in enumerate(per_rank):
        if samples:
            by_samples.setdefault(tuple(int(s) for s in samples), []).append(rank)
    groups = [CPGroupAssignment(ranks=tuple(ranks), samples=tuple(sorted(samples)),
                                cp_size=len(ranks))
              for samples, ranks in by_samples.items()]
    return tuple(sorted(groups, key=lambda g: g.ranks[0]))


def mcore_schedule(
    seq_lens: Sequence[int],
    *,
    dp_cp_size: int,
    max_seq_len_per_rank: int,
    timeout_s: float | None = 10.0,
) -> Plan:
    """Plan `seq_lens` with MCore's BalancedCPScheduler on `dp_cp_size` ranks, as a cpkit Plan.

    Group sizes are the number of ranks holding each sample list (MCore's groups need not be
    aligned or powers of two; the invariant check reports it). `workloads` are MCore's own
    estimate at the needed size (L**2 / cp); `needed_cp_sizes` cpkit's cp_size_for. Raises
    SchedulerCrash for an exception inside MCore or a timeout, and ImportError when the
    installed megatron-core has no hybrid_cp_schedule.
    """
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from cpkit.dynamic.scheduler import cp_size_for

    lens = [int(L) for L in seq_lens]
    scheduler = BalancedCPScheduler(max_seq_len_per_rank, _StandInGroup(dp_cp_size))
    try:
        with _time_limit(timeout_s):
            _, sample_id_groups = scheduler.get_groups_and_subsamples(
                [(i, L) for i, L in enumerate(lens)], None)
    except _Timeout:
        raise SchedulerCrash(f"did not return within {timeout_s:g} s", hang=True) from None
    except Exception as err:  # any crash inside MCore is a finding, reported in one line
        raise SchedulerCrash(_last_line(err)) from None
    microbatches = tuple(Microbatch(groups=groups_from_rank_lists(per_rank))
                         for per_rank in sample_id_groups)
    needs = []
    for L in lens:
        try:
            needs.append(cp_size_for(L, max_seq_len_per_rank))
        except ValueError:
            needs.append(0)
    return Plan(
        microbatches=microbatches,
        seq_lens=tuple(lens),
        dp_cp_size=dp_cp_size,
        max_seq_len_per_rank=max_seq_len_per_rank,
        workloads=tuple(L * L / max(1, c) for L, c in zip(lens, needs)),
        needed_cp_sizes=tuple(needs),
        candidate="mcore",
        packed=False,
    )
