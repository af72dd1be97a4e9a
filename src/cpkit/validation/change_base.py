"""Where `cpkit validate --changed` takes the change from: git's diff against BASE, or the
coverage map's stored hashes compared with the files on disk.

git needs the history: the merge base with main, HEAD~1, or BASE itself. A `git clone --depth 1`
(CI's default) or a copy without `.git` has none of that and may lack the commit the map was
measured at. There the change is what differs from the map (coverage_map.drift_since: per
function, from the hashes the map stores), which is the change a full clone would see when the
map is at HEAD; the selection is then by function, as there. `change_base` says which it used
and why, for the report.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cpkit.validation.changed_selection import changed_since_map
from cpkit.validation.coverage_map import load_map

__all__ = ["ChangeBase", "change_base", "changed_paths", "changed_lines", "git", "history_gap", "GIT", "MAP_HASHES"]

GIT = "git"
MAP_HASHES = "coverage map hashes"


def git(root: Path, *args: str) -> str | None:
    """git's stdout, or None when it fails or git is not installed."""
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def _uncommitted(root: Path) -> bool:
    """True when the checkout has staged, unstaged or untracked (not ignored) changes."""
    return bool((git(root, "status", "--porcelain") or "").strip())


def changed_paths(root: Path, base: str | None) -> tuple[str, list[str]]:
    """(base commit, repository paths changed since it: committed, staged, unstaged, untracked).
    Raises ValueError when `root` is not a git checkout or the base does not resolve."""
    if git(root, "rev-parse", "--git-dir") is None:
        raise ValueError(f"--changed needs a git checkout; {root} is not one")
    if base is None:
        on_main = (git(root, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() == "main"
        found = None if on_main else git(root, "merge-base", "HEAD", "main")
        if not found:
            # On main itself (or without main): the change being made is the uncommitted one when
            # there is any (HEAD~1 would re-run the last commit's tests too), else the last commit.
            found = git(root, "rev-parse", "HEAD" if _uncommitted(root) else "HEAD~1")
        if found is None:
            raise ValueError("--changed: no branch main to diff against and no parent commit; pass BASE")
        base = found.strip()
    elif git(root, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}") is None:
        shallow = (git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true"
        raise ValueError(f"--changed {base}: not a commit in this repository"
                         + ("; this clone is shallow: fetch more history (git fetch --unshallow) or run "
                            "--changed without BASE to select from the coverage map's hashes" if shallow else ""))
    diff = git(root, "diff", "--name-only", "--no-renames", base, "--") or ""
    untracked = git(root, "ls-files", "--others", "--exclude-standard") or ""
    return base, sorted({p for p in (diff + untracked).splitlines() if p.strip()})


_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", re.M)


def changed_lines(root: Path, base: str, path: str) -> set[int] | None:
    """Line numbers of repository `path` (as it is now) that differ from `base`; a deletion
    marks the lines either side of it. None when git shows no hunk (an untracked file)."""
    diff = git(root, "diff", "-U0", "--no-renames", base, "--", path) or ""
    out: set[int] = set()
    for start, count in _HUNK.findall(diff):
        start, count = int(start), 1 if count == "" else int(count)
        out.update(range(start, start + count) if count else (start, start + 1))
    return out if _HUNK.search(diff) else None


def history_gap(root: Path) -> str | None:
    """Why git's history cannot serve as the base of a `--changed` without BASE at `root`
    (not a checkout; the map's commit missing, as in a shallow clone), or None when it can."""
    if git(root, "rev-parse", "--git-dir") is None:
        return "not a git checkout"
    try:
        cmap = load_map(root)
    except (ValueError, KeyError, TypeError, OSError):
        return None  # select_changed reports an unreadable map
    if cmap is None or not cmap.commit:
        return None
    if git(root, "cat-file", "-e", f"{cmap.commit}^{{commit}}") is None:
        shallow = (git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true"
        return (f"the history lacks the coverage map's commit {cmap.commit[:12]}"
                + (" (a shallow clone)" if shallow else ""))
    return None


@dataclass
class ChangeBase:
    """The change `--changed` selects for: `base` (a commit, or the map's commit), the changed
    repository `paths`, per changed cpkit module its changed `lines` (None: untracked; empty:
    the map's drift decides), `source` (GIT or MAP_HASHES) and `why` that source."""

    base: str
    paths: list[str]
    lines: dict[str, set[int] | None]
    source: str
    why: str

    def describe(self) -> str:
        return f"{self.source} ({self.why})"


def _modules(paths: list[str]) -> list[str]:
    return [p for p in paths if p.startswith("src/cpkit/") and p.endswith(".py")]


def change_base(root: Path, base: str | None) -> ChangeBase:
    """The change since `base` by git's diff; with no `base` where the history cannot give it
    (history_gap, or no merge base, parent or HEAD to diff against), the change since the
    coverage map by its hashes. Raises ValueError when neither can (no map, and no history)."""
    gap = None if base else history_gap(root)
    if gap is None:
        try:
            found, paths = changed_paths(root, base)
            return ChangeBase(found, paths, {p: changed_lines(root, found, p) for p in _modules(paths)}, GIT,
                              f"diff against {found[:12]}")
        except ValueError as exc:
            if base:
                raise
            gap = str(exc)
    since = changed_since_map(root)
    if since is None:
        raise ValueError(f"--changed: {gap}, and there is no readable coverage map to compare with; pass BASE "
                         "or record the map with `cpkit validate --record-map`")
    commit, paths = since
    return ChangeBase(commit, paths, {p: set() for p in _modules(paths)}, MAP_HASHES,
                      f"{gap}: the files compared with the map's per-function hashes")
