"""A page-extent allocator: free space as extents, best-fit runs, merging on free.

Free space is a sorted list of extent starts plus a map start -> length. Allocation prefers the
smallest free extent that holds the whole request (one contiguous run, best fit); otherwise it
takes the largest extents first, which yields the fewest runs. Freed extents merge with free
neighbours, so a pool whose pages were all returned is one free extent again. Every operation is
O(free extents) or better; nothing is per token. Not thread-safe: one owner (the event loop).
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Hands out page runs ``(start, length)`` from ``capacity_pages`` pages."""

    def __init__(self, capacity_pages: int) -> None:
        assert capacity_pages >= 0
        self.capacity_pages = capacity_pages
        self._starts: list[int] = [0] if capacity_pages else []
        self._lengths: dict[int, int] = {0: capacity_pages} if capacity_pages else {}
        self.free_pages = capacity_pages

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents ``(start, length)`` in address order (a copy)."""
        return [(s, self._lengths[s]) for s in self._starts]

    @property
    def largest_free_extent_pages(self) -> int:
        return max(self._lengths.values(), default=0)

    def allocate(self, num_pages: int) -> list[tuple[int, int]] | None:
        """Take ``num_pages`` pages as runs, or return ``None`` (and change nothing) if short."""
        assert num_pages > 0
        if num_pages > self.free_pages:
            return None
        best = None
        for start in self._starts:
            length = self._lengths[start]
            if length >= num_pages and (best is None or length < self._lengths[best]):
                best = start
                if length == num_pages:
                    break
        if best is not None:
            self._take(best, num_pages)
            return [(best, num_pages)]
        runs = []
        needed = num_pages
        for start in sorted(self._starts, key=self._lengths.__getitem__, reverse=True):
            take = min(needed, self._lengths[start])
            runs.append((start, take))
            needed -= take
            if not needed:
                break
        for start, take in runs:
            self._take(start, take)
        runs.sort()
        return runs

    def first_free(self, pages: range | list[int]) -> int | None:
        """The first of ``pages`` (in their order) that is free, or ``None`` if all are taken."""
        starts, lengths = self._starts, self._lengths
        if not starts:
            return None
        if type(pages) is range and pages.step == 1:
            if not pages:
                return None
            i = bisect.bisect_right(starts, pages.start) - 1  # the extent at or before start
            if i >= 0 and starts[i] + lengths[starts[i]] > pages.start:
                return pages.start
            if i + 1 < len(starts) and starts[i + 1] < pages.stop:
                return starts[i + 1]
            return None
        for page in pages:
            i = bisect.bisect_right(starts, page) - 1
            if i >= 0 and starts[i] + lengths[starts[i]] > page:
                return page
        return None

    def _take(self, start: int, num_pages: int) -> None:
        length = self._lengths.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if length == num_pages:
            del self._starts[i]
        else:
            self._starts[i] = start + num_pages
            self._lengths[start + num_pages] = length - num_pages
        self.free_pages -= num_pages

    def free(self, start: int, num_pages: int) -> None:
        """Return one run; the caller guarantees it is allocated (the pool checks page states)."""
        assert num_pages > 0 and 0 <= start and start + num_pages <= self.capacity_pages
        i = bisect.bisect_left(self._starts, start)
        prev_start = self._starts[i - 1] if i > 0 else None
        next_start = self._starts[i] if i < len(self._starts) else None
        assert next_start is None or start + num_pages <= next_start, "overlaps a free extent"
        assert prev_start is None or prev_start + self._lengths[prev_start] <= start
        self.free_pages += num_pages
        if next_start is not None and start + num_pages == next_start:
            num_pages += self._lengths.pop(next_start)
            del self._starts[i]
        if prev_start is not None and prev_start + self._lengths[prev_start] == start:
            self._lengths[prev_start] += num_pages
        else:
            self._starts.insert(i, start)
            self._lengths[start] = num_pages
