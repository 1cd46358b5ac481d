"""Whole pages given as tokens, recognised at vectorized cost.

Servers hand over a long sequence as every token of each of its pages, the pages in any
order: ``[p0 * 64 + 0, ..., p0 * 64 + 63, p1 * 64 + 0, ...]``. Finding the pages of such a
request the general way (a sort of every token to drop duplicates) costs ~9 us per page. Here
the same answer costs one pass of arithmetic over the tokens and a sort of the pages:

* viewed as ``[n_pages, page_size]`` rows, every row's first token is page-aligned and the row
  is that token plus ``0 .. page_size - 1``;
* the pages (first token // page size) are distinct and lie inside the side's slots.

Anything else (a partial page, a page given twice, a shifted offset, a value out of range) is
not recognised: the caller then takes the general path, which gives the same pages for what it
accepts and the same errors for what it refuses. Pure, non-blocking, thread-safe.
"""

from __future__ import annotations

import numpy as np

#: Up to this many bound pages per requested page, "each page once" is checked with a map of
#: the side's pages (a few us); beyond it, with a sort of the request's pages.
_MAP_PAGES_PER_PAGE = 64


def aligned_pages(tokens: np.ndarray, page_size_tokens: int, upper_bound: int
                  ) -> np.ndarray | None:
    """The pages of ``tokens`` (``int64 [n_pages * page_size]``) when it holds every token of
    each of its pages in order, each page once, all below ``upper_bound`` tokens; as
    ``int64 [n_pages]`` in request order. ``None`` for anything else."""
    ps = page_size_tokens
    n = tokens.size
    if n == 0 or n % ps:
        return None
    first = tokens[::ps]  # each row's first token
    if ps & (ps - 1) == 0:  # a power of two: masks and shifts, not divisions
        if np.count_nonzero(first & (ps - 1)):
            return None
        pages = first >> (ps.bit_length() - 1)
    else:
        if np.count_nonzero(first % ps):
            return None
        pages = first // ps
    bound_pages = upper_bound // ps
    if pages.min() < 0 or pages.max() >= bound_pages:
        return None
    if not distinct(pages, bound_pages):
        return None  # a page given twice: the general path drops the repeat
    # Within each row every token is the one before plus 1; from an aligned, valid first token
    # that makes the row first + 0 .. ps - 1 (exact even in wrapping int64 arithmetic: fewer
    # than ps steps of +1 from a valid token cannot wrap). The step from a row's last token to
    # the next row's first is free, so it is overwritten with 1; then every step must be 1:
    # one subtraction pass and two reductions over the tokens.
    if n > 1:
        steps = tokens[1:] - tokens[:-1]
        steps[ps - 1::ps] = 1
        if steps.min() != 1 or steps.max() != 1:
            return None
    return pages


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
