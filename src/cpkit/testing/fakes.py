"""Stand-in process group for unit tests: size, rank and global ranks, nothing else."""

from __future__ import annotations

__all__ = ["FakeGroup"]


class FakeGroup:
    """A stand-in process group over global `ranks`, in which this process is at position `rank`.

    Answers `size()` and `rank()` and exposes `.ranks`; it talks to no process, so it suits code that
    only reads a group's shape (group registries, rebinding tables), never a collective.
    """

    def __init__(self, ranks, rank=0):
        self.ranks = list(ranks)
        self._rank = rank

    def size(self):
        return len(self.ranks)

    def rank(self):
        return self._rank

    def __repr__(self):
        return f"FakeGroup({self.ranks})"
