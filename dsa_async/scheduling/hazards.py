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

Cost. A request of a few pages (the common case) costs a few dict operations per page. A long
request (``BULK_PAGES`` or more) is one entry holding its pages as given (a range or a list):
admitting it costs set operations in C that iterate its pages once per table holding other
requests (nothing while the tables are empty), a set of a long list is made only when another
request has to test membership in it, and retiring it is O(1), so a 1,024-page request does not
pay a dict insert and delete per page and per table. Which host pages are busy is a count per
host page, updated by numpy (a slice for a run of pages) for long requests.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING

import numpy as np

from ..kinds import D2H, H2D
from ..paging.runs import PageList

if TYPE_CHECKING:
    from .request import Request

#: Requests of at least this many pages are one entry per table (a set of pages), not one
#: dict entry per page.
BULK_PAGES = 16


class _Bulk:
    """A long request's entry in a table: its pages as given (a ``range`` or a list), and a
    set of them made only when another request first has to test membership in them."""

    __slots__ = ("request", "pages", "_lookup")

    def __init__(self, request: Request, pages) -> None:
        self.request = request
        self.pages = pages
        self._lookup = pages if type(pages) is range else None

    def lookup(self) -> range | set[int]:
        """The pages as a container with O(1) ``in`` (a range is one already)."""
        lookup = self._lookup
        if lookup is None:
            lookup = self._lookup = set(self.pages)
        return lookup


def _disjoint(entry: _Bulk, pages, mine: list) -> bool:
    """Whether ``entry`` shares no page with ``pages`` (a long request's pages: a range or a
    list). ``mine``: a one-slot cache of ``pages`` as a set, made at most once per table
    looked at."""
    theirs = entry.pages
    if type(theirs) is range:
        if type(pages) is range:
            return theirs.stop <= pages.start or pages.stop <= theirs.start
        if not mine:
            mine.append(set(pages))
        return mine[0].isdisjoint(theirs)  # iterates the range
    return entry.lookup().isdisjoint(pages)  # iterates ``pages``


class _Table:
    """Pending requests per page, for one side (host or device) and one role (read or write).

    ``small``: page -> the pending request, or a list of them in admission order when there are
    several (one per page is the common case: no list to allocate). ``bulk``: long requests,
    each one :class:`_Bulk` entry."""

    __slots__ = ("small", "bulk")

    def __init__(self) -> None:
        self.small: dict[int, Request | list[Request]] = {}
        self.bulk: list[_Bulk] = []

    def requests(self):
        """Every pending request of this table (a request may come more than once)."""
        for pending in self.small.values():
            if type(pending) is list:
                yield from pending
            else:
                yield pending
        for entry in self.bulk:
            yield entry.request

    def follow(self, found: dict, pages, is_bulk: bool, needs_data: bool) -> None:
        """Add to ``found`` every request of this table pending on one of ``pages`` (a range or
        a list; ``is_bulk``: a long request's, checked without a dict lookup per page)."""
        small, bulk = self.small, self.bulk
        if is_bulk:
            if small and not small.keys().isdisjoint(pages):  # iterates the smaller side
                for page in small.keys() & pages:
                    _depend(found, small[page], needs_data)
            mine: list = []
            for entry in bulk:
                if not _disjoint(entry, pages, mine):
                    found.setdefault(id(entry.request), (entry.request, needs_data))
            return
        if small:
            get = small.get
            for page in pages:
                pending = get(page)
                if pending is not None:
                    _depend(found, pending, needs_data)
        for entry in bulk:
            lookup = entry.lookup()
            for page in pages:
                if page in lookup:
                    found.setdefault(id(entry.request), (entry.request, needs_data))
                    break

    def add(self, request: Request, pages, is_bulk: bool) -> None:
        if is_bulk:
            self.bulk.append(_Bulk(request, pages))
            return
        small = self.small
        for page in pages:
            pending = small.get(page)
            if pending is None:
                small[page] = request
            elif type(pending) is list:
                pending.append(request)
            else:
                small[page] = [pending, request]

    def remove_bulk(self, request: Request) -> None:
        entries = self.bulk
        for i, entry in enumerate(entries):
            if entry.request is request:
                del entries[i]
                return
        raise AssertionError("a long request was not in its table")


