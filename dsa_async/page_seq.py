"""The per-request form of pages: a ``range`` when they are one ascending run, else a list.

A request of a few pages is where the service spends its time per request, and numpy costs a
microsecond or two per call on arrays that small. So the front door turns a request's tokens
into whole pages as a Python ``range`` (the common case: a token range, or a tensor holding
one) or a ``list[int]``, and the scheduler builds one numpy array per copy batch, not per
request. Anything the fast path does not recognise goes through the full validation in
:mod:`dsa_async.pages`, which raises the same errors it always did.

All functions are pure and non-blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from .pages import IndexLike, checked_index_array, is_run, pair_tokens_to_pages, tokens_to_pages

#: Pages of one request, in request order, each page once.
PageSeq = range | list[int]

_EMPTY = range(0)
_INT64 = torch.int64
_NP_INT64 = np.dtype(np.int64)


def _token_range(value: IndexLike, upper_bound: int) -> range | None:
    """``value`` as a validated ascending token range within ``[0, upper_bound)``, or ``None``
    when it is anything else (the caller then validates it in full and raises what is wrong)."""
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
        return None
    return range(first, last + 1)


def compact(pages: np.ndarray) -> PageSeq:
    """Distinct pages (``int64 [n]``) as a ``range`` if they are one ascending run, else a list."""
    n = pages.size
    if n == 0:
        return _EMPTY
    if is_run(pages):
        first = pages.item(0)
        return range(first, first + n)
    return pages.tolist()


def tokens_to_page_seq(tokens: IndexLike, name: str, upper_bound: int,
                       page_size_tokens: int) -> tuple[PageSeq, int]:
    """The whole pages holding ``tokens`` and the padding tokens that come along.

    Raises ``IndexTypeError``/``IndexValueError`` (see :func:`pages.checked_index_array`)."""
    tokens_range = _token_range(tokens, upper_bound)
    ps = page_size_tokens
    if tokens_range is not None:
        if not tokens_range:
            return _EMPTY, 0
        pages = range(tokens_range.start // ps, (tokens_range.stop - 1) // ps + 1)
        return pages, len(pages) * ps - len(tokens_range)
    array, is_range = checked_index_array(tokens, name=name, upper_bound=upper_bound)
    paged = tokens_to_pages(array, ps, is_range=is_range)
    return compact(paged.pages), paged.padding_tokens


def paired_page_seqs(host_tokens: IndexLike, device_tokens: IndexLike, *, host_bound: int,
                     device_bound: int, page_size_tokens: int) -> tuple[PageSeq, PageSeq, int]:
    """Host and device pages paired in request order, and the padding tokens.

    Raises as :func:`pages.pair_tokens_to_pages` does (``PageAlignmentError`` names the first
    pair whose in-page offsets differ)."""
    ps = page_size_tokens
    host = _token_range(host_tokens, host_bound)
    device = _token_range(device_tokens, device_bound)
    if (host is not None and device is not None and len(host) == len(device)
            and (host.start - device.start) % ps == 0):
        if not host:
            return _EMPTY, _EMPTY, 0
        host_pages = range(host.start // ps, (host.stop - 1) // ps + 1)
        device_pages = range(device.start // ps, device.start // ps + len(host_pages))
        return host_pages, device_pages, len(host_pages) * ps - len(host)
    host_array, _ = checked_index_array(host_tokens, name="host_tokens", upper_bound=host_bound)
    device_array, _ = checked_index_array(device_tokens, name="device_tokens",
                                          upper_bound=device_bound)
    pairs = pair_tokens_to_pages(host_array, device_array, ps)
    return compact(pairs.host_pages), compact(pairs.device_pages), pairs.padding_tokens


def concat_pages(seqs: Sequence[PageSeq], count: int) -> np.ndarray:
    """One ``int64 [count]`` array of the pages of ``seqs``, in order (one per copy batch)."""
    if len(seqs) == 1 and type(seqs[0]) is range:  # a batch of one request
        return np.arange(seqs[0].start, seqs[0].stop, dtype=np.int64)
    return np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=count)

