"""The identity of an upstream checkout (Megatron-LM, Megatron-Bridge) that a run used.

A checkout's commit, read from its .git without running git (`git_commit`:
also an archive unpacked with its .git/HEAD, as scripts/upstream-unpack.sh does). A tree with no
commit to read (a copy without .git) is named by its content instead: "content-<16 hex>", a
sha256 over the relative paths and bytes of its .py files, so two runs on the same code say so
whatever the copy.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["UPSTREAM_ENVS", "checkout_identity", "content_fingerprint", "git_commit", "upstream_identities"]

#: The variables that name the upstream checkouts cpkit's tests and benches run.
UPSTREAM_ENVS = {"megatron_lm": "CPKIT_MLM_SRC", "megatron_bridge": "CPKIT_BRIDGE_SRC"}


def content_fingerprint(root: str | os.PathLike) -> str:
    """sha256 (16 hex) over the sorted relative paths and bytes of the .py files under `root`."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py") if ".git" not in p.relative_to(root).parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]

def _git_dir(root: Path) -> Path | None:
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():  # a worktree or submodule: "gitdir: <path>"
        text = dot_git.read_text().strip()
        if text.startswith("gitdir:"):
            path = Path(text[len("gitdir:"):].strip())
            return path if path.is_absolute() else (root / path).resolve()
    return None


def git_commit(root: str | os.PathLike) -> str:
    """The commit the checkout at `root` has checked out, read from its .git without running git
    (a linked worktree, packed refs and a detached HEAD included); "unknown" for a tree without
    .git or an unreadable one."""
    git_dir = _git_dir(Path(root))
    if git_dir is None:
        return "unknown"
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or "unknown"
        ref = head[len("ref:"):].strip()
        common = git_dir
        if (git_dir / "commondir").is_file():  # a linked worktree keeps refs in the common dir
            common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
        for base in (git_dir, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
        for base in (git_dir, common):
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1] == ref:
                        return parts[0]
    except OSError:
        pass
    return "unknown"


def checkout_identity(root: str | os.PathLike) -> str:
    """The commit of the checkout at `root` (or of its parent: Bridge is given as <checkout>/src),
    else "content-<fingerprint>" of `root`'s Python files."""
    root = Path(root)
    for candidate in (root, root.parent):
        commit = git_commit(candidate)
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