def _depend(found: dict, pending: Request | list[Request], needs_data: bool) -> None:
    if type(pending) is list:
        for r in pending:
            found.setdefault(id(r), (r, needs_data))
    else:
        found.setdefault(id(pending), (pending, needs_data))


def _host_index(pages) -> slice | np.ndarray:
    """Host pages (a range or a list) as an index into the per-page counts."""
    if type(pages) is range:
        return slice(pages.start, pages.stop)
    if type(pages) is PageList:
        return pages.array
    return np.fromiter(pages, dtype=np.intp, count=len(pages))


class HazardTable:
    """The page states of one service (see the module docstring). ``host_pages``: how many
    host pages the pool has (the busy count is kept per host page)."""

    def __init__(self, host_pages: int) -> None:
        self._writers = {D2H: _Table(), H2D: _Table()}  # D2H writes host pages, H2D device pages
        self._readers = {D2H: _Table(), H2D: _Table()}  # D2H reads device pages, H2D host pages
        #: pending copies per host page (as reader or writer); a page with any cannot be
        #: released. Indexed one by one from Python, and through ``_host_refs_np`` by numpy.
        self._host_refs = array.array("i", bytes(4 * host_pages))
        self._host_refs_np = np.frombuffer(self._host_refs, dtype=np.int32)
        #: host pages a pending copy reads or writes; they cannot be released
        self.busy_host_pages = 0
        #: pending requests whose device pages are unknown (any device page): id -> request
        self._any_page: dict = {D2H: {}, H2D: {}}
        #: long requests' entries in all tables (while there are none, admission is all dicts)
        self._bulk_entries = 0

    def host_pages_busy(self, pages) -> list[int]:
        """Those of ``pages`` (host pages) that a pending copy reads or writes."""
        if not self.busy_host_pages:
            return []
        refs = self._host_refs
        return [p for p in pages if refs[p]]

    def _hold_host(self, pages) -> None:
        """One more pending copy on each of ``pages`` (distinct host pages)."""
        if len(pages) >= BULK_PAGES:
            index = _host_index(pages)
            refs = self._host_refs_np
            refs[index] += 1
            self.busy_host_pages += int(np.count_nonzero(refs[index] == 1))
            return
        refs = self._host_refs
        fresh = 0
        for page in pages:
            held = refs[page]
            refs[page] = held + 1
            if not held:
                fresh += 1
        self.busy_host_pages += fresh

    def _drop_host(self, pages) -> None:
        """One pending copy less on each of ``pages`` (distinct host pages; a long request:
        the short ones do this inline in :meth:`retire`)."""
        index = _host_index(pages)
        refs = self._host_refs_np
        refs[index] -= 1
        self.busy_host_pages -= int(np.count_nonzero(refs[index] == 0))

    def admit(self, request: Request) -> None:
        """Record ``request``'s dependencies on earlier requests and register its pages."""
        d = request.direction
        other = H2D if d is D2H else D2H
        reads, writes = request.read_and_write_pages()
        loads = d is H2D
        found: dict[int, tuple[Request, bool]] | None = None  # id -> (request, needs its data)
        if self._bulk_entries or len(reads) >= BULK_PAGES or len(writes) >= BULK_PAGES:
            found = {}
            self._admit_tables(request, d, other, reads, writes, found)
        else:  # the common case, inline: a few pages and no long request pending
            # What I read was written by the other direction (read-after-write: a prefetch
            # needs the backup's bytes); I am one more pending reader of it.
            writers = self._writers[other].small
            readers = self._readers[d].small
            for page in reads:
                pending = writers.get(page)
                if pending is not None:
                    found = found if found is not None else {}
                    _depend(found, pending, loads)
                pending = readers.get(page)
                if pending is None:
                    readers[page] = request
                elif type(pending) is list:
                    pending.append(request)
                else:
                    readers[page] = [pending, request]
            # What I write: after its pending writers (same direction) and readers (other).
            if writes:
                writers = self._writers[d].small
                readers = self._readers[other].small
                for page in writes:
                    pending = writers.get(page)
                    if pending is None:
                        writers[page] = request
                    else:
                        found = found if found is not None else {}
                        _depend(found, pending, False)
                        if type(pending) is list:
                            pending.append(request)
                        else:
                            writers[page] = [pending, request]
                    pending = readers.get(page)
                    if pending is not None:
                        found = found if found is not None else {}
                        _depend(found, pending, False)
        host = reads if loads else writes
        if host:
            self._hold_host(host)
        any_read, any_written = self._any_page[D2H], self._any_page[H2D]
        if request.device_indices is not None:
            found = found if found is not None else {}
            self._follow_every_device_page(request, found)
        elif any_written or (any_read and loads):
            # a known device page: after every pending load into unknown pages (both
            # directions), and for a load also after every pending backup of unknown pages
            found = found if found is not None else {}
            for pending in any_written.values():
                found.setdefault(id(pending), (pending, False))
            if loads:
                for pending in any_read.values():
                    found.setdefault(id(pending), (pending, False))
        if found:
            request.follow(found.values())

    def _admit_tables(self, request: Request, d, other, reads, writes, found: dict) -> None:
        """:meth:`admit`'s page work when a long request is involved (the general path)."""
        if reads:
            bulk = len(reads) >= BULK_PAGES
            self._writers[other].follow(found, reads, bulk, d is H2D)
            self._add(self._readers[d], request, reads, bulk)
        if writes:
            bulk = len(writes) >= BULK_PAGES
            self._writers[d].follow(found, writes, bulk, False)
            self._readers[other].follow(found, writes, bulk, False)
            self._add(self._writers[d], request, writes, bulk)

    def _add(self, table: _Table, request: Request, pages, is_bulk: bool) -> None:
        table.add(request, pages, is_bulk)
        if is_bulk:
            self._bulk_entries += 1

    def _follow_every_device_page(self, request: Request, found: dict) -> None:
        """Dependencies of a request on unknown device pages: every pending request that
        conflicts with it on some device page. Registers it as pending on every page."""
        tables = [self._writers[H2D].requests(), self._any_page[H2D].values()]  # RAW/WAW
        if request.direction is H2D:  # a load also follows the backups still reading (WAR)
            tables += [self._readers[D2H].requests(), self._any_page[D2H].values()]
        for table in tables:
            for pending in table:
                found.setdefault(id(pending), (pending, False))
        self._any_page[request.direction][id(request)] = request

    def register_fresh_host_writes(self, request: Request) -> None:
        """Register host pages allocated after admission (they were free: nothing to follow)."""
        pages = request.host_pages
        if len(pages) >= BULK_PAGES:
            assert not self._host_refs_np[_host_index(pages)].any(), "a free host page was in use"
            self._add(self._writers[D2H], request, pages, True)
            self._hold_host(pages)
            return
        writers, refs = self._writers[D2H].small, self._host_refs
        for page in pages:
            assert not refs[page], "a free host page was in use"
            writers[page] = request
            refs[page] = 1
        self.busy_host_pages += len(pages)

    def retire(self, request: Request) -> None:
        """Forget ``request`` (it ended: done, failed or cancelled)."""
        d = request.direction
        device, host = request.device_pages, request.host_pages
        if d is D2H:  # reads device pages, writes host pages
            device_table, host_table = self._readers[D2H], self._writers[D2H]
        else:
            device_table, host_table = self._writers[H2D], self._readers[H2D]
        if request.device_indices is not None:
            self._any_page[d].pop(id(request), None)
        if len(device) >= BULK_PAGES:
            device_table.remove_bulk(request)
            self._bulk_entries -= 1
        elif device:
            _forget(device_table.small, request, device)
        if host is None:
            return
        if len(host) >= BULK_PAGES:
            host_table.remove_bulk(request)
            self._bulk_entries -= 1
            self._drop_host(host)
            return
        _forget(host_table.small, request, host)
        refs, idle = self._host_refs, 0
        for page in host:
            held = refs[page] - 1
            refs[page] = held
            if not held:
                idle += 1
        self.busy_host_pages -= idle


def _forget(small: dict, request: Request, pages) -> None:
    """Drop ``request`` from ``pages`` of a table's per-page entries."""
    for page in pages:
        pending = small.get(page)
        if pending is request:
            del small[page]
        elif type(pending) is list:
            pending.remove(request)
            if len(pending) == 1:
                small[page] = pending[0]
