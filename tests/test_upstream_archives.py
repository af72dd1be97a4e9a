"""scripts/upstream-pack.sh packs the upstream code at the commits of scripts/upstream-pins.txt
(not at a branch an ordinary clone may lack), never leaves an empty archive behind a failure, and
scripts/upstream-unpack.sh unpacks again when the archive changed. Local git repositories, no network."""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}


def _pins() -> dict[str, list[str]]:
    rows = [line.split() for line in (ROOT / "scripts" / "upstream-pins.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return {row[0]: row[1:] for row in rows}


def test_the_pins_name_each_repository_branch_and_the_commit_the_recorded_runs_used():
    pins = _pins()
    assert pins["mlm"][:2] == ["NVIDIA/Megatron-LM", "dev"] and pins["bridge"][:2] == ["NVIDIA-NeMo/Megatron-Bridge", "main"]
    for name, (_, _, commit, _) in pins.items():
        assert re.fullmatch(r"[0-9a-f]{40}", commit), f"{name}: {commit} is not a full commit"
    latest = sorted((ROOT / "evidence").glob("*-2xH200-*/env.txt"))[-1].read_text()
    assert pins["mlm"][2] in latest and pins["bridge"][2] in latest, f"the pins differ from {latest}"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=GIT_ENV).stdout.strip()


def _upstream(tmp_path: Path, name: str, folder: str) -> tuple[Path, list[str]]:
    """A repository with two commits of folder/version.py (1, then 2): (path, [commit 1, commit 2])."""
    repo = tmp_path / name
    (repo / folder).mkdir(parents=True)
    _git(repo, "init", "-q")
    commits = []
    for version in ("1", "2"):
        (repo / folder / "version.py").write_text(f"V = {version}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", version)
        commits.append(_git(repo, "rev-parse", "HEAD"))
    return repo, commits


def _copy(tmp_path: Path) -> Path:
    """A checkout with only the scripts, so the archives land in tmp_path, not in this checkout."""
    copy = tmp_path / "cpkit"
    (copy / "scripts").mkdir(parents=True)
    for name in ("upstream-pack.sh", "upstream-unpack.sh"):
        shutil.copy(ROOT / "scripts" / name, copy / "scripts" / name)
    return copy


def _pack(copy: Path, pins: str, *checkouts: Path) -> subprocess.CompletedProcess:
    (copy / "pins.txt").write_text(pins)
    return subprocess.run(["bash", "scripts/upstream-pack.sh", *map(str, checkouts)], cwd=copy, capture_output=True,
                          text=True, env={**GIT_ENV, "UPSTREAM_PINS": "pins.txt", "UPSTREAM_CACHE": str(copy / "cache")},
                          timeout=120)


@needs_git
def test_pack_takes_the_pinned_commit_not_the_checkouts_head(tmp_path):
    mlm, mlm_commits = _upstream(tmp_path, "mlm", "megatron")
    bridge, bridge_commits = _upstream(tmp_path, "bridge", "src")
    copy = _copy(tmp_path)
    pins = f"mlm x/MLM dev {mlm_commits[0]} megatron\nbridge x/B main {bridge_commits[1]} src\n"
    proc = _pack(copy, pins, mlm, bridge)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(copy / ".upstream/mlm.tar.xz") as tar:
        assert tar.extractfile("megatron-lm/megatron/version.py").read() == b"V = 1\n"
    assert (copy / ".upstream/mlm.commit").read_text().strip() == mlm_commits[0]
    assert (copy / ".upstream/bridge.commit").read_text().strip() == bridge_commits[1]


@needs_git
def test_a_missing_commit_fails_and_keeps_the_previous_archive(tmp_path):
    mlm, mlm_commits = _upstream(tmp_path, "mlm", "megatron")
    bridge, bridge_commits = _upstream(tmp_path, "bridge", "src")
    copy = _copy(tmp_path)
    good = f"mlm x/MLM dev {mlm_commits[1]} megatron\nbridge x/B main {bridge_commits[1]} src\n"
    assert _pack(copy, good, mlm, bridge).returncode == 0
    before = (copy / ".upstream/mlm.tar.xz").read_bytes()
    proc = _pack(copy, good.replace(mlm_commits[1], "0" * 40), mlm, bridge)
    assert proc.returncode != 0 and f"has no commit {'0' * 40}" in proc.stderr
    assert (copy / ".upstream/mlm.tar.xz").read_bytes() == before and not list((copy / ".upstream").glob("*.part"))
    proc = _pack(copy, good.replace(mlm_commits[1], "dev"), mlm, bridge)
    assert proc.returncode == 2 and "mlm's commit 'dev' must be 40 hex digits" in proc.stderr


@needs_git
def test_unpack_unpacks_again_when_the_archive_changed(tmp_path):
    mlm, mlm_commits = _upstream(tmp_path, "mlm", "megatron")
    bridge, bridge_commits = _upstream(tmp_path, "bridge", "src")
    copy = _copy(tmp_path)
    unpacked = tmp_path / "unpacked"
    show = ('source scripts/upstream-unpack.sh && cat "$CPKIT_MLM_SRC/megatron/version.py" '
            '"$CPKIT_MLM_SRC/.git/HEAD" && echo "$CPKIT_BRIDGE_SRC"')
    for commit, version in ((mlm_commits[0], "1"), (mlm_commits[1], "2")):
        assert _pack(copy, f"mlm x/MLM dev {commit} megatron\nbridge x/B main {bridge_commits[0]} src\n",
                     mlm, bridge).returncode == 0
        out = subprocess.run(["bash", "-c", show], cwd=copy, capture_output=True, text=True, check=True,
                             env={**GIT_ENV, "UPSTREAM_ROOT": str(unpacked)}).stdout.split()
        assert out == ["V", "=", version, commit, f"{unpacked}/megatron-bridge/src"]
