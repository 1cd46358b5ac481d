"""The host pool: one arena per cache pool, sized in whole pages, and the page-state table.

All pools share one page table: host page ``p`` is a slot in every arena. Each arena is a plain
``uint8`` tensor, allocated once and first-touched at :meth:`HostPool.create`, starting on a
boundary of the host's memory pages (as an ``mmap`` would: storage backends that read and write
host pages with ``O_DIRECT`` need it, and no page-lock registration shares a page with other
memory at the arena's start); page-locking it is the CUDA backend's job (it registers exactly
these bytes). Arena shapes::

    HostLayout.LAYER_FIRST: [num_layers, capacity_pages, bytes_per_page_per_layer]
    HostLayout.PAGE_FIRST:  [capacity_pages, num_layers, bytes_per_page_per_layer]

Page states here: free or held (the extent allocator's free extents; ``_live`` maps each live
allocation id to its handle). Which held pages a copy uses right now is the scheduler's hazard
table: one table of page states orders copies and refuses releases. Not thread-safe: owned by
the event loop; every method is non-blocking except :meth:`HostPool.create`, which allocates
and zero-fills the arenas.
"""

from __future__ import annotations

import array
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ArgumentTypeError, PagesInFlightError, UnknownHostPagesError, shown
from ..geometry import HOST_PAGE_BYTES, HostLayout, PageGeometry
from ..paging.runs import PageSeq, page_tokens
from .extents import ExtentAllocator

#: Allocation ids are unique across every pool of the process, so a handle from another
#: service can never pass for one of this pool's.
_ALLOCATION_IDS = itertools.count(1)


@dataclass(frozen=True)
class HostPoolStatistics:
    """Current state of the pool, in pages (no counters, no times)."""

    capacity_pages: int
    used_pages: int
    free_pages: int
    largest_free_extent_pages: int


class HostPages:
    """A handle to host pages from one allocation, in order: ``runs`` of ``(start, num_pages)``.

    ``pages`` is the same as an ``int64 [n_pages]`` array (a fresh copy per call), ``page_seq``
    as a ``range`` (one run) or a list (read it, never change it: the service reads it while
    copies use the pages). Valid until released; the pool refuses a released or foreign handle.
    """

    __slots__ = ("runs", "allocation_id", "page_size_tokens", "num_pages", "page_seq")

    def __init__(self, runs: tuple[tuple[int, int], ...], allocation_id: int,
                 page_size_tokens: int) -> None:
        self.runs = runs  #: ``(start, num_pages)`` extents, in page order
        self.allocation_id = allocation_id
        self.page_size_tokens = page_size_tokens
        if len(runs) == 1:
            start, n = runs[0]
            self.page_seq: PageSeq = range(start, start + n)
        else:
            self.page_seq = [p for start, n in runs for p in range(start, start + n)]
        self.num_pages = len(self.page_seq)

    @property
    def pages(self) -> np.ndarray:
        """The pages as ``int64 [n_pages]`` (a fresh array: changing it changes nothing)."""
        return np.fromiter(self.page_seq, dtype=np.int64, count=self.num_pages)

    def token_indices(self) -> torch.Tensor:
        """Every host token slot of these pages, page by page (``int64 [n_pages * page_size]``)."""
        return torch.from_numpy(page_tokens(self.pages, self.page_size_tokens))

    def __repr__(self) -> str:
        return f"HostPages(allocation={shown(self.allocation_id)}, pages={shown(self.num_pages)})"


