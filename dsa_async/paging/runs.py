"""Page arrays: runs, distinct pages, and the per-request form of a request's pages.

A request of a few pages is where the service spends its time per request, and numpy costs a
microsecond or two per call on arrays that small. So a request's pages are kept as a Python
``range`` when they are one ascending run (the common case) or a ``list[int]`` (``PageSeq``),
and the scheduler builds one numpy array per copy batch (:func:`concat_pages`), not per
request. The copy planners coalesce page pairs into runs ``(src_start, dst_start,
length_pages)`` where both sides advance together (:func:`page_runs`).

Everything here is a pure, vectorized (numpy), non-blocking, thread-safe primitive on pages
that are already valid; turning a request's tokens into pages is :mod:`.tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

#: Pages of one request, in request order, each page once.
PageSeq = range | list[int]

#: A request's pages when it has none.
NO_PAGES = range(0)

#: Up to this many values, a byte compare with a run made without a Python loop is the
#: cheapest run check; beyond it, copying the values costs more than comparing neighbours in
#: place. numpy keeps the GIL through element-wise loops of at most 500 elements, and lets go
#: of it in ``np.arange`` (a thread that lets go of the GIL waits to get it back while another
#: thread runs Python: 0.3-0.6 ms per call on average against a busy thread).
_SMALL_RUN = 500
#: ``0, 1, ..., _RUNS - 1``, read-only (1 MiB): short runs within it are compared with and
#: copied from slices of it (0.3 us, where ``np.arange`` took 0.4 and an addition to a short
#: constant 0.6-0.9 in the request path). It covers the page numbers of pools of up to 131,072
#: pages and the first 2,048 pages' tokens; past it the addition is used.
_RUNS = 1 << 17
_RUN = np.arange(_RUNS, dtype=np.int64)
_RUN.flags.writeable = False
_RUN_BYTES = _RUN[:_SMALL_RUN].tobytes()


def is_run(values: np.ndarray) -> bool:
    """Whether a non-empty integer array is one ascending run ``first, first + 1, ..., last``."""
    return is_run_between(values, values.item(0), values.item(-1))


def is_run_between(values: np.ndarray, first: int, last: int) -> bool:
    """:func:`is_run` for a caller that has read the first and last values already."""
    n = values.size
    if last - first != n - 1:
        return False
    if n <= _SMALL_RUN and values.dtype == np.int64:
        if n == 1:
            return True
        if 0 <= first and last < _RUNS:
            return values.tobytes() == _RUN[first:last + 1].tobytes()
        return (values - first).tobytes() == _RUN_BYTES[:8 * n]
    # Strictly increasing integers spanning exactly n - 1 are consecutive.
    return n == 1 or bool((values[1:] > values[:-1]).all())


def unique_in_order(values: np.ndarray) -> np.ndarray:
    """Distinct values of a 1-D array in the order they first appear."""
    if values.size <= 1:
        return values.copy()
    steps = values[1:] - values[:-1]
    if (steps >= 0).all():  # sorted: drop repeats without a sort
        keep = np.empty(values.size, dtype=bool)
        keep[0] = True
        np.not_equal(steps, 0, out=keep[1:])
        return values[keep]
    _, first = np.unique(values, return_index=True)
    return values[np.sort(first)]


def count_distinct(values: np.ndarray) -> int:
    """How many distinct values a 1-D integer array holds."""
    if values.size <= 1:
        return int(values.size)
    steps = values[1:] - values[:-1]
    if (steps >= 0).all():
        return int(np.count_nonzero(steps)) + 1
    return int(np.unique(values).size)


#: Up to this many bound pages per requested page, "each page once" is checked with a map of
#: the side's pages (a few us); beyond it, with a sort of the request's pages.
_MAP_PAGES_PER_PAGE = 64


def distinct(pages: np.ndarray, bound_pages: int | None = None) -> bool:
    """Whether a 1-D integer array holds no value twice. ``bound_pages``: every value is known
    to lie in ``[0, bound_pages)`` (then a map of that size may be used instead of a sort)."""
    n = pages.size
    if n <= 1:
        return True
    if bound_pages is not None and bound_pages <= _MAP_PAGES_PER_PAGE * n:
        seen = np.zeros(bound_pages, dtype=np.bool_)
        seen[pages] = True
        return int(np.count_nonzero(seen)) == n
    ordered = np.sort(pages)
    return not np.count_nonzero(ordered[1:] == ordered[:-1])


#: From this many pages on, a list of pages also keeps them as an array (:class:`PageList`).
_ARRAY_PAGES = 16


class PageList(list):
    """A long request's pages as a list (what the page table reads) that also keeps them as an
    ``int64`` array of its own (``array``, never written), so that a copy batch of that request
    alone takes the array instead of converting the list back (~50 us per 1,024 pages)."""

    __slots__ = ("array",)

    def __reduce__(self):
        """Copies and pickles are plain lists: only the original keeps (and matches) the
        array."""
        return (list, (list(self),))


def compact(pages: np.ndarray) -> PageSeq:
    """Distinct pages (``int64 [n]``) as a ``range`` if they are one ascending run, else a list
    (a :class:`PageList` from ``_ARRAY_PAGES`` on)."""
    n = pages.size
    if n == 0:
        return NO_PAGES
    if is_run(pages):
        first = pages.item(0)
        return range(first, first + n)
    if n < _ARRAY_PAGES:
        return pages.tolist()
    seq = PageList(pages.tolist())
    seq.array = np.array(pages, dtype=np.int64)  # a copy: the caller's array may change
    return seq


def run_array(start: int, stop: int) -> np.ndarray:
    """``np.arange(start, stop)`` as ``int64``, without letting go of the GIL when short."""
    if 0 <= stop - start <= _SMALL_RUN:
        if 0 <= start and stop <= _RUNS:
            return _RUN[start:stop].copy()  # writable, as np.arange's (torch warns otherwise)
        return _RUN[:stop - start] + start
    return np.arange(start, stop, dtype=np.int64)


def concat_pages(seqs: Sequence[PageSeq], count: int) -> np.ndarray:
    """One ``int64 [count]`` array of the pages of ``seqs``, in order (one per copy batch; it
    may be a :class:`PageList`'s own array: read it, never write it)."""
    if len(seqs) == 1:  # a batch of one request
        seq = seqs[0]
        if type(seq) is range:
            return run_array(seq.start, seq.stop)
        if type(seq) is PageList:
            return seq.array
    return np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=count)


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> np.ndarray:
    """Coalesce page pairs into runs where both sides advance together.

    Returns ``int64 [n_runs, 3]`` rows ``(src_start, dst_start, length_pages)``; expanding the
    rows reproduces the pairs exactly, in order.
    """
    n = src_pages.size
    assert dst_pages.size == n, "page_runs needs pairs"
    if n == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.ones(n, dtype=bool)
    breaks[1:] = (np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)
    starts = np.flatnonzero(breaks)
    lengths = np.diff(np.append(starts, n))
    return np.stack([src_pages[starts], dst_pages[starts], lengths], axis=1).astype(np.int64)


def expand_runs(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`page_runs`: the ``(src_pages, dst_pages)`` the runs stand for."""
    if runs.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy()
    lengths = runs[:, 2]
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(runs[:, 0], lengths) + offsets, np.repeat(runs[:, 1], lengths) + offsets


def page_tokens(pages: np.ndarray, page_size_tokens: int) -> np.ndarray:
    """All token indices of ``pages`` (``int64 [n_pages * page_size_tokens]``), page by page."""
    return (pages[:, None] * page_size_tokens + np.arange(page_size_tokens)).reshape(-1)
