"""Content snapshots of the commits that cards' results were measured at, so that freshness is
definite without git history (a release archive, a `--depth 1` clone, an agent's one-commit copy).

`cpkit cards record` writes `cards/_snapshots/<commit>.json`: the git blob id (shortened) of every
tracked file at that commit, evidence/ and cards/ left out (recording a result edits cards/, and
evidence never selects a covering test). Comparing a snapshot with the files on disk gives the
paths changed since the commit (added and deleted ones included) with no git at all; git's own
diff, where the clone has the commit, is the second opinion (src/cpkit/cards/freshness.py).
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
from pathlib import Path

from cpkit.validation.code_hashes import git_blob_id

__all__ = ["SNAPSHOT_DIR", "blob_id", "snapshot_at", "write_snapshot", "find_snapshot", "changed_on_disk",
           "prune_snapshots"]

#: Where snapshots live, relative to the repository root (a `_` folder: not a card).
SNAPSHOT_DIR = "cards/_snapshots"
#: Leading hex digits of each blob id kept: collisions among a few hundred files are negligible.
_ID_DIGITS = 12
_LEFT_OUT = ("evidence/", "cards/")
#: Names never walked on disk besides the root .gitignore's: caches and compiled files.
_ALWAYS_IGNORED = ("__pycache__", "*.pyc", "*.pyo", ".git")


def blob_id(data: bytes) -> str:
    """git's blob id of `data` (src/cpkit/validation/code_hashes.py::git_blob_id), shortened."""
    return git_blob_id(data)[:_ID_DIGITS]


def _kept(path: str) -> bool:
    return not path.startswith(_LEFT_OUT)


def snapshot_at(root: Path, commit: str) -> dict[str, str]:
    """{path: shortened blob id} of the tracked files at `commit` in the clone at `root`.
    Raises ValueError when git cannot list that commit."""
    try:
        proc = subprocess.run(["git", "ls-tree", "-r", "--full-tree", commit], cwd=root,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"git ls-tree {commit} failed: {exc}") from None
    if proc.returncode != 0:
        raise ValueError(f"commit {commit} is not in the clone at {root}: {proc.stderr.strip()}")
    files = {}
    for line in proc.stdout.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob" and _kept(path):
            files[path] = sha[:_ID_DIGITS]
    return files


def write_snapshot(root: Path, commit: str) -> Path:
    """Write the snapshot of `commit` (from git) under SNAPSHOT_DIR; returns its path."""
    path = root / SNAPSHOT_DIR / f"{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"commit": commit, "left_out": list(_LEFT_OUT), "files": snapshot_at(root, commit)}
    path.write_text(json.dumps(body, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    return path


def find_snapshot(root: Path, commit: str) -> dict[str, str] | None:
    """The snapshot of `commit` (a snapshot named by a longer or shorter form of it matches), or
    None when the repository holds none."""
    folder = root / SNAPSHOT_DIR
    if not folder.is_dir():
        return None
    for file in sorted(folder.glob("*.json")):
        if file.stem.startswith(commit) or commit.startswith(file.stem):
            return json.loads(file.read_text(encoding="utf-8"))["files"]
    return None


def _ignore_patterns(root: Path) -> tuple[str, ...]:
    """Name patterns of the root .gitignore (a copy without git keeps the file): enough for the
    repository's own, which ignores by name (`.venv/`, `*.egg-info/`, `bench-results/`)."""
    try:
        lines = (root / ".gitignore").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    names = [ln.strip().strip("/") for ln in lines if ln.strip() and not ln.startswith(("#", "!"))]
    return (*_ALWAYS_IGNORED, *names)


def _on_disk(root: Path) -> dict[str, Path]:
    """The repository's files as a copy without git has them: every file not ignored by name."""
    ignored = _ignore_patterns(root)

    def keep(name: str) -> bool:
        return not any(fnmatch.fnmatch(name, pattern) for pattern in ignored)

    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if keep(d))
        for name in names:
            if keep(name):
                full = Path(folder) / name
                rel = full.relative_to(root).as_posix()
                if _kept(rel):
                    found[rel] = full
    return found


def changed_on_disk(root: Path, snapshot: dict[str, str]) -> tuple[str, ...]:
    """Paths whose content differs from `snapshot`, or that it lacks or has and the disk not."""
    disk = _on_disk(root)
    changed = {p for p, f in disk.items() if snapshot.get(p) != blob_id(f.read_bytes())}
    changed |= set(snapshot) - set(disk)
    return tuple(sorted(changed))


def prune_snapshots(root: Path, keep: set[str]) -> list[Path]:
    """Delete snapshots of commits no card's result names any more; returns the deleted files."""
    folder = root / SNAPSHOT_DIR
    gone = []
    for file in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if not any(file.stem.startswith(c) or c.startswith(file.stem) for c in keep):
            file.unlink()
            gone.append(file)
    return gone
