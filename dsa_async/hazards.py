"""The page-state table that orders copies touching the same pages (the happens-before rules).

One table, consulted once per request at admission, in submission order:

* eviction (reads device pages, writes host pages) follows every pending load into those
  device pages (read-after-write: it must back up the loaded bytes), and every pending reader
  and writer of its host pages (a prefetch still reading the old host bytes; an earlier backup);
* prefetch (reads host pages, writes device pages) follows every pending backup into those
  host pages (read-after-write: it must load the backed-up bytes, and fails if such a backup
  failed or was cancelled), and every pending reader and writer of its device pages.

A request follows *every* pending writer of a page, not only the latest: when the latest is
cancelled while queued, what it followed is still running, and later requests must still wait
for that. Entries leave the table when their request ends. Loop-thread only; no locking.

A request whose device pages are not known yet (device indices on the GPU, read by the engine
after its producers: device_indices.py) stands for *every* device page while it is pending: it
follows every pending request that conflicts with some device page (a backup follows every
pending load; a load follows every pending backup and load), and every later request that
touches device pages in a conflicting way follows it. Its host pages are ordinary entries.
"""

from __future__ import annotations

from itertools import repeat
from operator import is_
from typing import TYPE_CHECKING

from .kinds import D2H, H2D

if TYPE_CHECKING:
    from .request import Request

# page -> its pending request, or a list of them in admission order when there are several.
# One request per page is the common case; not allocating a list for it keeps a request's
# page entries from being garbage-collector work.
_PageTable = dict[int, "Request | list[Request]"]


def _add(table: _PageTable, page: int, request: Request) -> bool:
    """Register ``request`` on ``page``; returns whether the page was not in ``table``."""
    pending = table.get(page)
    if pending is None:
        table[page] = request
        return True
    if type(pending) is list:
        pending.append(request)
    else:
        table[page] = [pending, request]
    return False


def _depend(found: dict, pending: Request | list[Request], needs_data: bool) -> None:
    if type(pending) is list:
        for r in pending:
            found.setdefault(id(r), (r, needs_data))
    else:
        found.setdefault(id(pending), (pending, needs_data))


#: Requests of at least this many pages take the bulk paths: whole-set checks and updates that
#: run in C (``isdisjoint``, ``dict.update``), instead of Python work per page.
BULK_PAGES = 16


def _count_in(table: _PageTable, pages) -> int:
    return sum(map(table.__contains__, pages))


def _remove(table: _PageTable, pages, request: Request, other: _PageTable | None) -> int:
    """Drop ``request`` from ``pages`` of ``table``; returns how many pages are now in neither
    ``table`` nor ``other`` (when ``other`` is given: the host side's two tables)."""
    if len(pages) >= BULK_PAGES and all(map(is_, map(table.get, pages), repeat(request))):
        for page in pages:  # the request alone on every page: drop them all
            del table[page]
        return 0 if other is None else len(pages) - _count_in(other, pages)
    idle = 0
    for page in pages:
        pending = table.get(page)
        if pending is request:
            del table[page]
            if other is not None and page not in other:
                idle += 1
        elif type(pending) is list:
            pending.remove(request)
            if len(pending) == 1:
                table[page] = pending[0]
    return idle


