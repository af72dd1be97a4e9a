"""Small facts about process groups that every layer of cpkit needs, defined once."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["group_size"]


def group_size(group: Any) -> int:
    """Size of `group`: 1 for None (no group), the product for a hierarchical [a2a, p2p] list,
    else `group.size()` (a ProcessGroup, or a stand-in with the same method in unit tests)."""
    if group is None:
        return 1
    if isinstance(group, (list, tuple)):
        return math.prod(group_size(g) for g in group)
    return int(group.size())
