"""Tokens to whole pages: padding, pairing, validation and page runs.

Nothing below this module ever sees a partial page. A request names tokens (slots in a paged
cache); this module turns them into the whole pages that hold them, counts the padding tokens
that came along, checks that host/device pairs keep their in-page offset, and coalesces page
pairs into runs ``(src_start, dst_start, length_pages)`` where both sides advance together.

Worked example, 64-token pages: device tokens ``[70, 71, 200]`` live in pages ``[1, 3]``;
those pages hold 128 tokens, 3 were asked for, so 125 are padding. A host/device pair is legal
only when ``host % 64 == device % 64`` (the page is block-split, so a token can only move with
its page, to the same position in another page).

All functions are pure, vectorized (numpy), non-blocking, and return fresh ``int64`` arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import IndexTypeError, IndexValueError, PageAlignmentError

IndexLike = torch.Tensor | np.ndarray | Sequence[int] | range


def as_index_array(value: IndexLike, *, name: str, upper_bound: int | None = None) -> np.ndarray:
    """Validate an index argument and return it as a 1-D ``int64`` numpy array (shape ``[n]``).

    See :func:`checked_index_array`, which also says whether the indices form one range."""
    return checked_index_array(value, name=name, upper_bound=upper_bound)[0]


def checked_index_array(value: IndexLike, *, name: str, upper_bound: int | None = None,
                        unit: str = "slots") -> tuple[np.ndarray, bool]:
    """Validate an index argument: ``(int64 [n] array, whether it is one ascending range)``.

    Accepts a 1-D integer CPU tensor, a 1-D integer numpy array, or a sequence of ints.
    ``upper_bound`` (exclusive) is checked when given; ``unit`` names what the indices count
    in the out-of-range message ("slots": token slots, or "pages"). Raises ``IndexTypeError``
    for a wrong type, dtype or device and ``IndexValueError`` for a wrong shape, layout or value.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise IndexTypeError(
                f"{name} is on device {value.device}; index tensors must be on the CPU "
                f"(the page table is kept on the host): pass {name}.cpu()"
            )
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise IndexTypeError(
                f"{name} has dtype {value.dtype}; token and page indices must be integers: "
                f"pass {name}.long()"
            )
        if value.dim() == 1 and not value.is_contiguous():
            raise IndexValueError(
                f"{name} is a non-contiguous view (stride {value.stride()}); "
                f"pass {name}.contiguous()"
            )
        array = value.numpy()
    elif isinstance(value, np.ndarray):
        array = value
        if array.dtype.kind not in "iu":
            raise IndexTypeError(
                f"{name} has dtype {array.dtype}; token and page indices must be integers"
            )
    elif isinstance(value, (Sequence, range)) and not isinstance(value, (str, bytes)):
        try:
            array = np.asarray(value, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise IndexTypeError(f"{name} must hold integers only: {exc}") from None
        if array.ndim == 1 and len(value) and not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
        ):
            raise IndexTypeError(f"{name} must hold integers only, got {list(value)[:4]!r}...")
    else:
        raise IndexTypeError(
            f"{name} must be a 1-D integer tensor, numpy array or sequence of ints, "
            f"got {type(value).__name__}"
        )
    if array.ndim != 1:
        raise IndexValueError(
            f"{name} must be 1-D, got shape {tuple(array.shape)}; flatten it with .reshape(-1)"
        )
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size:
        # Values of 2**63 and above would wrap to negatives in int64: refuse them as given.
        too_large = array > _INT64_MAX
        if too_large.any():
            at = int(np.argmax(too_large))
            raise _out_of_range(name, at, int(array[at]), upper_bound, unit)
    array = array.astype(np.int64, copy=False)
    is_range = False
    if array.size:
        is_range = is_run(array)
        low, high = (int(array[0]), int(array[-1])) if is_range else (
            int(array.min()), int(array.max()))
        if low < 0:
            at = int(np.argmax(array < 0))
            raise IndexValueError(f"{name}[{at}] = {int(array[at])} is negative; indices start at 0")
        if upper_bound is not None:
            if high >= upper_bound:
                at = int(np.argmax(array >= upper_bound))
                raise _out_of_range(name, at, int(array[at]), upper_bound, unit)
    return array, is_range


_INT64_MAX = np.iinfo(np.int64).max


def _out_of_range(name: str, at: int, value: int, upper_bound: int | None,
                  unit: str) -> IndexValueError:
    if upper_bound is None:
        return IndexValueError(
            f"{name}[{at}] = {value} is out of range: indices are int64 (at most {_INT64_MAX})")
    return IndexValueError(
        f"{name}[{at}] = {value} is out of range: this side holds {upper_bound} {unit} "
        f"(valid 0..{upper_bound - 1})"
    )


#: Up to this many values, one arange and a byte compare is the cheapest run check; beyond it,
#: copying the values costs more than comparing neighbours in place.
_SMALL_RUN = 512


def is_run(values: np.ndarray) -> bool:
    """Whether a non-empty integer array is one ascending run ``first, first + 1, ..., last``."""
    n = values.size
    first = values.item(0)
    if values.item(-1) - first != n - 1:
        return False
    if n <= _SMALL_RUN and values.dtype == np.int64:
        return n == 1 or np.arange(first, first + n, dtype=np.int64).tobytes() == values.tobytes()
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


def _count_distinct(values: np.ndarray) -> int:
    if values.size <= 1:
        return int(values.size)
    steps = values[1:] - values[:-1]
    if (steps >= 0).all():
        return int(np.count_nonzero(steps)) + 1
    return int(np.unique(values).size)