class HazardTable:
    def __init__(self) -> None:
        self._writers: dict = {D2H: {}, H2D: {}}  # D2H writes host pages, H2D device pages
        self._readers: dict = {D2H: {}, H2D: {}}  # D2H reads device pages, H2D host pages
        #: host pages a pending copy reads or writes (a key of either host-side table); they
        #: cannot be released
        self.busy_host_pages = 0
        #: pending requests whose device pages are unknown (any device page): id -> request
        self._any_page: dict = {D2H: {}, H2D: {}}

    def host_pages_busy(self, pages) -> list[int]:
        """Those of ``pages`` (host pages) that a pending copy reads or writes."""
        writers, readers = self._writers[D2H], self._readers[H2D]
        if not writers and not readers:
            return []
        return [p for p in pages if p in writers or p in readers]

    def admit(self, request: Request) -> None:
        """Record ``request``'s dependencies on earlier requests and register its pages."""
        d = request.direction
        other = H2D if d is D2H else D2H
        reads, writes = request.read_and_write_pages()
        found: dict[int, tuple[Request, bool]] | None = None  # id -> (request, needs its data)
        # What I read was written by the other direction: read-after-write. And I am one more
        # pending reader of it.
        writers_of_reads: _PageTable = self._writers[other]
        readers_of_mine: _PageTable = self._readers[d]
        needs_data = d is H2D  # a prefetch needs the backup's bytes
        # Host pages: a prefetch reads them, a backup writes them.
        host_side_other = self._writers[D2H] if d is H2D else self._readers[H2D]
        if (len(reads) >= BULK_PAGES and writers_of_reads.keys().isdisjoint(reads)
                and readers_of_mine.keys().isdisjoint(reads)):
            readers_of_mine.update(dict.fromkeys(reads, request))  # nothing to follow
            if needs_data:
                self.busy_host_pages += len(reads) - _count_in(host_side_other, reads)
            reads = ()
        for page in reads:
            writers = writers_of_reads.get(page)
            if writers is not None:
                found = found if found is not None else {}
                _depend(found, writers, needs_data)
            if _add(readers_of_mine, page, request) and needs_data and page not in host_side_other:
                self.busy_host_pages += 1
        # What I write: after its pending writers (same direction) and readers (other one).
        if writes:
            writers_of_writes: _PageTable = self._writers[d]
            readers_of_writes: _PageTable = self._readers[other]
            if (len(writes) >= BULK_PAGES and writers_of_writes.keys().isdisjoint(writes)
                    and readers_of_writes.keys().isdisjoint(writes)):
                writers_of_writes.update(dict.fromkeys(writes, request))  # nothing to follow
                if not needs_data:
                    self.busy_host_pages += len(writes) - _count_in(host_side_other, writes)
                writes = ()
            for page in writes:
                writers = writers_of_writes.get(page)
                readers = readers_of_writes.get(page)
                if writers is not None or readers is not None:
                    found = found if found is not None else {}
                    if writers is not None:
                        _depend(found, writers, False)
                    if readers is not None:
                        _depend(found, readers, False)
                if (_add(writers_of_writes, page, request) and not needs_data
                        and page not in host_side_other):
                    self.busy_host_pages += 1
        any_read, any_written = self._any_page[D2H], self._any_page[H2D]
        if request.device_indices is not None:
            found = self._follow_every_device_page(request, found)
        elif any_written or (any_read and d is H2D):
            # a known device page: after every pending load into unknown pages (both
            # directions), and for a load also after every pending backup of unknown pages
            found = found if found is not None else {}
            for pending in any_written.values():
                found.setdefault(id(pending), (pending, False))
            if d is H2D:
                for pending in any_read.values():
                    found.setdefault(id(pending), (pending, False))
        if found:
            request.deps = (*request.deps, *found.values())

    def _follow_every_device_page(self, request: Request, found: dict | None) -> dict:
        """Dependencies of a request on unknown device pages: every pending request that
        conflicts with it on some device page. Registers it as pending on every page."""
        found = found if found is not None else {}
        tables = [self._writers[H2D].values(), self._any_page[H2D].values()]  # loads: RAW/WAW
        if request.direction is H2D:  # a load also follows the backups still reading (WAR)
            tables += [self._readers[D2H].values(), self._any_page[D2H].values()]
        for table in tables:
            for pending in table:
                _depend(found, pending, False)
        self._any_page[request.direction][id(request)] = request
        return found

    def register_fresh_host_writes(self, request: Request) -> None:
        """Register host pages allocated after admission (they were free: nothing to follow)."""
        writers: _PageTable = self._writers[D2H]
        pages = request.host_pages
        assert writers.keys().isdisjoint(pages) and self._readers[H2D].keys().isdisjoint(pages), \
            "a free host page was in use"
        if len(pages) >= BULK_PAGES:
            writers.update(dict.fromkeys(pages, request))
        else:
            for page in pages:
                writers[page] = request
        self.busy_host_pages += len(pages)

    def retire(self, request: Request) -> None:
        """Forget ``request`` (it ended: done, failed or cancelled)."""
        d = request.direction
        reads, writes = request.read_and_write_pages()
        if request.device_indices is not None:
            self._any_page[d].pop(id(request), None)
        if d is D2H:  # writes host pages
            self.busy_host_pages -= _remove(self._writers[D2H], writes, request,
                                            self._readers[H2D])
            _remove(self._readers[D2H], reads, request, None)
        else:  # reads host pages
            _remove(self._writers[H2D], writes, request, None)
            self.busy_host_pages -= _remove(self._readers[H2D], reads, request,
                                            self._writers[D2H])

    def __len__(self) -> int:
        return (sum(len(t) for t in self._writers.values())
                + sum(len(t) for t in self._readers.values())
                + sum(len(t) for t in self._any_page.values()))
