"""Agreement between the ranks of a torchrun job on each check's outcome, through the job's
TCPStore rather than collectives, so that a rank stuck in a collective cannot block it.

Every rank posts its outcome of a check under `<check>/done/<rank>`; a failing rank also bumps
`<check>/failed`. A watchdog thread per rank ends a rank that is still inside the check when
another rank has failed (after a short grace) or when the check's timeout has passed: it posts
"aborted" or "timed out" with the rank's own stack, rank 0 writes the report from whatever the
store holds, and every rank exits 1. So a raising rank ends the job within the grace, a hung one
within the timeout, and both are named in the report.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

import torch.distributed as dist

__all__ = ["Coordinator", "store_barrier"]

POLL_S = 0.2


def _client(timeout_s: float = 60.0):
    """A client of the job's TCPStore (torchrun's, at MASTER_ADDR:MASTER_PORT), keys prefixed by
    the run, so that a restarted job starts clean."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    prefix = f"cpkit-cluster/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/" \
             f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return dist.PrefixStore(prefix, store)


def store_barrier(key: str, world_size: int, timeout_s: float) -> None:
    """Wait until `world_size` ranks reached `key` (or `timeout_s` passed), through the store:
    no process group needed. Used so that no rank exits, and has torchrun stop the others,
    before rank 0 has printed why."""
    store = _client()
    store.add(key, 1)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and store.add(key, 0) < world_size:
        time.sleep(POLL_S)


def _main_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"


class Coordinator:
    """One per rank. `on_abort(check, outcomes)` runs on rank 0 before an abort exits the
    process (it writes the report); `outcomes` maps rank -> outcome dict or None."""

    def __init__(self, rank: int, world_size: int, *, grace_s: float, on_abort: Callable[[str, dict], None]):
        self.rank, self.world_size, self.grace_s, self.on_abort = rank, world_size, grace_s, on_abort
        # one client per thread: a blocked call in one must not hold the other's lock
        self._store, self._watch_store = _client(), _client()
        self._lock = threading.Lock()
        self._check: Optional[str] = None
        self._deadline = 0.0
        self._posted = False
        threading.Thread(target=self._watch, name="cpkit-cluster-watchdog", daemon=True).start()

    # --------------------------------------------------------------------------- main thread

    def begin(self, check: str, timeout_s: float) -> None:
        """This rank enters `check`; the watchdog now guards it."""
        with self._lock:
            self._check, self._deadline, self._posted = check, time.monotonic() + timeout_s, False

    def finish(self, check: str, outcome: dict) -> dict:
        """Post this rank's outcome ({"passed", "detail", "seconds"}) and wait for every rank's:
        returns rank -> outcome, None for a rank that posted nothing by the deadline (+ grace)."""
        with self._lock:
            posted = self._posted
            self._posted = True
        if not posted:
            self._post(self._store, check, outcome)
        outcomes = self._collect(self._store, check, self._deadline + self.grace_s)
        with self._lock:
            self._check = None
        return outcomes

    def report_written(self) -> None:
        """Rank 0: the report is on disk; the other ranks may exit."""
        self._store.set("report_written", "1")

    def wait_for_report(self, timeout_s: float) -> None:
        """Other ranks: exit only once rank 0 wrote the report (or after `timeout_s`), so that
        torchrun does not stop rank 0 while it writes."""
        self._wait_key(self._store, "report_written", timeout_s)

    # ----------------------------------------------------------------------------- helpers

    def _post(self, store, check: str, outcome: dict) -> None:
        store.set(f"{check}/done/{self.rank}", json.dumps(outcome))
        if not outcome["passed"]:
            store.add(f"{check}/failed", 1)

    def _collect(self, store, check: str, deadline: float) -> dict:
        keys = {r: f"{check}/done/{r}" for r in range(self.world_size)}
        while time.monotonic() < deadline and not store.check(list(keys.values())):
            time.sleep(POLL_S)
        return {r: json.loads(store.get(k)) if store.check([k]) else None for r, k in keys.items()}

    def _wait_key(self, store, key: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not store.check([key]):
            time.sleep(POLL_S)

    # ---------------------------------------------------------------------------- watchdog

    def _watch(self) -> None:
        failed_since = None
        while True:
            time.sleep(POLL_S)
            with self._lock:
                check, deadline, posted = self._check, self._deadline, self._posted
            if check is None or posted:
                failed_since = None
                continue
            now = time.monotonic()
            if failed_since is None and self._watch_store.add(f"{check}/failed", 0) > 0:
                failed_since = now
            if failed_since is not None and now - failed_since >= self.grace_s:
                self._abort(check, "aborted: another rank failed while this rank was still in the "
                                   f"check (stuck in a collective?); this rank's stack:\n{_main_stack()}")
            elif now > deadline:
                self._abort(check, f"timed out: still in the check after its timeout; this rank's "
                                   f"stack:\n{_main_stack()}")

    def _abort(self, check: str, detail: str) -> None:
        with self._lock:
            if self._posted:  # the main thread finished meanwhile
                return
            self._posted = True
        store = self._watch_store
        self._post(store, check, {"passed": False, "detail": f"rank {self.rank}: {detail}", "seconds": None})
        try:
            if self.rank == 0:
                outcomes = self._collect(store, check, time.monotonic() + self.grace_s)
                self.on_abort(check, outcomes)
                store.set("report_written", "1")
            else:
                self._wait_key(store, "report_written", 3 * self.grace_s)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
