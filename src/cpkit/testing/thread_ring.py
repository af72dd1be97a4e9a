"""A KV ring whose ranks are threads of one process: cpkit's ring attention at any ring size in a
unit test, in milliseconds, with no process group.

`ThreadRing(n).run(fn)` calls `fn(comm)` on n threads at once, `comm` standing in for
`cpkit.attention.comm.RingComm` (`size`, `rank`, `exchange`), so the ring's own code
(`p2p.ring_forward`, `p2p.ring_backward`) runs unchanged; only the transport is in memory.
The transport is as strict as NCCL's: send and receive buffers contiguous and of one shape and
dtype (gloo accepts a shorter message into a longer buffer without a word), messages between
two ranks arrive in the order they were posted. Every exchange is logged per rank (`sent`), so
a test can assert what the ring moves at each step.

A rank that raises stops the others (their waits fail at once); a rank that waits longer than
`timeout` fails with TimeoutError naming the peer it waited for. `run` raises the first failing
rank's error, its rank in the message.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["ThreadRing", "ThreadRingComm"]

_POLL_S = 0.02


class ThreadRing:
    """n ring ranks as threads; `sent[r]` lists rank r's exchanges as (send shape, reverse)."""

    def __init__(self, size: int, timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"ThreadRing: size {size} must be >= 1")
        self.size = size
        self.timeout = timeout
        self.sent: list[list[tuple[tuple[int, ...], bool]]] = [[] for _ in range(size)]
        self._boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
        self._failed = threading.Event()

    def comm(self, rank: int) -> "ThreadRingComm":
        """The stand-in RingComm of `rank`."""
        return ThreadRingComm(self, rank)

    def run(self, fn: Callable[["ThreadRingComm"], Any]) -> list:
        """`fn(comm)` on every rank at once; the results in rank order. Raises the lowest failing
        rank's error (RuntimeError naming the rank, the error chained)."""
        results: list = [None] * self.size
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.comm(rank))
            except BaseException as exc:  # noqa: BLE001 - reported below with the rank
                errors[rank] = exc
                self._failed.set()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # A rank that failed on its own comes before the peers it stopped.
            own = [r for r, e in errors.items() if not isinstance(e, _PeerFailed)] or list(errors)
            rank = min(own)
            raise RuntimeError(f"ThreadRing rank {rank} of {self.size}: {errors[rank]!r}") from errors[rank]
        return results

    def _receive(self, source: int, rank: int) -> torch.Tensor:
        box = self._boxes[(source, rank)]
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return box.get(timeout=_POLL_S)
            except queue.Empty:
                if self._failed.is_set():
                    raise _PeerFailed(f"rank {rank}: stopped, another rank failed") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} waited {self.timeout:g} s for rank {source}") from None


class _PeerFailed(RuntimeError):
    """A wait given up because another rank failed."""


class ThreadRingComm:
    """One rank's view of a ThreadRing, with RingComm's `size`, `rank` and `exchange`."""

    def __init__(self, ring: ThreadRing, rank: int):
        self.ring, self.size, self.rank = ring, ring.size, rank

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False) -> "_Received":
        """Send `send` to the next rank (the previous with `reverse`) and receive `recv` from the
        other side; `wait()` on the result before reading `recv`."""
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("exchange: send and receive buffers must be contiguous")
        if send.shape != recv.shape or send.dtype != recv.dtype:
            raise ValueError(f"exchange: send {tuple(send.shape)} {send.dtype} and receive {tuple(recv.shape)} "
                             f"{recv.dtype} differ; a ring's peer sends what this rank sends")
        n = self.size
        to, source = ((self.rank - 1) % n, (self.rank + 1) % n) if reverse else ((self.rank + 1) % n,
                                                                                   (self.rank - 1) % n)
        self.ring.sent[self.rank].append((tuple(send.shape), reverse))
        self.ring._boxes[(self.rank, to)].put(send.clone())
        return _Received(self.ring, source, self.rank, recv)


class _Received:
    def __init__(self, ring: ThreadRing, source: int, rank: int, recv: torch.Tensor):
        self._ring, self._source, self._rank, self._recv = ring, source, rank, recv

    def wait(self) -> None:
        message = self._ring._receive(self._source, self._rank)
        if message.shape != self._recv.shape or message.dtype != self._recv.dtype:
            raise ValueError(f"rank {self._rank}: received {tuple(message.shape)} {message.dtype} from rank "
                             f"{self._source} into {tuple(self._recv.shape)} {self._recv.dtype}")
        self._recv.copy_(message)
