"""The device page table: which device pages are free, and the LRU of evictable segments.

Pages are handed out lowest-first, so a segment's pages tend to form runs (fewer, larger
copies). A segment is *evictable* while it is resident and no step in flight uses it; the LRU
holds exactly those, least recently used first. Loop thread only; every method is O(pages).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from .segments import Segment


class DeviceCache:
    def __init__(self, device_pages: int) -> None:
        if device_pages < 1:
            raise ValueError(f"device_pages must be >= 1, got {device_pages}")
        self.capacity_pages = device_pages
        self._free = np.ones(device_pages, dtype=bool)
        self._free_pages = device_pages
        self._lru: OrderedDict[Segment, None] = OrderedDict()

    # --- pages ------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self._free_pages

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - self._free_pages

    def allocate(self, num_pages: int) -> np.ndarray:
        """Take ``num_pages`` free pages (lowest first), ``int64 [num_pages]``."""
        if num_pages > self._free_pages:
            raise RuntimeError(f"device cache: {num_pages} pages asked, {self._free_pages} free")
        pages = np.flatnonzero(self._free)[:num_pages].astype(np.int64)
        self._free[pages] = False
        self._free_pages -= num_pages
        return pages

    def free(self, pages: np.ndarray) -> None:
        """Return ``pages``; each must be in use."""
        if pages.size == 0:
            return
        if self._free[pages].any():
            raise RuntimeError(f"device cache: page {int(pages[self._free[pages]][0])} freed twice")
        self._free[pages] = True
        self._free_pages += int(pages.size)

    # --- the LRU of evictable segments ------------------------------------------------------

    def touch(self, segment: Segment) -> None:
        """Mark ``segment`` evictable and most recently used."""
        self._lru.pop(segment, None)
        self._lru[segment] = None

    def discard(self, segment: Segment) -> None:
        """``segment`` is no longer evictable (pinned, leaving, or gone)."""
        self._lru.pop(segment, None)

    def __contains__(self, segment: Segment) -> bool:
        return segment in self._lru

    def evictable(self) -> Iterator[Segment]:
        """Evictable segments, least recently used first (a snapshot: safe to change while
        iterating)."""
        return iter(list(self._lru))

    @property
    def evictable_pages(self) -> int:
        return sum(s.num_pages for s in self._lru)
