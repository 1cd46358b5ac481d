"""The workload's page tiers: the device page table, host copies, and the copies between them.

A segment's pages are on the device (RESIDENT), being backed up (EVICTING), backed up and off
the device (HOSTED), being loaded back (LOADING), or nowhere (ABSENT: computed again on next
use). This class owns those moves: backups of least recently used segments through
``OffloadService.evict`` (exact token ranges: the service pads them), loads through
``OffloadService.prefetch``, the host copies' LRU and the service's host-pressure hook, and
forgetting a segment's contents. The serving engine (engine.py) decides when.

Everything here runs on the event-loop thread and never blocks it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

import numpy as np

from ..completion.transfer import Transfer
from ..errors import DsaAsyncError
from ..front_door.service import OffloadService
from ..host_memory.pool import HostPages
from .counters import WorkloadCounters
from .device_cache import DeviceCache
from .host_cache import HostCache
from .segments import Segment, SegmentState

log = logging.getLogger("dsa_async.workload.engine")  # one logger for the serving engine


class PageTiers:
    """Segments' pages on the device and host tiers, and the copies between them (see the
    module docstring). Loop thread only; no call blocks."""

    def __init__(self, service: OffloadService, device_pages: int, counters: WorkloadCounters,
                 wake: Callable[[], None]) -> None:
        self.service = service
        self.counters = counters
        self.device = DeviceCache(device_pages)
        self.host = HostCache(service.release)
        self.segments: set[Segment] = set()  #: every segment not yet retired
        self._wake = wake  #: called when a copy ends (the engine may go on)
        self._loop = asyncio.get_running_loop()
        self._freeing_pages = 0  #: device pages of backups in flight
        self._evictions: set[Segment] = set()
        self._prefetches: set[Transfer] = set()

    @property
    def copies_in_flight(self) -> bool:
        return bool(self._evictions or self._prefetches)

    def loading(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` is a load of ours whose completion is not yet booked."""
        return transfer in self._prefetches

    def load(self, segment: Segment, deadline_s: float) -> Transfer | None:
        """Prefetch ``segment``'s host copy into newly allocated device pages; ``None`` when the
        service refuses it (the host copy is then dropped and the segment is ABSENT)."""
        pages = self.device.allocate(segment.num_pages)
        handle = segment.host
        try:
            transfer = self.service.prefetch(handle, segment.device_tokens(pages),
                                             deadline_s=deadline_s)
        except DsaAsyncError as exc:  # refused (e.g. queue full): compute it again instead
            log.error("prefetch of %r refused: %s", segment, exc)
            self.counters.failed_prefetches += 1
            self.counters.errors += 1
            self.device.free(pages)
            self.host.forget(segment)
            self._detach_host(segment)
            self.host.drop(handle)
            return None
        segment.device_pages = pages
        segment.state = SegmentState.LOADING
        segment.loading = transfer
        self.host.hold(handle)
        self.host.touch(segment)
        self._prefetches.add(transfer)
        transfer.add_done_callback(lambda t: self._prefetch_done(t, handle))
        self.counters.prefetches += 1
        return transfer

    def _prefetch_done(self, transfer: Transfer, handle: HostPages) -> None:
        self._prefetches.discard(transfer)
        self.host.unhold(handle)
        if transfer.cancelled() or self._failed(transfer):
            self.counters.failed_prefetches += 1
            self.counters.errors += 1
        else:
            self.counters.prefetched_pages += transfer.num_pages
        self._wake()

    @staticmethod
    def _failed(transfer: Transfer) -> bool:
        try:
            transfer.result()
        except Exception as exc:  # noqa: BLE001 - reported, the step sees it too
            log.error("%r failed: %s", transfer, exc)
            return True
        return False

    def evict_for(self, target_free_pages: int, keep: Collection[Segment] = ()) -> None:
        """Start evicting least recently used segments until free plus soon-free pages reach
        ``target_free_pages``."""
        for segment in self.device.evictable():
            if self.device.free_pages + self._freeing_pages >= target_free_pages:
                return
            if segment not in keep:
                self._evict(segment)

    def _evict(self, segment: Segment) -> None:
        self.device.discard(segment)
        pages = segment.device_pages
        if segment.host is not None:  # the host copy is still what the device holds
            segment.device_pages = None
            segment.state = SegmentState.HOSTED
            self.device.free(pages)
            self.counters.dropped_without_copy_pages += pages.size
            return
        try:
            transfer = self.service.evict(segment.device_tokens())
        except DsaAsyncError as exc:
            log.error("eviction of %r refused: %s; its pages are dropped", segment, exc)
            self.counters.failed_evictions += 1
            self.counters.errors += 1
            self.lose(segment)
            return
        segment.state = SegmentState.EVICTING
        segment.evicted = self._loop.create_future()
        self._evictions.add(segment)
        self._freeing_pages += pages.size
        recorded = segment.checksums.copy()
        transfer.add_done_callback(lambda t: self._eviction_done(segment, t, recorded))
        self.counters.evictions += 1
        self.counters.evicted_pages += pages.size

    def _eviction_done(self, segment: Segment, transfer: Transfer, recorded: np.ndarray) -> None:
        pages = segment.device_pages
        self._evictions.discard(segment)
        self._freeing_pages -= pages.size
        self.device.free(pages)  # the backup has read them
        segment.device_pages = None
        if transfer.cancelled() or self._failed(transfer):
            self.counters.failed_evictions += 1
            self.counters.errors += 1
            segment.state = SegmentState.ABSENT
        else:
            segment.host = transfer.result().host_pages
            segment.host_checksums = recorded
            segment.state = SegmentState.HOSTED
            self.host.touch(segment)
        if segment.retired:
            self.retire(segment)
        segment.evicted.set_result(None)
        self._wake()

    def on_host_pressure(self, pages_needed: int) -> int:
        """The service's ``on_host_pressure`` hook (on the loop): release least recently used
        host copies that no prefetch reads."""
        return self.host.reclaim(pages_needed, self._reclaim_host)

    def _reclaim_host(self, segment: Segment) -> HostPages:
        if segment.state is SegmentState.HOSTED:  # its only copy: computed again on next use
            self.counters.host_copies_lost += 1
        return self._detach_host(segment)

    @staticmethod
    def _detach_host(segment: Segment) -> HostPages:
        handle = segment.host
        segment.host = None
        segment.host_checksums = None
        if segment.state is SegmentState.HOSTED:
            segment.state = SegmentState.ABSENT
        return handle

    def drop_host(self, segment: Segment) -> None:
        self.host.forget(segment)
        self.host.drop(self._detach_host(segment))

    def lose(self, segment: Segment) -> None:
        """Forget ``segment``'s contents everywhere (it is computed again on next use)."""
        if segment.device_pages is not None and segment.state is not SegmentState.EVICTING:
            self.device.discard(segment)
            pages, loading = segment.device_pages, segment.loading
            if loading is not None and not loading.done():  # its copy still writes them
                loading.add_done_callback(lambda _t: self.device.free(pages))
            else:
                self.device.free(pages)
            segment.device_pages = None
        if segment.host is not None:
            self.drop_host(segment)
        segment.loading = None
        segment.state = SegmentState.ABSENT

    def retire(self, segment: Segment) -> None:
        """``segment`` is no longer wanted: drop it once nothing uses it."""
        segment.retired = True
        if segment.pins or segment.state is SegmentState.EVICTING:
            return  # its step or its backup finishes first
        self.lose(segment)
        self.segments.discard(segment)
