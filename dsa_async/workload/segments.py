"""A segment: the pages of one conversation, or of one shared system prompt, and where they are.

A conversation's tokens are numbered from 0 (its system prompt first). The system prompt's
*whole* pages are shared by every conversation that uses it (one ``shared`` segment); the
conversation's own segment holds its tokens ``[first_token, end_token)`` in the pages from
``first_page = first_token // page_size`` on, so its first page also carries the prompt's
last, partial page. Its token range starts and ends inside pages: evicting exactly those tokens
makes the service pad both ends to whole pages, and the padding carries real bytes.

States (loop thread only)::

    ABSENT --compute--> RESIDENT --evict--> EVICTING --done--> HOSTED --prefetch--> LOADING
       ^                  |  ^                  |                 |                    |
       |                  |  +-----(checked by the forward pass)--+--------------------+
       +--- lost: host copy released under pressure, a failed copy, or retired --------+

A shared segment whose host copy is still valid leaves the device without a copy (RESIDENT ->
HOSTED at once); a conversation's host copy is stale after its next turn and is released then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from ..completion.transfer import Transfer
from ..host_memory.pool import HostPages


class SegmentState(enum.Enum):
    ABSENT = "absent"  #: nowhere: computed (again) on next use
    RESIDENT = "resident"  #: on the device (pinned while a step uses it)
    LOADING = "loading"  #: a prefetch brings it in; the forward pass checks it
    EVICTING = "evicting"  #: a backup copy reads its device pages
    HOSTED = "hosted"  #: only in host pages


def pages_spanned(first_token: int, end_token: int, page_size: int) -> int:
    """Pages holding tokens ``[first_token, end_token)`` (0 when empty)."""
    if end_token <= first_token:
        return 0
    return (end_token - 1) // page_size - first_token // page_size + 1


@dataclass(eq=False)
class Segment:
    key: str
    first_token: int
    end_token: int
    page_size: int
    shared: bool = False
    state: SegmentState = SegmentState.ABSENT
    device_pages: np.ndarray | None = None  #: int64 [num_pages], logical page order
    checksums: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    host: HostPages | None = None  #: the host copy (pages in logical order)
    host_checksums: np.ndarray | None = None  #: what the host copy holds, recorded at eviction
    pins: int = 0  #: steps in flight that use it
    loading: Transfer | None = None
    retired: bool = False  #: its conversation ended; drop everything once idle
    cached_before: bool = False  #: was computed once (so computing it again is a recompute)
    evicted: object = None  #: asyncio.Future resolved when an eviction in flight ends

    @property
    def first_page(self) -> int:
        return self.first_token // self.page_size

    @property
    def num_pages(self) -> int:
        return pages_spanned(self.first_token, self.end_token, self.page_size)

    @property
    def num_tokens(self) -> int:
        return max(0, self.end_token - self.first_token)

    @property
    def host_valid(self) -> bool:
        return self.host is not None and self.host_checksums is not None

    def device_tokens(self, device_pages: np.ndarray | None = None) -> np.ndarray:
        """Device token slots of tokens ``[first_token, end_token)`` (``int64 [num_tokens]``),
        in token order, on ``device_pages`` (default: its own)."""
        pages = self.device_pages if device_pages is None else device_pages
        assert pages is not None and pages.size == self.num_pages
        ps = self.page_size
        logical = np.arange(self.first_token, self.end_token, dtype=np.int64)
        return pages[logical // ps - self.first_page] * ps + logical % ps

    def __repr__(self) -> str:
        return (f"Segment({self.key}, tokens [{self.first_token}, {self.end_token}), "
                f"{self.state.value}, pins={self.pins})")