@dataclass(frozen=True)
class PagedTokens:
    """Whole pages holding a set of tokens (``pages``: ``int64 [n_pages]``, request order)."""

    pages: np.ndarray
    num_tokens: int  #: distinct tokens asked for
    padding_tokens: int  #: tokens that came along to fill whole pages

    @property
    def num_pages(self) -> int:
        return int(self.pages.size)


def tokens_to_pages(tokens: np.ndarray, page_size_tokens: int, *,
                    is_range: bool | None = None) -> PagedTokens:
    """The whole pages holding ``tokens`` (validated ``int64 [n]``), duplicates removed.

    ``is_range``: whether the tokens are one ascending range, when the caller already knows.
    """
    n = tokens.size
    if n and (is_run(tokens) if is_range is None else is_range):
        # One ascending range (the common case): no sort, no unique.
        first, last = int(tokens[0]) // page_size_tokens, int(tokens[-1]) // page_size_tokens
        pages = np.arange(first, last + 1, dtype=np.int64)
        return PagedTokens(pages, n, pages.size * page_size_tokens - n)
    pages = unique_in_order(tokens // page_size_tokens)
    distinct = _count_distinct(tokens)
    return PagedTokens(pages, distinct, pages.size * page_size_tokens - distinct)


@dataclass(frozen=True)
class PagePairs:
    """Host/device page pairs (each ``int64 [n_pages]``), in request order, each page once."""

    host_pages: np.ndarray
    device_pages: np.ndarray
    num_tokens: int
    padding_tokens: int

    @property
    def num_pages(self) -> int:
        return int(self.host_pages.size)


def pair_tokens_to_pages(
    host_tokens: np.ndarray, device_tokens: np.ndarray, page_size_tokens: int
) -> PagePairs:
    """Pair host and device tokens (validated ``int64 [n]`` each) into whole-page pairs.

    Legal only when each pair shares its in-page offset and each host page pairs with exactly
    one device page (and back); otherwise ``PageAlignmentError`` names the first offending pair.
    """
    if host_tokens.size != device_tokens.size:
        raise IndexValueError(
            f"host_tokens has {host_tokens.size} entries but device_tokens has "
            f"{device_tokens.size}; pairs need the same length"
        )
    ps = page_size_tokens
    host_offsets = host_tokens % ps
    device_offsets = device_tokens % ps
    bad = np.flatnonzero(host_offsets != device_offsets)
    if bad.size:
        i = int(bad[0])
        h, d = int(host_tokens[i]), int(device_tokens[i])
        raise PageAlignmentError(
            f"pair {i}: host token {h} sits at offset {h % ps} of host page {h // ps} but "
            f"device token {d} sits at offset {d % ps} of device page {d // ps} "
            f"(page size {ps} tokens). A page is block-split and moves whole, so paired tokens "
            f"must share their in-page offset: pick host slots with the same offset "
            f"(e.g. from allocate_host_pages) or let the service choose host pages"
        )
    host_pages_all = host_tokens // ps
    device_pages_all = device_tokens // ps
    host_pages, device_pages, conflict = _unique_pairs(host_pages_all, device_pages_all)
    if conflict is not None:
        side, j, page, first_partner = conflict
        other = device_pages_all if side == "host" else host_pages_all
        raise PageAlignmentError(
            f"pair {j}: {side} page {page} (host token {int(host_tokens[j])}, device token "
            f"{int(device_tokens[j])}) is paired with two different pages "
            f"({first_partner} and {int(other[j])}) with page size {ps} tokens; a page moves "
            f"whole, so all tokens of one page must go to one page on the other side"
        )
    distinct = _count_distinct(device_tokens)
    return PagePairs(host_pages, device_pages, distinct, host_pages.size * ps - distinct)


def pair_pages(host_pages: np.ndarray, device_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host/device page pairs given as pages (validated ``int64 [n]`` each, same length), each
    pair once, in request order. A page paired with two different pages is refused
    (``PageAlignmentError`` names the first such pair)."""
    assert host_pages.size == device_pages.size, "the caller checks the lengths"
    host, device, conflict = _unique_pairs(host_pages, device_pages)
    if conflict is not None:
        side, j, page, first_partner = conflict
        other = device_pages if side == "host" else host_pages
        raise PageAlignmentError(
            f"pair {j}: {side} page {page} is paired with two different pages "
            f"({first_partner} and {int(other[j])}); a page moves whole to one page, so each "
            f"page may be paired with one page on the other side only"
        )
    return host, device


def _unique_pairs(host_pages_all: np.ndarray, device_pages_all: np.ndarray):
    """Distinct ``(host page, device page)`` pairs in first-occurrence order, and ``None`` or
    the first conflict ``(side, pair index, page, its first partner)`` when a page of one side
    pairs with two pages of the other (the pair set must be a bijection)."""
    span = int(device_pages_all.max()) + 1 if device_pages_all.size else 1
    keys = host_pages_all * span + device_pages_all  # one key per pair
    unique_keys = unique_in_order(keys)
    host_pages = unique_keys // span
    device_pages = unique_keys % span
    for side, pages in (("host", host_pages), ("device", device_pages)):
        if _count_distinct(pages) != pages.size:
            _, first, counts = np.unique(pages, return_index=True, return_counts=True)
            page = int(pages[first[counts > 1].min()])
            mine = host_pages_all if side == "host" else device_pages_all
            other = device_pages_all if side == "host" else host_pages_all
            where = np.flatnonzero(mine == page)
            partners = other[where]
            j = int(where[np.argmax(partners != partners[0])])
            return host_pages, device_pages, (side, j, page, int(partners[0]))
    return host_pages, device_pages, None


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