class HostPool:
    """Arenas plus the page-extent allocator and page-state table for one shared page table."""

    def __init__(self, geometries: Sequence[PageGeometry], capacity_pages: int) -> None:
        assert geometries and capacity_pages > 0
        sizes = {g.page_size_tokens for g in geometries}
        assert len(sizes) == 1, "pools that share a page table share the page size"
        self.geometries = tuple(geometries)
        self.capacity_pages = capacity_pages
        self.page_size_tokens = sizes.pop()
        self.arenas: dict[str, torch.Tensor] = {}
        self.startup_s = 0.0
        self._extents = ExtentAllocator(capacity_pages)
        #: allocation id -> its handle. The values are handles, not their runs: a dict of
        #: only ints and tuples of ints is untracked by a full garbage collection and tracked
        #: again as young by the next insert, and the next young collection then walks all of
        #: it (a few ms on the loop per full collection with tens of thousands held).
        self._live: dict[int, HostPages] = {}
        #: allocations plus releases so far: changes whenever pages change hands
        self.changes = 0
        #: releases so far, and per page the number of the release that last freed it: a
        #: thread that read ``releases`` before naming pages learns on the loop whether they
        #: changed hands since (``first_released_since``)
        self.releases = 0
        #: an ``array`` (not numpy): the check reads a few entries per request, where a numpy
        #: gather costs ~7 us; nor is it a list, which every full collection would walk
        self._released_at = array.array("q", bytes(8 * capacity_pages))
        self._released_at_np = np.frombuffer(self._released_at, dtype=np.int64)  # long lists
        self._batch_run: list[int] | None = None  # [start, pages]: taken, not yet handed out

    @classmethod
    def create(cls, geometries: Sequence[PageGeometry], capacity_pages: int) -> HostPool:
        """Allocate and first-touch every arena. Blocks for the zero-fill (run it off the loop)."""
        pool = cls(geometries, capacity_pages)
        started = time.perf_counter()
        for g in pool.geometries:
            if g.host_layout is HostLayout.LAYER_FIRST:
                shape = (g.num_layers, capacity_pages, g.bytes_per_page_per_layer)
            else:
                shape = (capacity_pages, g.num_layers, g.bytes_per_page_per_layer)
            arena = _aligned_empty(shape, HOST_PAGE_BYTES)
            arena.view(-1).zero_()  # first touch: parallel over torch's intra-op threads
            pool.arenas[g.name] = arena
        pool.startup_s = time.perf_counter() - started
        return pool

    @property
    def bytes_per_page(self) -> int:
        """Host bytes of one shared page across every pool and layer."""
        return sum(g.bytes_per_page for g in self.geometries)

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.bytes_per_page

    @property
    def free_pages(self) -> int:
        return self._extents.free_pages

    # --- allocation -----------------------------------------------------------------------

    def allocate(self, num_pages: int, *, ahead_pages: int = 0) -> HostPages | None:
        """Take ``num_pages`` pages (fewest runs, best fit) or return ``None`` if too few are free.

        ``ahead_pages``: how many more pages allocations in this same loop step will ask for.
        Then one run for all of them is taken at once (when one extent holds it) and the next
        allocations are cut from it in order, one contiguous run each, without searching the
        free extents again; :meth:`end_batch` returns what is left of that run and must be
        called before the loop step ends."""
        batch = self._batch_run
        if batch is not None and batch[1] >= num_pages:
            start = batch[0]
            batch[0] += num_pages
            batch[1] -= num_pages
            runs: tuple[tuple[int, int], ...] = ((start, num_pages),)
        else:
            self.end_batch()
            extents = self._extents
            start = extents.allocate_run(num_pages + ahead_pages) if ahead_pages else None
            if start is not None:
                self._batch_run = [start + num_pages, ahead_pages]
            else:
                start = extents.allocate_run(num_pages)  # best fit, when one extent holds it
            if start is not None:
                runs = ((start, num_pages),)
            else:  # no extent holds it: several runs (or None: too few pages are free)
                found = extents.allocate(num_pages)
                if found is None:
                    return None
                runs = tuple(found)
        allocation_id = next(_ALLOCATION_IDS)
        handle = self._live[allocation_id] = HostPages(runs, allocation_id, self.page_size_tokens)
        self.changes += 1
        return handle

    def end_batch(self) -> None:
        """Return the unused rest of the run taken by ``allocate(..., ahead_pages=...)``."""
        batch, self._batch_run = self._batch_run, None
        if batch is not None and batch[1]:
            self._extents.free(batch[0], batch[1])

    def holds(self, handle: HostPages) -> bool:
        """Whether ``handle`` is a live allocation of this pool. Any thread (a dict lookup)."""
        live = self._live.get(handle.allocation_id)
        return live is handle or (live is not None and live.runs == handle.runs)

    def check_owned(self, handle: HostPages) -> None:
        """Raise ``UnknownHostPagesError`` unless ``handle`` is a live allocation of this pool."""
        if not isinstance(handle, HostPages):
            raise ArgumentTypeError(f"expected a HostPages handle, got {type(handle).__name__}")
        if not self.holds(handle):
            raise UnknownHostPagesError(
                f"{handle!r} is not held by this pool: it was already released or comes from "
                f"another service; use a handle returned by this service and release it once"
            )

    def check_allocated(self, pages: PageSeq, *, name: str) -> None:
        """Raise unless every page (in range) belongs to some live allocation."""
        page = self._extents.first_free(pages)
        if page is not None:
            raise UnknownHostPagesError(
                f"{name} names host page {page}, which no live allocation holds; host slots "
                f"must come from allocate_host_pages() (and not be released yet)"
            )

    def release(self, handle: HostPages,
                busy_pages: Callable[[PageSeq], list[int]] | None = None) -> None:
        """Return the pages of ``handle`` (checked to be live). ``busy_pages`` (the scheduler's
        hazard table: which of these pages a queued or running copy uses) makes it refuse,
        changing nothing, while a copy uses any of them."""
        self.check_owned(handle)
        busy = busy_pages(handle.page_seq) if busy_pages is not None else None
        if busy:
            raise PagesInFlightError(
                f"{handle!r}: {len(busy)} of its {handle.num_pages} pages are in flight "
                f"(host page {busy[0]} first); await the transfer that uses them before release()"
            )
        del self._live[handle.allocation_id]
        self.changes += 1
        self.releases += 1
        released_at, stamp = self._released_at, array.array("q", (self.releases,))
        for start, n in handle.runs:
            self._extents.free(start, n)
            released_at[start:start + n] = stamp * n

    def first_released_since(self, pages: PageSeq, releases_seen: int) -> int | None:
        """The first of ``pages`` (pages of live allocations: checked before) freed by a
        release after the first ``releases_seen`` releases (read from ``releases`` earlier),
        or ``None``. Loop thread."""
        if self.releases == releases_seen:
            return None
        released_at = self._released_at
        if type(pages) is range and pages.step == 1:
            latest = max(released_at[pages.start:pages.stop], default=0)
        elif len(pages) <= _SHORT_PAGE_LIST:
            latest = max(map(released_at.__getitem__, pages), default=0)
        else:
            latest = int(self._released_at_np[np.asarray(pages, dtype=np.int64)].max())
        if latest <= releases_seen:
            return None
        return next(page for page in pages if released_at[page] > releases_seen)

    def statistics(self) -> HostPoolStatistics:
        assert self._batch_run is None, "end_batch() was not called"
        free = self._extents.free_pages
        return HostPoolStatistics(
            capacity_pages=self.capacity_pages,
            used_pages=self.capacity_pages - free,
            free_pages=free,
            largest_free_extent_pages=self._extents.largest_free_extent_pages,
        )


#: Page lists up to this long are checked entry by entry, longer ones with one numpy gather.
_SHORT_PAGE_LIST = 64


def _aligned_empty(shape: tuple[int, ...], alignment_bytes: int) -> torch.Tensor:
    """An uninitialised contiguous ``uint8`` tensor of ``shape`` whose first byte lies on a
    multiple of ``alignment_bytes``: a view into an allocation up to that much larger (torch's
    CPU allocator aligns to 64 B only). Allocates; does not touch the memory."""
    nbytes = 1
    for size in shape:
        nbytes *= size
    whole = torch.empty(nbytes + alignment_bytes - 1, dtype=torch.uint8)
    skip = -whole.data_ptr() % alignment_bytes
    return whole[skip:skip + nbytes].view(shape)
