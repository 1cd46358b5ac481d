"""The page-state table that orders copies touching the same pages (the happens-before rules).

One table, consulted once per request at admission, in submission order:

* eviction (reads device pages, writes host pages) follows the last load into those device
  pages (read-after-write: it must back up the loaded bytes), and every earlier reader and
  writer of its host pages (a prefetch still reading the old host bytes; an earlier backup);
* prefetch (reads host pages, writes device pages) follows the last backup into those host
  pages (read-after-write: it must load the backed-up bytes, and fails if that backup failed),
  and every earlier reader and writer of its device pages.

Entries leave the table when their request ends. Loop-thread only; no locking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .kinds import D2H, H2D

if TYPE_CHECKING:
    from .request import Request


class HazardTable:
    def __init__(self) -> None:
        # page -> last writer still pending, and page -> readers still pending
        self._writer = {D2H: {}, H2D: {}}  # D2H writes host, H2D device
        self._readers = {D2H: {}, H2D: {}}  # D2H reads device, H2D host

    def admit(self, request: Request) -> None:
        """Record ``request``'s dependencies on earlier requests and register its pages."""
        d = request.direction
        other = H2D if d is D2H else D2H
        reads, writes = request.read_and_write_pages()
        found: dict[int, tuple[Request, bool]] | None = None  # id -> (request, needs its data)
        # What I read was last written by the other direction: read-after-write. And I am one
        # more pending reader of it.
        writer_of_reads, readers_of_mine = self._writer[other], self._readers[d]
        needs_data = d is H2D  # a prefetch needs the backup's bytes
        for page in reads:
            w = writer_of_reads.get(page)
            if w is not None:
                found = found if found is not None else {}
                found.setdefault(id(w), (w, needs_data))
            pending = readers_of_mine.get(page)
            if pending is None:
                readers_of_mine[page] = [request]
            else:
                pending.append(request)
        # What I write: after its last writer (same direction) and its pending readers.
        if writes:
            writer_of_writes, readers_of_writes = self._writer[d], self._readers[other]
            for page in writes:
                w = writer_of_writes.get(page)
                if w is not None:
                    found = found if found is not None else {}
                    found.setdefault(id(w), (w, False))
                readers = readers_of_writes.get(page)
                if readers:
                    found = found if found is not None else {}
                    for r in readers:
                        found.setdefault(id(r), (r, False))
                writer_of_writes[page] = request
        if found:
            request.deps = (*request.deps, *found.values())

    def register_fresh_host_writes(self, request: Request) -> None:
        """Register host pages allocated after admission (they were free: nothing to follow)."""
        writers = self._writer[D2H]
        for page in request.host_pages:
            writers[page] = request

    def retire(self, request: Request) -> None:
        """Forget ``request`` (it ended: done, failed or cancelled)."""
        d = request.direction
        reads, writes = request.read_and_write_pages()
        writers = self._writer[d]
        for page in writes:
            if writers.get(page) is request:
                del writers[page]
        readers = self._readers[d]
        for page in reads:
            pending = readers.get(page)
            if pending is not None:
                pending.remove(request)
                if not pending:
                    del readers[page]

    def __len__(self) -> int:
        return sum(len(t) for t in self._writer.values()) + sum(
            len(t) for t in self._readers.values()
        )

