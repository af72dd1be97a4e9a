"""Whether a recorded result still holds: a follow-up's `last_result` names the commit it was
measured at; it is stale when a file its covering tests cover changed since that commit, where
"cover" is what `cpkit validate --changed` runs for a changed path: the change map's rows and the
import graph (src/cpkit/validation/change_map.py::select_tests).

A measured claim (a card's `claims:`) is judged the same way from its commit: stale when any file
of the code its command ran changed (derived, src/cpkit/cards/claim_scope.py), or an `about` entry
(a test's selection as above, a source path by itself; ChangeIndex.claim_freshness).

"Changed since the commit" comes from the commit's content snapshot (src/cpkit/cards/snapshot.py,
written by `cpkit cards record`) compared with the files on disk, so a copy without git history
gets a definite answer; where the clone also has the commit, `git diff --name-only COMMIT`
(uncommitted changes included) is added as a second opinion. With neither, the staleness is
"unknown", never fresh."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from cpkit.cards.claim_scope import claim_scope, recorded_code
from cpkit.cards.nodes import CLUSTER_PREFIX, node_file
from cpkit.cards.snapshot import changed_on_disk, find_snapshot
from cpkit.validation.change_map import select_tests

__all__ = ["FRESH", "STALE", "UNKNOWN", "SNAPSHOT", "GIT_DIFF", "TEST_ROOTS", "Freshness", "ChangeIndex", "head_commit"]

FRESH, STALE, UNKNOWN = "fresh", "stale", "unknown"


@dataclass(frozen=True)
class Freshness:
    """`state` (fresh, stale or unknown), why, the changed paths under the tests (stale), and
    `basis`: what "changed since" was read from (SNAPSHOT, GIT_DIFF or both; empty: unknown)."""

    state: str
    why: str
    changed: tuple[str, ...] = ()
    basis: str = ""

    def to_dict(self) -> dict:
        """JSON-able form, as status reports carry it."""
        return {"state": self.state, "why": self.why, "changed": list(self.changed), "basis": self.basis}


#: Freshness.basis: the commit's snapshot (a copy without the history has only it), git's diff.
SNAPSHOT, GIT_DIFF = "its snapshot", "git diff"


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def head_commit(root: str | Path) -> str | None:
    """The short commit of HEAD in the checkout at `root`, or None without git or a checkout."""
    proc = _git(Path(root), "rev-parse", "--short=12", "HEAD")
    return proc.stdout.strip() if proc is not None and proc.returncode == 0 else None


class ChangeIndex:
    """Changed paths since a commit and the test files each one selects, for the checkout at
    `root`; git is asked once per commit, the change map once per path."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        probe = _git(self.root, "rev-parse", "--is-inside-work-tree")
        self.git_error = None if probe is not None and probe.returncode == 0 else (
            "git is not installed" if probe is None else "no git checkout here")
        self._since: dict[str, tuple[tuple[str, ...] | None, str]] = {}
        self._basis: dict[str, str] = {}
        self._selects: dict[str, tuple[frozenset[str], bool]] = {}

    def changed_since(self, commit: str) -> tuple[tuple[str, ...] | None, str]:
        """(paths changed since `commit`, committed or not; None when unknown, with the reason)."""
        if commit not in self._since:
            self._since[commit] = self._diff(commit)
        return self._since[commit]

    def _diff(self, commit: str) -> tuple[tuple[str, ...] | None, str]:
        snapshot = find_snapshot(self.root, commit)
        by_git, git_why = self._git_diff(commit)
        self._basis[commit] = " and ".join(b for b, used in ((SNAPSHOT, snapshot is not None),
                                                             (GIT_DIFF, by_git is not None)) if used)
        if snapshot is None:
            return by_git, git_why
        return tuple(sorted(set(changed_on_disk(self.root, snapshot)) | set(by_git or ()))), ""

    def _git_diff(self, commit: str) -> tuple[tuple[str, ...] | None, str]:
        if self.git_error:
            return None, f"{self.git_error} and no snapshot of {commit} under cards/_snapshots"
        known = _git(self.root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
        if known is None or known.returncode != 0:
            return None, (f"commit {commit} is not in this clone (shallow, or from another branch) and "
                          "cards/_snapshots has no snapshot of it")
        diff = _git(self.root, "diff", "--name-only", "--no-renames", commit, "--")
        if diff is None or diff.returncode != 0:
            return None, f"git diff {commit} failed: {(diff.stderr if diff else '').strip()}"
        return tuple(p for p in diff.stdout.splitlines() if p), ""

    def _selected(self, path: str) -> tuple[frozenset[str], bool]:
        if path not in self._selects:
            sel = select_tests([path], self.root)
            self._selects[path] = (frozenset(sel.files), sel.everything)
        return self._selects[path]

    def covers(self, path: str, test_file: str) -> bool:
        """True when a change of `path` selects `test_file` (src/cpkit/validation/change_map.py::select_tests)."""
        files, everything = self._selected(path)
        return everything or test_file in files or any(f.endswith("/") and test_file.startswith(f) for f in files)

    def freshness(self, commit: str, nodes: list[str] | tuple[str, ...], paths: tuple[str, ...] = ()) -> Freshness:
        """Whether a result measured at `commit` for the tests `nodes` (node ids or files) still
        holds; `paths` (files, or folders ending in `/`) are code it also stands on directly."""
        changed, why = self.changed_since(commit)
        if changed is None:
            return Freshness(UNKNOWN, why)
        files = sorted({node_file(n) for n in nodes})
        under = tuple(p for p in changed if any(self.covers(p, f) for f in files) or any(_within(p, s) for s in paths))
        what = "its code" if paths else "its tests"
        basis = self._basis.get(commit, "")
        if under:
            return Freshness(STALE, f"{len(under)} file{'s' * (len(under) != 1)} under {what} changed since {commit}",
                             under, basis)
        return Freshness(FRESH, f"nothing under {what} changed since {commit}", basis=basis)

    def claim_freshness(self, commit: str, about: tuple[str, ...] | list[str], command: str = "",
                        evidence: str = "") -> Freshness:
        """Whether a claim measured at `commit` still holds: stale when a file of the code its
        command ran changed (src/cpkit/cards/claim_scope.py::claim_scope, with what its evidence
        recorded), or one its `about` entries name (a source file or folder itself; a test node
        id or file through what a change of the path selects, as for a follow-up's tests)."""
        tests = tuple(a for a in about if a.startswith(TEST_ROOTS) or a.startswith(CLUSTER_PREFIX))
        paths = {a.split("::", 1)[0] for a in about if a not in tests}
        if command:
            paths.update(claim_scope(command, self.root, recorded_code(self.root, evidence) if evidence else ()))
        return self.freshness(commit, tests, tuple(sorted(paths)))


#: Where test files live: an `about` entry under these is a test, any other a path of code.
TEST_ROOTS = ("tests/", "functional/")


def _within(path: str, anchor_path: str) -> bool:
    """True when `path` is the file `anchor_path` or lies under the folder it names."""
    return path == anchor_path or path.startswith(anchor_path.rstrip("/") + "/")
