"""Host handles the workload holds: an LRU of segments with a host copy, in-flight holds, and
releasing the least recently used ones when the service runs short of host pages.

A handle that a prefetch of ours still reads is *held*; it is never released while held (the
service would refuse: its pages are in flight). Dropping a held handle defers its release until
the last hold ends. ``reclaim`` is what the service's ``on_host_pressure`` hook calls, on the
loop: it releases unheld handles, least recently used first, until enough pages are free.
Loop thread only.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable

from ..errors import PagesInFlightError
from ..host_memory.pool import HostPages
from .segments import Segment

log = logging.getLogger(__name__)


class HostCache:
    """``release``: returns a handle to the pool (``OffloadService.release``)."""

    def __init__(self, release: Callable[[HostPages], None]) -> None:
        self._release = release
        self._lru: OrderedDict[Segment, None] = OrderedDict()
        self._holds: Counter[int] = Counter()  # allocation id -> prefetches reading it
        self._deferred: dict[int, HostPages] = {}  # dropped while held
        self.released_handles = 0
        self.released_pages = 0
        self.reclaimed_pages = 0  #: released because the service ran short of host pages
        self.refused_releases = 0  #: the service said in flight although nothing of ours held it

    # --- the LRU ----------------------------------------------------------------------------

    def touch(self, segment: Segment) -> None:
        """``segment`` holds a host copy and was just used."""
        assert segment.host is not None
        self._lru.pop(segment, None)
        self._lru[segment] = None

    def forget(self, segment: Segment) -> None:
        self._lru.pop(segment, None)

    @property
    def segments(self) -> int:
        return len(self._lru)

    # --- holds and releases -----------------------------------------------------------------

    def hold(self, handle: HostPages) -> None:
        self._holds[handle.allocation_id] += 1

    def unhold(self, handle: HostPages) -> None:
        key = handle.allocation_id
        self._holds[key] -= 1
        assert self._holds[key] >= 0
        if self._holds[key] == 0:
            del self._holds[key]
            deferred = self._deferred.pop(key, None)
            if deferred is not None:
                self._release_now(deferred)

    def is_held(self, handle: HostPages) -> bool:
        return self._holds.get(handle.allocation_id, 0) > 0

    def drop(self, handle: HostPages) -> None:
        """Give ``handle`` back to the pool now, or once the last hold on it ends."""
        if self.is_held(handle):
            self._deferred[handle.allocation_id] = handle
        else:
            self._release_now(handle)

    def _release_now(self, handle: HostPages) -> None:
        try:
            self._release(handle)
        except PagesInFlightError:
            # Our holds cover every copy of ours that reads a handle; the service still sees a
            # copy: keep the handle and retry when asked to release everything.
            self.refused_releases += 1
            log.warning("the service refused to release %r (in flight) although no prefetch of "
                        "this workload reads it; retrying later", handle)
            self._deferred[handle.allocation_id] = handle
            return
        self.released_handles += 1
        self.released_pages += handle.num_pages

    @property
    def pending_releases(self) -> int:
        return len(self._deferred)

    def retry_deferred(self) -> None:
        """Release deferred handles nothing of ours holds any more."""
        for key, handle in list(self._deferred.items()):
            if not self._holds.get(key):
                del self._deferred[key]
                self._release_now(handle)

    # --- pressure ---------------------------------------------------------------------------

    def reclaim(self, pages_needed: int, detach: Callable[[Segment], HostPages]) -> int:
        """Release least recently used, unheld host copies until ``pages_needed`` pages are
        freed (or none is left). ``detach(segment)`` takes the host copy away from its segment
        and returns the handle. Returns the pages released."""
        freed = 0
        for segment in list(self._lru):
            if freed >= pages_needed:
                break
            handle = segment.host
            if handle is None or self.is_held(handle):
                continue
            self._lru.pop(segment)
            handle = detach(segment)
            before = self.released_pages
            self._release_now(handle)
            released = self.released_pages - before
            freed += released
            self.reclaimed_pages += released
        return freed
