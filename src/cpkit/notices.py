"""Warnings that cpkit's own processes hide: megatron-core notices the user cannot act on.

Every `cpkit` command and every rank a cpkit launch spawns printed megatron-core's import-time
notices that Transformer Engine and Apex are not installed (four per process, more once a model
is built), and MCore 0.16 warns at every TransformerConfig that its own default
`cuda_graph_scope="full"` is deprecated. On a CPU machine, or with cpkit's own attention, there
is nothing to do about them. `quiet_known_notices()` ignores exactly those messages (matched
from their start, UserWarning only) in this process; `child_warnoptions()` gives the same
filters to a new interpreter through PYTHONWARNINGS, for ranks that import MCore before any
cpkit code runs in them. Every other warning still shows.

`quiet_closed_stdout()` silences the other noise a command can end with: Python's complaint at
exit when the reader of its output left early (`cpkit cards status | head`).
"""

from __future__ import annotations

import os
import re
import sys
import warnings

__all__ = ["KNOWN_NOTICES", "child_warnoptions", "quiet_closed_stdout", "quiet_known_notices"]

KNOWN_NOTICES: tuple[str, ...] = (
    "Transformer Engine and Apex are not installed",  # MCore's import-time fallbacks
    "Apex is not installed. Falling back to Torch Norm",  # MCore's layer specs
    "full scope is deprecated. Use empty cuda_graph_scope",  # MCore 0.16's own default
)
"""The start of each hidden message, literally (as Python's -W option matches it)."""


def quiet_known_notices() -> None:
    """Ignore the KNOWN_NOTICES UserWarnings in this process (other warnings unchanged)."""
    for prefix in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=UserWarning)


def child_warnoptions(existing: str | None = None) -> str:
    """A PYTHONWARNINGS value with the KNOWN_NOTICES filters, after `existing` (the current
    value, kept; a later entry wins over an earlier one for the same warning)."""
    ours = [f"ignore:{prefix}:UserWarning" for prefix in KNOWN_NOTICES]
    return ",".join(([existing] if existing else []) + ours)


def quiet_closed_stdout() -> None:
    """Point stdout at /dev/null so that Python's exit-time flush of a closed pipe stays silent."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
