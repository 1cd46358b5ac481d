"""A page-extent allocator: free space as extents, best-fit runs, merging on free.

Allocation takes the smallest free extent that holds the whole request (one contiguous run,
best fit; the lowest address among equals); otherwise it takes the largest extents first (the
lowest address among equals), which yields the fewest runs. Freed extents merge with free
neighbours, so a pool whose pages were all returned is one free extent again.

Free space is indexed so that no operation scans the free extents:

* by address, two maps: extent start -> length and extent end -> start. Merging a freed run
  with its neighbours is two dictionary look-ups (the extent ending where the run starts, the
  one starting where it ends);
* by size, segregated free lists: the distinct free lengths in a sorted list, and per length a
  min-heap of extent starts (lowest address first). A heap may hold stale starts (extents since
  merged or taken); they are dropped when they reach the top, and a heap is rebuilt when stale
  entries outnumber live ones, so each is paid for once. Disjoint extents of distinct lengths
  sum to at most the capacity, so there are fewer than ``sqrt(2 * capacity_pages)`` lengths
  (fewer than 885 for 391,000 pages) and the sorted list of them stays short;
* per page, a free map (one byte per page) answers "is this page free?" for the pool's
  ownership checks; it is updated with one slice assignment per run.

A best-fit allocation or a free is O(log holes): dictionary look-ups, heap operations, a bisect
over the lengths and at most one insert into or delete from that short list. Nothing is per
page except the free map's slice update, one ``memcpy`` of the run's length. Not thread-safe:
one owner (the event loop); nothing blocks.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heapify, heappop, heappush

#: A heap is rebuilt without its stale entries when it holds more than this many times its
#: live extents (plus a few): memory stays proportional to the free extents.
_STALE_FACTOR = 2
_STALE_SLACK = 16

#: Free-map values for short runs, made once (slicing a long buffer costs more than the copy).
_SHORT_RUN = 65
_ONES = tuple(b"\x01" * n for n in range(_SHORT_RUN))
_ZEROS = tuple(bytes(n) for n in range(_SHORT_RUN))


class ExtentAllocator:
    """Hands out page runs ``(start, length)`` from ``capacity_pages`` pages."""

    def __init__(self, capacity_pages: int) -> None:
        assert capacity_pages >= 0
        self.capacity_pages = capacity_pages
        self._by_start: dict[int, int] = {}  # free extent start -> length
        self._by_end: dict[int, int] = {}  # free extent end (exclusive) -> start
        self._sizes: list[int] = []  # distinct free extent lengths, ascending
        self._live: dict[int, int] = {}  # length -> number of free extents of that length
        self._heaps: dict[int, list[int]] = {}  # length -> min-heap of starts (some stale)
        self._free_map = bytearray(capacity_pages)  # 1 where the page is free
        self._ones = memoryview(b"\x01" * capacity_pages)
        self._zeros = memoryview(bytes(capacity_pages))
        self.free_pages = 0
        if capacity_pages:
            self.free(0, capacity_pages)

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents ``(start, length)`` in address order (a fresh list)."""
        return sorted(self._by_start.items())

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
        # No extent holds it all: whole extents, the largest first, until the last one that
        # is only partly needed. Taking whole extents creates none, so each step's largest
        # extent is the next in (length descending, address ascending) order.
        runs = []
        needed = num_pages
        while needed:
            length = self._sizes[-1]
            start = self._lowest_start(length)
            take = min(needed, length)
            self._take(start, length, take)
            runs.append((start, take))
            needed -= take
        runs.sort()
        return runs

    def allocate_run(self, num_pages: int) -> int | None:
        """Take one contiguous run of ``num_pages`` (best fit) and return its start, or
        ``None`` (changing nothing) if no free extent holds it."""
        assert num_pages > 0
        sizes = self._sizes
        i = bisect_left(sizes, num_pages)
        if i == len(sizes):
            return None
        length = sizes[i]
        start = self._lowest_start(length)
        self._take(start, length, num_pages)
        return start

    def first_free(self, pages: range | list[int]) -> int | None:
        """The first of ``pages`` (in their order) that is free, or ``None`` if all are taken.

        Pages outside ``[0, capacity_pages)`` count as taken."""
        free_map = self._free_map
        if type(pages) is range and pages.step == 1:
            page = free_map.find(1, max(pages.start, 0), max(pages.stop, 0))
            return None if page < 0 else page
        capacity = self.capacity_pages
        for page in pages:
            if 0 <= page < capacity and free_map[page]:
                return page
        return None

    def free(self, start: int, num_pages: int) -> None:
        """Return one run; the caller guarantees it is allocated (the pool checks page states)."""
        end = start + num_pages
        assert num_pages > 0 and 0 <= start and end <= self.capacity_pages
        self._free_map[start:end] = (_ONES[num_pages] if num_pages < _SHORT_RUN
                                     else self._ones[:num_pages])
        self.free_pages += num_pages
        by_start, by_end = self._by_start, self._by_end
        prev_start = by_end.pop(start, None)  # the free extent that ends where this run starts
        next_length = by_start.pop(end, None)  # the free extent that starts where it ends
        if next_length is not None:
            next_end = end + next_length
            if prev_start is not None:  # three extents become one
                self._unindex(end, next_length)
                prev_length = by_start[prev_start]
                by_start[prev_start] = next_end - prev_start
                by_end[next_end] = prev_start
                self._reindex(prev_start, prev_length, prev_start, next_end - prev_start)
            else:  # the next extent now starts here
                by_start[start] = next_end - start
                by_end[next_end] = start
                self._reindex(end, next_length, start, next_end - start)
        elif prev_start is not None:  # the previous extent now ends here
            prev_length = by_start[prev_start]
            by_start[prev_start] = end - prev_start
            by_end[end] = prev_start
            self._reindex(prev_start, prev_length, prev_start, end - prev_start)
        else:
            by_start[start] = num_pages
            by_end[end] = start
            self._index(start, num_pages)

    # --- the size index ---------------------------------------------------------------------

    def _lowest_start(self, length: int) -> int:
        """The lowest start among free extents of ``length`` (one must exist)."""
        heap = self._heaps[length]
        by_start = self._by_start
        while by_start.get(heap[0]) != length:
            heappop(heap)  # stale: that extent was merged or taken since
        return heap[0]

    def _index(self, start: int, length: int) -> None:
        """Add a free extent to the size index (its address entries are the caller's)."""
        count = self._live.get(length)
        if count is None:
            self._live[length] = 1
            self._heaps[length] = [start]
            insort(self._sizes, length)
            return
        self._live[length] = count + 1
        heap = self._heaps[length]
        heappush(heap, start)
        if len(heap) > _STALE_FACTOR * (count + 1) + _STALE_SLACK:
            by_start = self._by_start
            heap[:] = {s for s in heap if by_start.get(s) == length}
            heapify(heap)

    def _unindex(self, start: int, length: int) -> None:
        """Drop a free extent from the size index (its address entries are the caller's)."""
        count = self._live[length] - 1
        if count:
            self._live[length] = count
            heap = self._heaps[length]
            if heap[0] == start:
                heappop(heap)
            return
        del self._live[length], self._heaps[length]
        sizes = self._sizes
        del sizes[bisect_left(sizes, length)]

    def _reindex(self, old_start: int, old_length: int, new_start: int, new_length: int) -> None:
        """Move one free extent in the size index: it changed its start or length."""
        live = self._live
        if live[old_length] == 1 and new_length not in live:
            sizes = self._sizes
            j = bisect_left(sizes, old_length)
            low, high = ((new_length, old_length) if new_length < old_length
                         else (old_length, new_length))
            if (j == 0 or sizes[j - 1] < low) and (j + 1 == len(sizes) or sizes[j + 1] > high):
                # Alone at its length before and after, with no length in between (one large
                # extent feeding many allocations): it keeps its place in the sorted lengths.
                sizes[j] = new_length
                del live[old_length]
                live[new_length] = 1
                heaps = self._heaps
                heap = heaps.pop(old_length)  # its stale entries go with the old length
                heap.clear()
                heap.append(new_start)
                heaps[new_length] = heap
                return
        self._unindex(old_start, old_length)
        self._index(new_start, new_length)

    def _take(self, start: int, length: int, num_pages: int) -> None:
        """Take the first ``num_pages`` of the free extent of ``length`` pages at ``start``, the
        lowest start of its length (its heap's top, from :meth:`_lowest_start`)."""
        assert self._heaps[length][0] == start, "an extent taken from inside its heap"
        by_start = self._by_start
        del by_start[start]
        rest_length = length - num_pages
        live = self._live
        count = live[length] - 1
        end = start + length
        if rest_length and not count:  # alone at its length: it may keep its place (_reindex)
            rest = start + num_pages
            by_start[rest] = rest_length
            self._by_end[end] = rest
            self._reindex(start, length, rest, rest_length)
        else:
            # It leaves the size index (what _unindex does, knowing it is its heap's top: the
            # one call per allocation in a fragmented pool), and what is left of it joins.
            if count:
                live[length] = count
                heappop(self._heaps[length])
            else:
                del live[length], self._heaps[length]
                sizes = self._sizes
                del sizes[bisect_left(sizes, length)]
            if rest_length:
                rest = start + num_pages
                by_start[rest] = rest_length
                self._by_end[end] = rest
                self._index(rest, rest_length)
            else:
                del self._by_end[end]
        self._free_map[start:start + num_pages] = (_ZEROS[num_pages] if num_pages < _SHORT_RUN
                                                   else self._zeros[:num_pages])
        self.free_pages -= num_pages
