"""The repository a `cpkit` command works on, and the one rule that finds it."""

from __future__ import annotations

from pathlib import Path

__all__ = ["NotARepositoryError", "find_repo_root", "is_repo_root"]


class NotARepositoryError(RuntimeError):
    """No cpkit repository at or above the folder a command started in; the message says where
    it looked and how to point the command at one."""


def is_repo_root(folder: str | Path) -> bool:
    """True when `folder` holds a `pyproject.toml` next to `cards/` or `skills/`."""
    folder = Path(folder)
    return (folder / "pyproject.toml").is_file() and ((folder / "cards").is_dir() or (folder / "skills").is_dir())


def find_repo_root(start: str | Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: the current directory) that is a
    repository root (see is_repo_root). Raises NotARepositoryError when there is none."""
    start = Path(start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if is_repo_root(folder):
            return folder
    raise NotARepositoryError(
        f"{start} is not inside a cpkit repository (no folder at or above it holds pyproject.toml "
        "next to cards/ or skills/); run the command from a checkout or pass --root"
    )
