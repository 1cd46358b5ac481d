"""Host handles released while copies still use them ("orphans"), freed when the last copy
using them ends.

The pages are no longer the caller's (a release refuses the handle) and not yet the pool's. A
request's end asks only about the orphans that share its host pages, found through a page
index, so the cost of an end never grows with how many orphans wait. The pool is passed in
(the scheduler owns it and drops it at close). Loop thread only; no call blocks.
"""

from __future__ import annotations

from ..host_memory.pool import HostPages, HostPool
from ..paging.runs import PageSeq
from .hazards import HazardTable


class Orphans:
    """The orphans of one service: by allocation id, with the owner of each of their pages."""

    def __init__(self, hazards: HazardTable) -> None:
        self._hazards = hazards  # which host pages a queued or running copy uses
        self._handles: dict[int, HostPages] = {}
        self._owner_of_page: dict[int, int] = {}

    def __contains__(self, allocation_id: int) -> bool:
        return allocation_id in self._handles

    def __bool__(self) -> bool:
        return bool(self._handles)

    def first_owned(self, pages: PageSeq) -> int | None:
        """The first of ``pages`` that an orphan holds, or ``None``."""
        owner = self._owner_of_page
        if owner:
            for page in pages:
                if page in owner:
                    return page
        return None

    def free_when_unused(self, handle: HostPages, pool: HostPool) -> None:
        """Return ``handle``'s pages to ``pool`` now if no queued or running copy uses them;
        else keep it until the last such copy ends (:meth:`free_sharing`)."""
        if not self._hazards.host_pages_busy(handle.page_seq):
            pool.release(handle)
            return
        self._handles[handle.allocation_id] = handle
        owner = self._owner_of_page
        for page in handle.page_seq:
            owner[page] = handle.allocation_id

    def free_sharing(self, host_pages: PageSeq, pool: HostPool) -> None:
        """Free the orphans that share a page with ``host_pages`` (a copy that used them just
        ended) and that no other copy uses any more. Looks at the smaller of the two sides:
        the ended copy's pages, or every orphan when they hold fewer pages."""
        if len(self._owner_of_page) <= len(host_pages):
            candidates = list(self._handles)
        else:
            owner = self._owner_of_page.get
            candidates = {owner(page) for page in host_pages}
            candidates.discard(None)
        busy = self._hazards.host_pages_busy
        for allocation_id in candidates:
            handle = self._handles[allocation_id]
            if busy(handle.page_seq):
                continue
            del self._handles[allocation_id]
            for page in handle.page_seq:
                del self._owner_of_page[page]
            pool.release(handle)
