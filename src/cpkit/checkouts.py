"""The identity of an upstream checkout (Megatron-LM, Megatron-Bridge) that a run used.

A checkout's commit, read from its .git without running git (cpkit.dynamic.mlm.checkout_commit:
also an archive unpacked with its .git/HEAD, as scripts/upstream-unpack.sh does). A tree with no
commit to read (a copy without .git) is named by its content instead: "content-<16 hex>", a
sha256 over the relative paths and bytes of its .py files, so two runs on the same code say so
whatever the copy.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["UPSTREAM_ENVS", "checkout_identity", "content_fingerprint", "upstream_identities"]

#: The variables that name the upstream checkouts cpkit's tests and benches run.
UPSTREAM_ENVS = {"megatron_lm": "CPKIT_MLM_SRC", "megatron_bridge": "CPKIT_BRIDGE_SRC"}


def content_fingerprint(root: str | os.PathLike) -> str:
    """sha256 (16 hex) over the sorted relative paths and bytes of the .py files under `root`."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py") if ".git" not in p.relative_to(root).parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def checkout_identity(root: str | os.PathLike) -> str:
    """The commit of the checkout at `root` (or of its parent: Bridge is given as <checkout>/src),
    else "content-<fingerprint>" of `root`'s Python files."""
    from cpkit.dynamic.mlm import checkout_commit

    root = Path(root)
    for candidate in (root, root.parent):
        commit = checkout_commit(candidate)
        if commit != "unknown":
            return commit
    return f"content-{content_fingerprint(root)}"


def upstream_identities(environ=None) -> dict[str, str]:
    """{name: identity} of each upstream checkout named in the environment (UPSTREAM_ENVS), for
    evidence folders and bench JSON; a path that does not exist says so."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, var in UPSTREAM_ENVS.items():
        path = environ.get(var)
        if path:
            out[name] = checkout_identity(path) if Path(path).is_dir() else f"missing: {var}={path}"
    return out
