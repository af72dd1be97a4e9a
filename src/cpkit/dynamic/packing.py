"""Place one micro-batch's samples on aligned CP groups: buddy allocation, fill, then LPT.

Cost model and terms as in cpkit.dynamic.scheduler. W is the micro-batch's mean load per rank
(its total work / N) and cap = (1 + tolerance) * W. Every sample gets a target size k*: the
smallest power of two >= its need with w / k* <= cap, at most its span (the largest group in
which each rank still gets one of its tokens). A sample heavier than one rank's share thus gets
a group that shares its cost; a light one stays at its need.

Balanced placement (`_pack_balanced`):
1. Heavy samples (k* above the base size, min_cp_size), largest first, join an open group that
   still has room below W (best fit), else get a new block of size k* from a buddy allocator
   over the root blocks (a smaller one, down to the need, when none that large is left).
2. Light samples, heaviest first, fill the room left in heavy groups (best fit, so few large
   samples fill it), then go to the least-loaded base block (LPT). A light sample fills room
   only while enough samples remain to give every free base block one.
3. Groups double into idle buddy blocks while their span allows; then a group still above cap
   merges with its buddy block when that one merge brings it under cap.

Covering placement (`_pack_covering`), used only if the balanced one leaves ranks idle and this
one covers more: samples by span, largest first, each lead the largest free block within
[need, span]; the rest join the least-loaded group they fit.

Both raise Overflow when some sample fits nowhere within max_len tokens per rank.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

from cpkit.dynamic.plan import CPGroupAssignment

__all__ = ["Overflow", "BuddyAllocator", "pack_microbatch"]


class Overflow(Exception):
    """A micro-batch could not be packed within the memory limit: plan more micro-batches."""


class BuddyAllocator:
    """Aligned power-of-two blocks of [0, N) carved from the root blocks, lowest address first."""

    def __init__(self, roots: Sequence[tuple[int, int]]):
        self._free: dict[int, list[int]] = {}
        self._n_free = 0
        for first, size in roots:
            heapq.heappush(self._free.setdefault(size, []), first)
            self._n_free += size

    def alloc(self, size: int) -> int | None:
        """First position of a free block of exactly `size`, splitting a larger one; None if none."""
        candidates = [s for s, firsts in self._free.items() if s >= size and firsts]
        if not candidates:
            return None
        s = min(candidates)
        first = heapq.heappop(self._free[s])
        self._n_free -= size
        while s > size:  # keep the lower half, free the upper half (its buddy)
            s //= 2
            heapq.heappush(self._free.setdefault(s, []), first + s)
        return first

    def alloc_within(self, low: int, high: int) -> tuple[int, int] | None:
        """(first, size) of the largest free block of size in [low, high], splitting a larger
        free block down to `high` if needed; None if no free block is >= low."""
        sizes = [s for s, firsts in self._free.items() if firsts and s >= low]
        if not sizes:
            return None
        fitting = [s for s in sizes if s <= high]
        size = max(fitting) if fitting else high
        return self.alloc(size), size

    def free_ranks(self) -> int:
        """Number of ranks not yet allocated."""
        return self._n_free

    def drain(self, size: int) -> list[int]:
        """Split every free block into blocks of `size` (a power of two <= every free block);
        their first positions, ascending. The allocator is empty afterwards."""
        firsts = []
        for s, heap in self._free.items():
            for f in heap:
                firsts.extend(range(f, f + s, size))
            heap.clear()
        self._n_free = 0
        return sorted(firsts)


class _Group:
    """A CP group being filled: block [first, first + size), samples, total work, tokens per rank."""

    __slots__ = ("first", "size", "samples", "work", "tokens", "span")

    def __init__(self, first: int, size: int):
        self.first, self.size = first, size
        self.samples: list[int] = []
        self.work, self.tokens, self.span = 0.0, 0, 0


def _pow2_ceil(x: float) -> int:
    k = 1
    while k < x:
        k *= 2
    return k


class _Packing:
    """Groups of one micro-batch under construction, with the per-sample data they draw on."""

    def __init__(self, lens, works, needs, spans, roots, max_len, mean):
        self.lens, self.works, self.needs, self.spans = lens, works, needs, spans
        self.alloc = BuddyAllocator(roots)
        self.max_len, self.mean = max_len, mean
        self.groups: list[_Group] = []
        self.room: list[tuple[float, int]] = []  # (work below mean * size, group index), sorted

    def open(self, first: int, size: int) -> _Group:
        self.groups.append(_Group(first, size))
        return self.groups[-1]

    def tokens_if_added(self, g: _Group, i: int) -> int | None:
        """Tokens per rank that sample i adds to g, or None if it does not fit there."""
        if self.needs[i] > g.size:
            return None
        t = -(-self.lens[i] // g.size)
        return t if g.tokens + t <= self.max_len else None

    def add(self, g: _Group, i: int, tokens: int) -> None:
        g.samples.append(i)
        g.work += self.works[i]
        g.tokens += tokens
        g.span = max(g.span, self.spans[i])

    def lead(self, first: int, size: int, i: int) -> _Group:
        """Open a group on block [first, first + size) with sample i; track its room."""
        g = self.open(first, size)
        self.add(g, i, -(-self.lens[i] // size))
        left = self.mean * size - g.work
        if left > 0:
            bisect.insort(self.room, (left, len(self.groups) - 1))
        return g

    def join_room(self, i: int) -> bool:
        """Best fit of sample i into the room of an open group; True if placed."""
        room, w = self.room, self.works[i]
        pos = bisect.bisect_left(room, (w, -1))
        for j in range(pos, min(pos + 8, len(room))):  # a few tries: tokens rarely block
            gi = room[j][1]
            g = self.groups[gi]
            t = self.tokens_if_added(g, i)
            if t is not None:
                del room[j]
                self.add(g, i, t)
                left = self.mean * g.size - g.work
                if left > 0:
                    bisect.insort(room, (left, gi))
                return True
        return False

    def join_least_loaded(self, i: int) -> None:
        """Add sample i to the group whose load after it is lowest; Overflow if it fits none."""
        best = None
        for g in self.groups:
            t = self.tokens_if_added(g, i)
            if t is not None:
                load = (g.work + self.works[i]) / g.size
                if best is None or load < best[0]:
                    best = (load, g, t)
        if best is None:
            raise Overflow
        g = best[1]
        gi = self.groups.index(g)
        filed = [entry for entry in self.room if entry[1] == gi]
        if filed:  # its room shrinks: re-file it (rare path, so a linear scan is fine)
            self.room.remove(filed[0])
        self.add(g, i, best[2])
        left = self.mean * g.size - g.work
        if filed and left > 0:
            bisect.insort(self.room, (left, gi))


def _pack_balanced(bag, p: _Packing, base: int, cap: float) -> list[_Group]:
    works, needs, spans = p.works, p.needs, p.spans
    target = {}
    for i in bag:
        k = _pow2_ceil(works[i] / cap) if cap > 0 else 1
        target[i] = max(needs[i], base, min(k, spans[i]))
    heavy = sorted((i for i in bag if target[i] > base), key=lambda i: (-target[i], -works[i], i))
    light = sorted((i for i in bag if target[i] == base), key=lambda i: (-works[i], -p.lens[i], i))

    coverage = sum(spans[i] for i in bag)  # upper bound on the ranks unplaced samples can fill
    for i in heavy:
        coverage -= spans[i]
        if coverage >= p.alloc.free_ranks() and p.join_room(i):
            continue
        size = target[i]
        first = p.alloc.alloc(size)
        while first is None and size // 2 >= needs[i]:  # none that large is left: a smaller one
            size //= 2
            first = p.alloc.alloc(size)
        if first is None:
            p.join_least_loaded(i)
        else:
            p.lead(first, size, i)

    firsts = p.alloc.drain(base)
    start = len(p.groups)
    for f in firsts:
        p.open(f, base)
    heap = [(0.0, f, start + j) for j, f in enumerate(firsts)]  # (load, first, group index)
    empty = len(firsts)
    for pos, i in enumerate(light):
        if len(light) - pos - 1 >= empty and p.join_room(i):
            continue
        skipped, placed = [], False
        while heap and not placed:
            load, f, gi = heapq.heappop(heap)
            g = p.groups[gi]
            t = p.tokens_if_added(g, i)
            if t is None:
                skipped.append((load, f, gi))
                continue
            empty -= not g.samples
            p.add(g, i, t)
            heapq.heappush(heap, (g.work / g.size, f, gi))
            placed = True
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:
            p.join_least_loaded(i)
    return [g for g in p.groups if g.samples]


def _pack_covering(bag, p: _Packing) -> list[_Group]:
    order = sorted(bag, key=lambda i: (-p.spans[i], -p.needs[i], -p.works[i], i))
    for i in order:
        got = p.alloc.alloc_within(p.needs[i], p.spans[i]) if p.alloc.free_ranks() else None
        if got is None:
            p.join_least_loaded(i)
        else:
            p.lead(got[0], got[1], i)
    return [g for g in p.groups if g.samples]


def pack_microbatch(
    bag: Sequence[int],
    *,
    lens: Sequence[int],
    works: Sequence[float],
    needs: Sequence[int],
    spans: Sequence[int],
    roots: Sequence[tuple[int, int]],
    base: int,
    max_len: int,
    tolerance: float,
    cover_idle: bool = True,
) -> list[CPGroupAssignment]:
    """CP groups (ordered by first rank) running the samples in `bag` (algorithm: module doc).

    `spans[i]` is the largest group size in which sample i still gives every rank a token (>= its
    need); `base` is min_cp_size. `cover_idle=False` skips the covering placement (for spans the
    cost model capped: an idle rank is then cheaper than a wider group). Raises Overflow if a
    sample fits nowhere.
    """
    if not bag:
        return []
    n_ranks = sum(size for _, size in roots)
    mean = sum(works[i] for i in bag) / n_ranks
    cap = (1.0 + tolerance) * mean
    data = (lens, works, needs, spans, roots, max_len, mean)
    groups = _pack_balanced(bag, _Packing(*data), base, cap)
    covered = sum(g.size for g in groups)
    if covered < n_ranks:
        _grow_into_idle(groups, roots)
        covered = sum(g.size for g in groups)
    if covered < n_ranks and cover_idle:
        try:
            other = _pack_covering(bag, _Packing(*data))
        except Overflow:
            other = []
        _grow_into_idle(other, roots)
        if sum(g.size for g in other) > covered:
            groups = other
    groups = _merge_overloaded(groups, roots, cap, lens, max_len)
    return [
        CPGroupAssignment(
            ranks=tuple(range(g.first, g.first + g.size)),
            samples=tuple(sorted(g.samples)),
            cp_size=g.size,
        )
        for g in sorted(groups, key=lambda g: g.first)
    ]


def _root_end(roots: Sequence[tuple[int, int]], pos: int) -> int:
    return next(f + s for f, s in roots if f <= pos < f + s)


def _grow_into_idle(groups: list[_Group], roots: Sequence[tuple[int, int]]) -> None:
    """Double groups into idle buddy blocks while their span allows (tokens per rank only
    shrink). Repeats until no group can grow."""
    owned = [False] * sum(size for _, size in roots)
    for g in groups:
        owned[g.first:g.first + g.size] = [True] * g.size
    changed = True
    while changed:
        changed = False
        for g in groups:
            while g.span >= 2 * g.size:
                parent = g.first - g.first % (2 * g.size)  # roots are aligned to their size
                if parent + 2 * g.size > _root_end(roots, g.first):
                    break
                buddy = g.first ^ g.size
                if any(owned[buddy:buddy + g.size]):
                    break
                owned[buddy:buddy + g.size] = [True] * g.size
                g.first, g.size = parent, 2 * g.size
                changed = True


def _merge_overloaded(
    groups: list[_Group],
    roots: Sequence[tuple[int, int]],
    cap: float,
    lens: Sequence[int],
    max_len: int,
) -> list[_Group]:
    """Most loaded first, merge a group above `cap` with everything in its buddy block into one
    group of twice the size, when that brings it under cap, fits the tokens and its span.
    Returns the surviving groups."""
    owner: list[_Group | None] = [None] * sum(size for _, size in roots)
    for g in groups:
        owner[g.first:g.first + g.size] = [g] * g.size
    alive = {id(g) for g in groups}
    heap = [(-g.work / g.size, g.first, g.size, id(g), g) for g in groups]
    heapq.heapify(heap)
    while heap:
        neg, first, size, _, g = heapq.heappop(heap)
        if id(g) not in alive or (g.first, g.size) != (first, size):
            continue  # stale entry
        if -neg <= cap:
            break
        parent = first - first % (2 * size)
        if parent + 2 * size > _root_end(roots, first):
            continue
        buddy = first ^ size
        members = []
        for r in range(buddy, buddy + size):
            h = owner[r]
            if h is not None and (not members or members[-1] is not h):
                members.append(h)
        samples = g.samples + [i for h in members for i in h.samples]
        span = max([g.span] + [h.span for h in members])
        tokens = sum(-(-lens[i] // (2 * size)) for i in samples)
        work = g.work + sum(h.work for h in members)
        if work / (2 * size) > cap or span < 2 * size or tokens > max_len:
            continue  # one merge would not bring it under cap (or not fit): leave it
        for h in members:
            alive.discard(id(h))
        g.first, g.size, g.samples = parent, 2 * size, samples
        g.work, g.tokens, g.span = work, tokens, span
        owner[parent:parent + 2 * size] = [g] * (2 * size)
        heapq.heappush(heap, (-work / g.size, g.first, g.size, id(g), g))
    return [g for g in groups if id(g) in alive]
