"""The per-request form of pages: a ``range`` when they are one ascending run, else a list.

A request of a few pages is where the service spends its time per request, and numpy costs a
microsecond or two per call on arrays that small. So the front door turns a request's tokens
into whole pages as a Python ``range`` (the common case: a token range, or a tensor holding
one) or a ``list[int]``, and the scheduler builds one numpy array per copy batch, not per
request. Long requests come in two more forms that cost O(pages) Python work and one
vectorized pass over the tokens: every token of each page, pages in any order
(:mod:`aligned_tokens`), and page indices given directly (:class:`page_indices.Pages`).
Anything the fast paths do not recognise goes through the full validation in
:mod:`dsa_async.pages`, which raises the same errors it always did.

All functions are pure, non-blocking and thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from .aligned_tokens import aligned_pages, distinct
from .errors import IndexTypeError, IndexValueError
from .page_indices import Pages
from .pages import (
    IndexLike,
    checked_index_array,
    is_run,
    pair_pages,
    pair_tokens_to_pages,
    tokens_to_pages,
    unique_in_order,
)

#: Pages of one request, in request order, each page once.
PageSeq = range | list[int]

_EMPTY = range(0)
_INT64 = torch.int64
_NP_INT64 = np.dtype(np.int64)


def _fast_form(value: IndexLike, upper_bound: int) -> range | np.ndarray | None:
    """``value`` as a validated ascending range within ``[0, upper_bound)``; else, for a 1-D
    contiguous ``int64`` CPU tensor or array, its (unvalidated) numpy view; else ``None``. The
    caller validates anything that is not a range in full, which raises what is wrong."""
    if type(value) is torch.Tensor:
        if (value.dtype is not _INT64 or not value.is_cpu or value.dim() != 1
                or not value.is_contiguous()):
            return None
        array = value.numpy()
    elif type(value) is np.ndarray:
        if value.dtype is not _NP_INT64 or value.ndim != 1:
            return None
        array = value
    elif type(value) is range:
        if value.step != 1 or value.start < 0 or value.stop > upper_bound:
            return None
        return value
    else:
        return None
    n = array.size
    if n == 0:
        return _EMPTY
    first, last = array.item(0), array.item(-1)
    if first < 0 or last >= upper_bound or not is_run(array):
        return array
    return range(first, last + 1)


def _aligned(form: range | np.ndarray | None, ps: int, upper_bound: int
             ) -> range | np.ndarray | None:
    """The pages of a fast form that holds every token of each of its pages, in order, each
    page once, within bounds (see :mod:`aligned_tokens`); ``None`` otherwise."""
    if type(form) is range:
        if not form or form.start % ps or len(form) % ps:
            return None
        return range(form.start // ps, form.stop // ps)
    if form is None:
        return None
    return aligned_pages(form, ps, upper_bound)


def compact(pages: np.ndarray) -> PageSeq:
    """Distinct pages (``int64 [n]``) as a ``range`` if they are one ascending run, else a list."""
    n = pages.size
    if n == 0:
        return _EMPTY
    if is_run(pages):
        first = pages.item(0)
        return range(first, first + n)
    return pages.tolist()


def tokens_to_page_seq(tokens: IndexLike | Pages, name: str, upper_bound: int,
                       page_size_tokens: int) -> tuple[PageSeq, int]:
    """The whole pages holding ``tokens`` and the padding tokens that come along.

    ``tokens`` may be :class:`Pages` (page indices given directly: no padding). Raises
    ``IndexTypeError``/``IndexValueError`` (see :func:`pages.checked_index_array`)."""
    ps = page_size_tokens
    if isinstance(tokens, Pages):
        pages = _given_pages(tokens, name, upper_bound // ps)
        if type(pages) is not np.ndarray:
            return pages, 0
        return compact(pages if distinct(pages) else unique_in_order(pages)), 0
    form = _fast_form(tokens, upper_bound)
    if type(form) is range:
        if not form:
            return _EMPTY, 0
        pages = range(form.start // ps, (form.stop - 1) // ps + 1)
        return pages, len(pages) * ps - len(form)
    if form is not None:
        aligned = aligned_pages(form, ps, upper_bound)
        if aligned is not None:
            return compact(aligned), 0
    array, is_range = checked_index_array(tokens, name=name, upper_bound=upper_bound)
    paged = tokens_to_pages(array, ps, is_range=is_range)
    return compact(paged.pages), paged.padding_tokens


def paired_page_seqs(host_tokens: IndexLike | Pages, device_tokens: IndexLike | Pages, *,
                     host_bound: int, device_bound: int, page_size_tokens: int
                     ) -> tuple[PageSeq, PageSeq, int]:
    """Host and device pages paired in request order, and the padding tokens.

    Both sides may be :class:`Pages` (not one of them). Raises as
    :func:`pages.pair_tokens_to_pages` does (``PageAlignmentError`` names the first pair whose
    in-page offsets differ)."""
    ps = page_size_tokens
    host_is_pages, device_is_pages = isinstance(host_tokens, Pages), isinstance(device_tokens,
                                                                                 Pages)
    if host_is_pages or device_is_pages:
        if not (host_is_pages and device_is_pages):
            given, other = (("host_tokens", "device_tokens") if host_is_pages
                            else ("device_tokens", "host_tokens"))
            raise IndexTypeError(
                f"{given} is given as Pages but {other} as token indices; pairs are matched "
                f"position by position, so give both sides in one form: wrap {other} in "
                f"Pages(...) too, or pass {given} as token indices")
        return _paired_given_pages(host_tokens, device_tokens, host_bound // ps,
                                   device_bound // ps)
    host = _fast_form(host_tokens, host_bound)
    device = _fast_form(device_tokens, device_bound)
    if (type(host) is range and type(device) is range and len(host) == len(device)
            and (host.start - device.start) % ps == 0):
        if not host:
            return _EMPTY, _EMPTY, 0
        host_pages = range(host.start // ps, (host.stop - 1) // ps + 1)
        device_pages = range(device.start // ps, device.start // ps + len(host_pages))
        return host_pages, device_pages, len(host_pages) * ps - len(host)
    host_aligned = _aligned(host, ps, host_bound)
    if host_aligned is not None:
        device_aligned = _aligned(device, ps, device_bound)
        if device_aligned is not None and len(host_aligned) == len(device_aligned):
            # Both sides whole pages, row by row, each page once: the rows pair page to page.
            return _seq(host_aligned), _seq(device_aligned), 0
    host_array, _ = checked_index_array(host_tokens, name="host_tokens", upper_bound=host_bound)
    device_array, _ = checked_index_array(device_tokens, name="device_tokens",
                                          upper_bound=device_bound)
    pairs = pair_tokens_to_pages(host_array, device_array, ps)
    return compact(pairs.host_pages), compact(pairs.device_pages), pairs.padding_tokens


def _seq(pages: range | list[int] | np.ndarray) -> PageSeq:
    return compact(pages) if type(pages) is np.ndarray else pages


#: Up to this many pages, ``Pages`` are checked in Python: numpy costs a microsecond or more per
#: call on arrays this small.
_SMALL_PAGES = 16


def _given_pages(given: Pages, name: str, bound_pages: int) -> range | list[int] | np.ndarray:
    """The validated indices of ``given``: a ``range`` or ``list`` of distinct pages, or
    ``int64 [n]`` (which may hold a page twice)."""
    value = given.pages
    form = _fast_form(value, bound_pages)
    if type(form) is range:
        return form
    if form is not None:
        few = form.tolist() if form.size <= _SMALL_PAGES else None
    elif type(value) is list and len(value) <= _SMALL_PAGES and all(type(p) is int
                                                                    for p in value):
        few = list(value)
    else:
        few = None
    if few and min(few) >= 0 and max(few) < bound_pages and len(set(few)) == len(few):
        first = few[0]
        return range(first, first + len(few)) if few == list(range(first, first + len(few))) \
            else few
    array, _ = checked_index_array(value, name=f"{name}.pages", upper_bound=bound_pages,
                                   unit="pages")
    return array


def _paired_given_pages(host: Pages, device: Pages, host_bound_pages: int,
                        device_bound_pages: int) -> tuple[PageSeq, PageSeq, int]:
    host_pages = _given_pages(host, "host_tokens", host_bound_pages)
    device_pages = _given_pages(device, "device_tokens", device_bound_pages)
    if len(host_pages) != len(device_pages):
        raise IndexValueError(
            f"host_tokens has {len(host_pages)} pages but device_tokens has "
            f"{len(device_pages)}; pairs need the same length")
    host_distinct = type(host_pages) is not np.ndarray or distinct(host_pages)
    if host_distinct and (type(device_pages) is not np.ndarray or distinct(device_pages)):
        return _seq(host_pages), _seq(device_pages), 0
    host_array = np.asarray(host_pages, dtype=np.int64)
    device_array = np.asarray(device_pages, dtype=np.int64)
    host_unique, device_unique = pair_pages(host_array, device_array)
    return compact(host_unique), compact(device_unique), 0


def concat_pages(seqs: Sequence[PageSeq], count: int) -> np.ndarray:
    """One ``int64 [count]`` array of the pages of ``seqs``, in order (one per copy batch)."""
    if len(seqs) == 1 and type(seqs[0]) is range:  # a batch of one request
        return np.arange(seqs[0].start, seqs[0].stop, dtype=np.int64)
    return np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=count)

