"""Which start-up failures of a rank group are worth one more try.

gloo's TCP transport occasionally fails to wire its full mesh while the ranks join
(`Gloo connectFullMesh failed ... Connection closed by peer`, also seen in PyTorch's own
ProcessGroupGloo tests, pytorch/pytorch#53270), more often on a loaded 2-core machine. No user
code has run yet, so starting the ranks again with a fresh store hides nothing under test.
A rank that dies while joining without a word (an exit code, nothing on its stderr: seen once
on 2x H200 at 4aade59, exit code 255, NCCL) is likewise retried once: it said nothing a retry
could hide. Anything else that fails while the ranks join (an NCCL error, a bad device, an import
error in the rank) is reported as it is, and so is a second failure of either kind.
"""

from __future__ import annotations

import sys

from cpkit.harness.rank_stderr import SILENT_EXIT

__all__ = ["START_ATTEMPTS", "is_transient_rendezvous", "note_retry"]

START_ATTEMPTS = 2
"""A transient failure while joining (gloo's mesh, a rank's silent death) is retried once; a
second one is reported."""

_GLOO_MESH_FAILURE = "Gloo connectFullMesh failed"


def is_transient_rendezvous(backend: str, error_text: str) -> bool:
    """True for gloo's own mesh failure while the process group is created, and for a rank
    that died while joining and wrote nothing (any backend)."""
    silent = error_text.strip().endswith(SILENT_EXIT) and "died with exit code" in error_text
    return silent or (backend == "gloo" and _GLOO_MESH_FAILURE in error_text)


def note_retry(what: str, error_text: str) -> None:
    """Say on stderr that `what` is started again, quoting the failure's last line."""
    last = (error_text.strip().splitlines() or [""])[-1]
    print(f"cpkit: {what}: a rank failed while joining ({last.strip()[:200]}); "
          "starting the ranks again once", file=sys.stderr, flush=True)
