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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .kinds import D2H, H2D

if TYPE_CHECKING:
    from .request import Request

# page -> pending requests, in admission order (usually one)
_PageTable = dict[int, list["Request"]]


def _remove(table: _PageTable, pages, request: Request) -> None:
    for page in pages:
        pending = table.get(page)
        if pending is not None:
            if len(pending) == 1:
                if pending[0] is request:
                    del table[page]
            else:
                pending.remove(request)


class HazardTable:
    def __init__(self) -> None:
        self._writers: dict = {D2H: {}, H2D: {}}  # D2H writes host pages, H2D device pages
        self._readers: dict = {D2H: {}, H2D: {}}  # D2H reads device pages, H2D host pages

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
        for page in reads:
            writers = writers_of_reads.get(page)
            if writers:
                found = found if found is not None else {}
                for w in writers:
                    found.setdefault(id(w), (w, needs_data))
            pending = readers_of_mine.get(page)
            if pending is None:
                readers_of_mine[page] = [request]
            else:
                pending.append(request)
        # What I write: after its pending writers (same direction) and readers (other one).
        if writes:
            writers_of_writes: _PageTable = self._writers[d]
            readers_of_writes: _PageTable = self._readers[other]
            for page in writes:
                writers = writers_of_writes.get(page)
                readers = readers_of_writes.get(page)
                if writers or readers:
                    found = found if found is not None else {}
                    for r in (writers or ()):
                        found.setdefault(id(r), (r, False))
                    for r in (readers or ()):
                        found.setdefault(id(r), (r, False))
                if writers is None:
                    writers_of_writes[page] = [request]
                else:
                    writers.append(request)
        if found:
            request.deps = (*request.deps, *found.values())

    def register_fresh_host_writes(self, request: Request) -> None:
        """Register host pages allocated after admission (they were free: nothing to follow)."""
        writers: _PageTable = self._writers[D2H]
        for page in request.host_pages:
            assert page not in writers, "a free host page had a pending backup"
            writers[page] = [request]

    def retire(self, request: Request) -> None:
        """Forget ``request`` (it ended: done, failed or cancelled)."""
        d = request.direction
        reads, writes = request.read_and_write_pages()
        _remove(self._writers[d], writes, request)
        _remove(self._readers[d], reads, request)

    def __len__(self) -> int:
        return sum(len(t) for t in self._writers.values()) + sum(
            len(t) for t in self._readers.values()
        )
