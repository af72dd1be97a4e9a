"""Where one training step's time goes, per micro-batch, without a synchronization in the step.

The runtime's micro-batch loop (cpkit.dynamic.runtime.forward_backward_local, `recorder=`)
calls `start(mb)` before a micro-batch's forward and `stop()` once its backward is launched;
the step calls `open()` where its forward + backward begins and `close()` after the last
micro-batch (and any wait after it) is launched. Each mark takes the host's perf_counter and,
on CUDA, records a timing event on the current stream: recording is asynchronous, so the GPU
runs as it would without it. After the step's final synchronize, `records()` gives per
micro-batch:

- cp, samples, tokens (the group's, unpadded) and local_tokens (this rank's, padded); cp None
  for an idle slot (the zero-loss backward);
- host_s: host seconds from start to stop: launching the forward and backward, and any host
  sync inside them;
- gpu_s: stream seconds between the two events (None without CUDA);
- gap_s: seconds from the previous stop (the first: from open) to this start, on the stream
  where there are events, else on the host;

and the step's tail_s (the last stop to close: a lockstep wait after the last micro-batch) and
span_s (open to close), so that span_s = sum(gap_s) + sum(gpu_s) + tail_s on CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["MicrobatchTimeline"]


@dataclass(frozen=True)
class _Mark:
    host: float
    event: Any  # a timing event on the stream, None without CUDA


class MicrobatchTimeline:
    """Marks of one step (module docstring). `device`: the step's; `event_factory`: makes a
    timing event with record() and elapsed_time() in ms (default on CUDA:
    torch.cuda.Event(enable_timing=True); none on CPU: host times only)."""

    def __init__(self, device: Any, event_factory: Optional[Callable[[], Any]] = None):
        if event_factory is None and torch.device(device).type == "cuda":
            event_factory = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._event_factory = event_factory
        self._open: Optional[_Mark] = None
        self._close: Optional[_Mark] = None
        self._microbatches: list[list] = []  # [info, start mark, stop mark or None]

    def _mark(self) -> _Mark:
        event = None
        if self._event_factory is not None:
            event = self._event_factory()
            event.record()  # the current stream; no wait
        return _Mark(time.perf_counter(), event)

    def open(self) -> None:
        """The step's forward + backward begins."""
        self._open = self._mark()

    def start(self, mb: Any) -> None:
        """Micro-batch `mb` (a cpkit.dynamic.runtime.LocalMicrobatch, None: idle) begins.
        Reads only host-side sizes: no device value, so no sync."""
        if mb is None:
            info = {"cp": None, "samples": 0, "tokens": 0, "local_tokens": 0}
        else:
            info = {"cp": mb.assignment.cp_size, "samples": len(mb.assignment.samples),
                    "tokens": sum(mb.packed.seq_lens), "local_tokens": int(mb.batch["tokens"].shape[-1])}
        self._microbatches.append([info, self._mark(), None])

    def stop(self) -> None:
        """The micro-batch started last has launched its backward."""
        if not self._microbatches or self._microbatches[-1][2] is not None:
            raise RuntimeError("MicrobatchTimeline.stop() without a start()")
        self._microbatches[-1][2] = self._mark()

    def close(self) -> None:
        """The step's forward + backward is launched (before its synchronize)."""
        self._close = self._mark()

    @staticmethod
    def _between(a: Optional[_Mark], b: Optional[_Mark]) -> Optional[float]:
        """Seconds from a to b: on the stream where both carry events, else on the host."""
        if a is None or b is None:
            return None
        if a.event is not None and b.event is not None:
            return a.event.elapsed_time(b.event) / 1e3
        return b.host - a.host

    def records(self) -> dict:
        """{"microbatches": [...], "tail_s", "span_s"} (module docstring); call after the
        step's synchronize (an event's time is read only once it has run)."""
        out, previous = [], self._open
        for info, start, stop in self._microbatches:
            if stop is None:
                raise RuntimeError("MicrobatchTimeline.records(): a micro-batch was started, never stopped")
            gpu = self._between(start, stop) if start.event is not None else None
            out.append({**info, "host_s": stop.host - start.host, "gpu_s": gpu,
                        "gap_s": self._between(previous, start)})
            previous = stop
        return {"microbatches": out, "tail_s": self._between(previous, self._close),
                "span_s": self._between(self._open, self._close)}
