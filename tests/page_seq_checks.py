"""A check shared by the page-form tests: what a request's pages may look like."""

from __future__ import annotations

import numpy as np

from dsa_async.paging.runs import PageList


def page_seq_values(pages) -> list[int]:
    """The values of a request's pages, after checking their form: a ``range``, a ``list`` of
    ints, or a :class:`PageList` whose own ``int64`` array holds the same values."""
    assert type(pages) in (range, list, PageList), type(pages)
    if type(pages) is PageList:
        assert pages.array.dtype == np.int64 and pages.array.ndim == 1
        assert pages.array.tolist() == list(pages)
    return list(pages)
