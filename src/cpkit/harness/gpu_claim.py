"""Host-wide GPU claims for NCCL launches: a launch of n ranks holds n GPUs of its own for as
long as it runs, so that independent 2-GPU launches (xdist workers, two pytest sessions) run
side by side on a 4-GPU host while a 4-GPU launch waits for all four.

One lock file per GPU (fcntl.flock: the kernel drops it when the holder dies, so a crash never
leaks a claim), named by the GPU's id in CUDA_VISIBLE_DEVICES (or its index), in one directory
per user. A claim takes an aligned block of n GPUs ([0, 1] or [2, 3] for n = 2), each block
tried without waiting, so that no waiting claim holds a GPU. A claim whose block is the only
one (all 4 GPUs for n = 4) first takes the host's wait lock, which keeps new smaller claims from
starting, then its GPUs in order as they come free: a stream of small launches cannot starve it,
and nothing deadlocks (only these claims wait while holding, one at a time, in one order).

Slots (CPKIT_GPU_SLOTS, default 1): how many launches may share one GPU. Each slot is a host of
its own to the rules above (its own lock files and wait lock), so on a 2-GPU host, where every
2-rank launch needs the whole host, S slots let S of them run side by side, as the rank pools
beside them already do; one slot keeps every launch on GPUs of its own where every process of
the host claims with one slot (a process with fewer slots does not see claims in the others).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from typing import Iterator, Sequence


__all__ = ["CLAIM_ENV", "LOCK_DIR_ENV", "SLOTS_ENV", "claim_gpus", "gpu_slots", "visible_gpu_ids"]

CLAIM_ENV = "CPKIT_GPU_CLAIM"
"""'0' turns claims off: every NCCL launch then sees every GPU (rank r on cuda:r), as before."""
LOCK_DIR_ENV = "CPKIT_GPU_LOCK_DIR"
"""Where the lock files live (default: <tmp>/cpkit-gpu-locks-<uid>); one directory per host."""
SLOTS_ENV = "CPKIT_GPU_SLOTS"
"""How many NCCL launches may share one GPU (an integer >= 1; default 1: a launch's GPUs are its own)."""


def gpu_slots() -> int:
    """CPKIT_GPU_SLOTS as an integer >= 1 (1 where unset); ValueError naming the value and a fix."""
    raw = os.environ.get(SLOTS_ENV, "").strip()
    if not raw:
        return 1
    try:
        slots = int(raw)
    except ValueError:
        slots = 0
    if slots < 1:
        raise ValueError(f"{SLOTS_ENV}={raw!r}: must be an integer >= 1 (launches that may share one GPU); "
                         f"fix: {SLOTS_ENV}=1 (each launch on GPUs of its own), or unset it")
    return slots


def visible_gpu_ids(count: int) -> list[str]:
    """The ids of this process's `count` visible GPUs as CUDA_VISIBLE_DEVICES names them (an
    index, a UUID or MIG id), or "0".."count-1" where it is unset."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or not env.strip():
        return [str(i) for i in range(count)]
    return [x.strip() for x in env.split(",") if x.strip()][:count]


def _lock_dir() -> str:
    path = os.environ.get(LOCK_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"cpkit-gpu-locks-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _try_lock(path: str, wait: bool):
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        fh.close()
        return None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}\n")
    fh.flush()
    return fh


def _holders(paths: Sequence[str]) -> str:
    out = []
    for p in paths:
        try:
            with open(p) as fh:
                out.append(f"{os.path.basename(p)}: {fh.read().strip() or '?'}")
        except OSError:
            out.append(f"{os.path.basename(p)}: ?")
    return "; ".join(out)


def _whole_block_free(path: str) -> bool:
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True  # closing the file drops the shared lock


def _all_or_none(paths: Sequence[str]) -> list:
    """Every lock of `paths` taken without waiting, or none of them (an empty list)."""
    held = []
    for path in paths:
        fh = _try_lock(path, wait=False)
        if fh is None:
            for taken in held:
                taken.close()
            return []
        held.append(fh)
    return held


def _slot_files(folder: str, gpu_ids: Sequence[str], slot: int) -> tuple[list[str], str]:
    """(a lock file per GPU, the wait lock) of one slot; slot 0 keeps the names of one slot."""
    tag = "" if slot == 0 else f".slot{slot}"
    return ([os.path.join(folder, "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", g) + tag + ".lock") for g in gpu_ids],
            os.path.join(folder, f"whole-host{tag}.wait"))


@contextlib.contextmanager
def claim_gpus(n: int, gpu_ids: Sequence[str], *, timeout_s: float = 1800.0,
               poll_s: float = 0.1, slots: int | None = None) -> Iterator[list[str]]:
    """Hold `n` of `gpu_ids` (an aligned block) in one of `slots` (default: gpu_slots()) until the
    block exits; yields their ids, to be the ranks' CUDA_VISIBLE_DEVICES. Waits while other claims
    hold them; TimeoutError naming the holders after `timeout_s`. ValueError when `n` exceeds the
    GPUs there are."""
    if not 1 <= n <= len(gpu_ids):
        raise ValueError(f"a launch of {n} NCCL ranks needs {n} GPUs, found {len(gpu_ids)} "
                         f"({', '.join(gpu_ids) or 'none'}): launch fewer ranks or on a bigger host")
    slots = gpu_slots() if slots is None else slots
    if slots < 1:
        raise ValueError(f"slots={slots}: must be >= 1 (launches that may share one GPU); fix: slots=1")
    folder = _lock_dir()
    files = [_slot_files(folder, gpu_ids, s) for s in range(slots)]
    blocks = [list(range(b * n, (b + 1) * n)) for b in range(len(gpu_ids) // n)]
    deadline = time.monotonic() + timeout_s
    held: list = []
    chosen: list[int] = []
    slot = 0

    def expired() -> bool:
        if time.monotonic() > deadline:
            holders = "; ".join(_holders(paths) for paths, _ in files)
            raise TimeoutError(f"no {n} free GPUs of {list(gpu_ids)} after {timeout_s:.0f} s; "
                               f"held by: {holders} (lock files in {folder})")
        time.sleep(poll_s)
        return True

    try:
        if len(blocks) == 1:  # a slot whose block is free now, else first in line for one slot's
            while not held:
                for slot, (paths, wait_lock) in enumerate(files):
                    held = _all_or_none([wait_lock, *paths])
                    if held:
                        chosen = blocks[0]
                        break
                else:
                    for slot, (_, wait_lock) in enumerate(files):
                        fh = _try_lock(wait_lock, wait=False)  # no new smaller claim starts in this slot
                        if fh is not None:
                            held.append(fh)
                            break
                    else:
                        expired()
        while not chosen:
            if len(blocks) == 1:  # take its GPUs in order, keeping what we have
                for i in blocks[0][len(held) - 1:]:
                    fh = _try_lock(files[slot][0][i], wait=False)
                    if fh is None:
                        break
                    held.append(fh)
                if len(held) == n + 1:
                    chosen = blocks[0]
            else:
                for paths, wait_lock in files:
                    if not _whole_block_free(wait_lock):  # a whole-block claim waits or runs there
                        continue
                    for block in blocks:
                        held = _all_or_none([paths[i] for i in block])
                        if held:
                            chosen = block
                            break
                    if chosen:
                        break
            if not chosen:
                expired()
        yield [gpu_ids[i] for i in chosen]
    finally:
        for fh in held:
            fh.close()
