"""A page-extent allocator: free space as extents, best-fit runs, merging on free.

Free space is kept twice: by address (a sorted list of extent starts plus a map start ->
length, for merging neighbours and for "is this page free?") and by size (a sorted list of the
distinct free lengths, each with its starts in address order). Allocation takes the smallest
free extent that holds the whole request (one contiguous run, best fit; the lowest address
among equals); otherwise it takes the largest extents first, which yields the fewest runs.
Freed extents merge with free neighbours, so a pool whose pages were all returned is one free
extent again. A best-fit allocation or a free is O(log extents) look-ups plus list inserts
(memmoves), so a fragmented pool stays fast; nothing is per page or per token. Not
thread-safe: one owner (the event loop).
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Hands out page runs ``(start, length)`` from ``capacity_pages`` pages."""

    def __init__(self, capacity_pages: int) -> None:
        assert capacity_pages >= 0
        self.capacity_pages = capacity_pages
        self._starts: list[int] = []  # free extent starts, ascending
        self._lengths: dict[int, int] = {}  # free extent start -> length
        self._sizes: list[int] = []  # distinct free extent lengths, ascending
        self._by_size: dict[int, list[int]] = {}  # length -> starts of that length, ascending
        self.free_pages = 0
        if capacity_pages:
            self.free(0, capacity_pages)

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents ``(start, length)`` in address order (a copy)."""
        return [(s, self._lengths[s]) for s in self._starts]

    @property
    def largest_free_extent_pages(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def allocate(self, num_pages: int) -> list[tuple[int, int]] | None:
        """Take ``num_pages`` pages as runs, or return ``None`` (and change nothing) if short."""
        assert num_pages > 0
        if num_pages > self.free_pages:
            return None
        start = self.allocate_run(num_pages)  # best fit: the smallest extent that holds it all
        if start is not None:
            return [(start, num_pages)]
        sizes = self._sizes
        runs = []
        needed = num_pages
        for length in reversed(sizes):  # the largest extents first: the fewest runs
            for start in self._by_size[length]:
                take = min(needed, length)
                runs.append((start, take))
                needed -= take
                if not needed:
                    break
            if not needed:
                break
        for start, take in runs:
            self._take(start, take)
        runs.sort()
        return runs

    def allocate_run(self, num_pages: int) -> int | None:
        """Take one contiguous run of ``num_pages`` (best fit) and return its start, or
        ``None`` (changing nothing) if no free extent holds it."""
        assert num_pages > 0
        sizes = self._sizes
        i = bisect.bisect_left(sizes, num_pages)
        if i == len(sizes):
            return None
        start = self._by_size[sizes[i]][0]
        self._take(start, num_pages)
        return start

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

    def _bucket_add(self, length: int, start: int) -> None:
        bucket = self._by_size.get(length)
        if bucket is None:
            self._by_size[length] = [start]
            bisect.insort(self._sizes, length)
        elif start > bucket[-1]:
            bucket.append(start)
        else:
            bisect.insort(bucket, start)

    def _bucket_remove(self, length: int, start: int) -> None:
        bucket = self._by_size[length]
        if len(bucket) == 1:
            del self._by_size[length]
            del self._sizes[bisect.bisect_left(self._sizes, length)]
        else:
            del bucket[bisect.bisect_left(bucket, start)]

    def _resize(self, old_start: int, old_length: int, new_start: int, new_length: int) -> None:
        """Move the size index entry of one free extent (its address slot is the caller's)."""
        sizes, by_size = self._sizes, self._by_size
        bucket = by_size[old_length]
        if len(bucket) == 1 and new_length not in by_size:
            j = bisect.bisect_left(sizes, old_length)
            low, high = ((new_length, old_length) if new_length < old_length
                         else (old_length, new_length))
            if (j == 0 or sizes[j - 1] < low) and (j + 1 == len(sizes) or sizes[j + 1] > high):
                # Alone at its length before and after, with no length in between: it keeps
                # its slot (the common case when one large extent feeds many allocations).
                sizes[j] = new_length
                del by_size[old_length]
                by_size[new_length] = bucket
                bucket[0] = new_start
                return
        self._bucket_remove(old_length, old_start)
        self._bucket_add(new_length, new_start)

    def _take(self, start: int, num_pages: int) -> None:
        """Take the first ``num_pages`` of the free extent at ``start``."""
        length = self._lengths.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if length > num_pages:  # the rest stays free, in the same place in address order
            rest = start + num_pages
            self._starts[i] = rest
            self._lengths[rest] = length - num_pages
            self._resize(start, length, rest, length - num_pages)
        else:
            del self._starts[i]
            self._bucket_remove(length, start)
        self.free_pages -= num_pages

    def free(self, start: int, num_pages: int) -> None:
        """Return one run; the caller guarantees it is allocated (the pool checks page states)."""
        assert num_pages > 0 and 0 <= start and start + num_pages <= self.capacity_pages
        starts, lengths = self._starts, self._lengths
        i = bisect.bisect_left(starts, start)
        prev_start = starts[i - 1] if i > 0 else None
        next_start = starts[i] if i < len(starts) else None
        assert next_start is None or start + num_pages <= next_start, "overlaps a free extent"
        assert prev_start is None or prev_start + lengths[prev_start] <= start
        self.free_pages += num_pages
        merge_next = next_start is not None and start + num_pages == next_start
        merge_prev = prev_start is not None and prev_start + lengths[prev_start] == start
        if merge_next and merge_prev:  # three extents become one
            next_length = lengths.pop(next_start)
            self._bucket_remove(next_length, next_start)
            del starts[i]
            prev_length = lengths[prev_start]
            lengths[prev_start] = prev_length + num_pages + next_length
            self._resize(prev_start, prev_length, prev_start, lengths[prev_start])
        elif merge_next:  # the next extent now starts here
            next_length = lengths.pop(next_start)
            starts[i] = start
            lengths[start] = num_pages + next_length
            self._resize(next_start, next_length, start, num_pages + next_length)
        elif merge_prev:
            prev_length = lengths[prev_start]
            lengths[prev_start] = prev_length + num_pages
            self._resize(prev_start, prev_length, prev_start, prev_length + num_pages)
        else:
            starts.insert(i, start)
            lengths[start] = num_pages
            self._bucket_add(num_pages, start)
