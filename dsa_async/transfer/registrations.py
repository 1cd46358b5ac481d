"""Where page-lock registrations begin and end, so no single copy crosses from one into the next.

``cudaMemcpyAsync`` treats its host range as one allocation: a range that starts in one
``cudaHostRegister`` registration and ends in the next (or in pageable memory) is refused with
``cudaErrorInvalidValue`` or handled as pageable memory, and a pageable device-to-host copy
blocks the issuing thread until the copy is done. The arena is registered in chunks (see
``pinning``), so the copy code splits every host range at the chunk edges first::

    registrations  [0x1000, 0x5000) [0x5000, 0x9000)
    copy           [0x4800, 0x5400)  ->  [0x4800, 0x5000) + [0x5000, 0x5400)

Kernels that reach host memory through unified addressing have no such limit: each access is
translated on its own. They need every page they touch to be mapped for the device, which
:meth:`RegistrationMap.covers` answers.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

# Registrations page-lock whole host pages, so chunk edges must fall on them (with 4 KiB
# assumed on a 64 KiB-page host, neighbouring chunks of an arena would share a page and every
# other chunk be refused as already registered).
from ..geometry import HOST_PAGE_BYTES

if TYPE_CHECKING:
    import torch


def tensor_span(tensor: "torch.Tensor") -> tuple[int, int]:
    """``(address, nbytes)`` of the bytes a tensor's elements occupy: from its first element to
    its last, whatever its strides (non-negative) and however much larger the allocation
    behind it is (a host arena is a page-aligned view into a slightly larger one)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    assert all(stride >= 0 for stride in tensor.stride()), "negative strides"
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


class RegistrationMap:
    """The ``[start, stop)`` byte ranges registered for one engine, with their edges.

    A registration page-locks whole host pages: the pages its byte range touches.
    """

    def __init__(self, ranges: Iterable[tuple[int, int]], *,
                 page_bytes: int = HOST_PAGE_BYTES) -> None:
        self.ranges = tuple(sorted((int(a), int(b)) for a, b in ranges if b > a))
        self.page_bytes = page_bytes
        #: every start and stop, sorted: a copy must not contain one strictly inside its range
        self.edges = sorted({x for r in self.ranges for x in r})
        pages = sorted((a // page_bytes, -(-b // page_bytes)) for a, b in self.ranges)
        merged: list[list[int]] = []
        for lo, hi in pages:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._page_spans = [tuple(span) for span in merged]
        self._span_starts = [span[0] for span in merged]

    def split(self, start: int, nbytes: int) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` pieces of ``[start, start + nbytes)``, cut at every edge.

        Example: edges ``[0x5000]``, ``split(0x4800, 0xC00)`` gives
        ``[(0, 0x800), (0x800, 0x400)]``.
        """
        stop = start + nbytes
        edges = self.edges
        i = bisect.bisect_right(edges, start)
        if i == len(edges) or edges[i] >= stop:
            return [(0, nbytes)]  # the common case: one piece
        pieces = []
        lo = start
        while i < len(edges) and edges[i] < stop:
            pieces.append((lo - start, edges[i] - lo))
            lo = edges[i]
            i += 1
        pieces.append((lo - start, stop - lo))
        return pieces

    def crossing(self, start: int, nbytes: int) -> int | None:
        """The first edge strictly inside ``[start, start + nbytes)``, or ``None``."""
        i = bisect.bisect_right(self.edges, start)
        if i < len(self.edges) and self.edges[i] < start + nbytes:
            return self.edges[i]
        return None

    def covers(self, start: int, nbytes: int) -> bool:
        """Whether every host page of ``[start, start + nbytes)`` is in some registration."""
        if nbytes <= 0:
            return True
        lo, hi = start // self.page_bytes, -(-(start + nbytes) // self.page_bytes)
        i = bisect.bisect_right(self._span_starts, lo) - 1
        return i >= 0 and self._page_spans[i][1] >= hi
