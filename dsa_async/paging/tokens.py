"""Tokens to whole pages: validation, padding and pairing, in one walk over a request's indices.

Nothing past this module ever sees a partial page. A request names tokens (slots in a paged
cache), or pages directly (:class:`Pages`); this module checks them, turns them into the whole
pages that hold them (a ``PageSeq``, see :mod:`.runs`), counts the padding tokens that came
along, and checks that host/device pairs keep their in-page offset.

Worked example, 64-token pages: device tokens ``[70, 71, 200]`` live in pages ``[1, 3]``;
those pages hold 128 tokens, 3 were asked for, so 125 are padding. A host/device pair is legal
only when ``host % 64 == device % 64`` (the page is block-split, so a token can only move with
its page, to the same position in another page).

The walk (:func:`tokens_to_page_seq`, :func:`paired_page_seqs`) takes the cheapest form that
recognises the input, and each form costs O(pages) Python work and at most one vectorized pass
over the tokens:

* a token range, or a 1-D ``int64`` tensor or array holding one: a ``range`` of pages, no copy;
* every token of each page, the pages in any order, each page once (how servers hand over a
  long sequence: ``[p0 * 64 + 0, ..., p0 * 64 + 63, p1 * 64 + 0, ...]``): viewed as
  ``[n_pages, page_size]`` rows, every row's first token is page-aligned and the row is that
  token plus ``0 .. page_size - 1`` (:func:`aligned_pages`);
* :class:`Pages`: page indices given directly, no padding.

Anything else (partial pages, duplicates, shifted offsets, values out of range, other dtypes)
takes the general path (:func:`checked_index_array`, :func:`tokens_to_pages`,
:func:`pair_tokens_to_pages`), which is as strict as ever: it gives the same pages for what the
fast forms accept, and the errors for what it refuses. Pure, non-blocking, thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import IndexTypeError, IndexValueError, PageAlignmentError, shown
from .runs import (NO_PAGES, PageSeq, compact, count_distinct, distinct, is_run, is_run_between,
                   run_array, unique_in_order)
from .tensor_view import plain_int64_view

#: An index argument: a 1-D integer CPU tensor, numpy array, sequence of ints, or range.
IndexLike = torch.Tensor | np.ndarray | Sequence[int] | range

_NP_INT64 = np.dtype(np.int64)


@dataclass(frozen=True, slots=True)
class Pages:
    """Page indices (``pages``: ``int [n_pages]``), accepted for ``device_tokens`` and
    ``host_tokens``. Holds the indices as given (no copy); they are read when the request is
    submitted. Constructing one does not validate anything and never blocks.

    A caller that already thinks in pages (a page table, a radix tree of pages) would otherwise
    expand each page into its tokens only for the service to fold them back. ``Pages(indices)``
    stands for every token of those pages, in that order, so these two calls ask for the same
    copy (64-token pages)::

        service.evict(Pages(torch.tensor([7, 2])))
        service.evict(torch.cat([torch.arange(448, 512), torch.arange(128, 192)]))

    The indices are checked like token indices (a 1-D integer CPU tensor, numpy array, sequence
    or range; no negatives; below the side's page count), and a page given twice counts once, as
    a token given twice does. With ``host_tokens=`` both sides must be ``Pages``: pairs are page
    by page, in order, and a page may pair with one page on the other side only.
    """

    pages: IndexLike

    def __repr__(self) -> str:
        pages = self.pages
        shape = getattr(pages, "shape", None)
        if shape is None and isinstance(pages, range):
            return f"Pages({pages!r})"
        size = f"shape {tuple(shape)}" if shape is not None else f"len {len(pages)}" \
            if hasattr(pages, "__len__") else "unsized"
        return f"Pages({type(pages).__name__}, {size})"


# --- the walk -------------------------------------------------------------------------------


def tokens_to_page_seq(tokens: IndexLike | Pages, name: str, upper_bound: int,
                       page_size_tokens: int) -> tuple[PageSeq, int]:
    """The whole pages holding ``tokens`` and the padding tokens that come along.

    ``tokens`` may be :class:`Pages` (page indices given directly: no padding). Raises
    ``IndexTypeError``/``IndexValueError`` (see :func:`checked_index_array`)."""
    ps = page_size_tokens
    if isinstance(tokens, Pages):
        pages = _given_pages(tokens, name, upper_bound // ps)
        if type(pages) is not np.ndarray:
            return pages, 0
        return compact(pages if distinct(pages) else unique_in_order(pages)), 0
    form = _fast_form(tokens, upper_bound)
    if type(form) is range:
        if not form:
            return NO_PAGES, 0
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
    :func:`pair_tokens_to_pages` does (``PageAlignmentError`` names the first pair whose
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
            return NO_PAGES, NO_PAGES, 0
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


# --- fast forms: recognised at O(pages) Python work and one pass over the tokens ------------


def _fast_form(value: IndexLike, upper_bound: int) -> range | np.ndarray | None:
    """``value`` as a validated ascending range within ``[0, upper_bound)``; else, for a 1-D
    contiguous ``int64`` CPU tensor or array, its (unvalidated) numpy view; else ``None``. The
    caller validates anything that is not a range in full, which raises what is wrong."""
    if type(value) is torch.Tensor:
        array = plain_int64_view(value)  # not value.numpy(): that lets go of the GIL
        if array is None:
            return None
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
        return NO_PAGES
    first, last = array.item(0), array.item(-1)
    if first < 0 or last >= upper_bound or not is_run_between(array, first, last):
        return array
    return range(first, last + 1)


def _aligned(form: range | np.ndarray | None, ps: int, upper_bound: int
             ) -> range | np.ndarray | None:
    """The pages of a fast form that holds every token of each of its pages, in order, each
    page once, within bounds (see :func:`aligned_pages`); ``None`` otherwise."""
    if type(form) is range:
        if not form or form.start % ps or len(form) % ps:
            return None
        return range(form.start // ps, form.stop // ps)
    if form is None:
        return None
    return aligned_pages(form, ps, upper_bound)


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
    # one subtraction pass and one comparison pass over the tokens.
    if n > 1:
        steps = tokens[1:] - tokens[:-1]
        steps[ps - 1::ps] = 1
        if np.count_nonzero(steps != 1):
            return None
    return pages


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


# --- the general path: full validation, any order, duplicates, partial pages ---------------


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
        if value.layout is not torch.strided or value.is_nested:
            raise IndexTypeError(
                f"{name} is a {'nested' if value.is_nested else str(value.layout)} tensor; "
                f"index tensors must be dense: pass {name}.to_dense()"
            )
        if value.dtype not in _TORCH_INTEGER_DTYPES:
            raise IndexTypeError(
                f"{name} has dtype {value.dtype}; token and page indices must be integers: "
                f"pass {name}.long()"
            )
        array = value.resolve_neg().numpy()  # a lazily negated view: its values, as read
    elif isinstance(value, np.ndarray):
        if isinstance(value, np.ma.MaskedArray):
            raise IndexTypeError(
                f"{name} is a masked array; its masked entries have no index to copy: pass "
                f"{name}.compressed() (the unmasked values) or {name}.filled(value)"
            )
        array = np.asarray(value)  # a subclass (a memmap) as a plain array
        if array.dtype.kind not in "iu":
            raise IndexTypeError(
                f"{name} has dtype {array.dtype}; token and page indices must be integers"
            )
    elif type(value) is range:
        array = _range_array(value, name, upper_bound, unit)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        array = _sequence_array(value, name, upper_bound, unit)
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
_INT64_MIN = np.iinfo(np.int64).min
#: torch dtypes accepted for indices (quantized, bit-packed and float dtypes are not).
_TORCH_INTEGER_DTYPES = frozenset(
    getattr(torch, name) for name in (
        "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if hasattr(torch, name))


def _range_array(value: range, name: str, upper_bound: int | None, unit: str) -> np.ndarray:
    """A ``range``'s values as ``int64 [n]``, its bounds checked first from its ends (O(1)):
    a range far past the end is refused without being materialised, naming the same first
    bad element, in the same order of checks, as the same values given as a list."""
    if value:
        start, step = value.start, value.step
        low, high = min(value[0], value[-1]), max(value[0], value[-1])
        if high > _INT64_MAX or low < _INT64_MIN:  # outside int64: a list of them is refused so
            at = min(([_first_above(value, _INT64_MAX)] if high > _INT64_MAX else [])
                     + ([_first_below(value, _INT64_MIN)] if low < _INT64_MIN else []))
            if value[at] < 0:
                raise IndexValueError(
                    f"{name}[{at}] = {shown(value[at])} is negative; indices start at 0")
            raise _out_of_range(name, at, value[at], upper_bound, unit)
        if low < 0:
            at = _first_below(value, 0)
            raise IndexValueError(
                f"{name}[{at}] = {shown(value[at])} is negative; indices start at 0")
        if upper_bound is not None and high >= upper_bound:
            at = _first_above(value, upper_bound - 1)
            raise _out_of_range(name, at, value[at], upper_bound, unit)
        if len(value) == 1:  # its step may not even fit int64
            return np.array([start], dtype=np.int64)
        # start + step * i exactly (numpy's arange sizes itself in floating point)
        offsets = np.arange(len(value), dtype=np.int64)
        offsets *= step
        offsets += start
        return offsets
    return np.zeros(0, dtype=np.int64)


def _first_above(value: range, bound: int) -> int:
    """Index of the first element of a non-empty ``value`` above ``bound`` (one exists)."""
    step = value.step
    return max(0, (bound - value.start) // step + 1) if step > 0 else 0


def _first_below(value: range, bound: int) -> int:
    """Index of the first element of a non-empty ``value`` below ``bound`` (one exists)."""
    step = value.step
    return 0 if step > 0 else max(0, (value.start - bound) // -step + 1)


def _sequence_array(value: Sequence, name: str, upper_bound: int | None,
                    unit: str) -> np.ndarray:
    """A sequence of ints as an ``int64`` array (a nested one comes back with more than one
    dimension, for the caller's shape check). Anything but ints (bools included) is an
    ``IndexTypeError`` naming the first such element; an int outside int64 an
    ``IndexValueError`` naming it."""
    try:
        array = np.asarray(value, dtype=np.int64)
    except OverflowError:
        _raise_if_not_ints(value, name)
        at = next((i for i, v in enumerate(value) if not _INT64_MIN <= int(v) <= _INT64_MAX),
                   None)
        if at is None:
            raise
        if int(value[at]) < 0:
            raise IndexValueError(
                f"{name}[{at}] = {shown(int(value[at]))} is negative; indices start at 0"
            ) from None
        raise _out_of_range(name, at, int(value[at]), upper_bound, unit) from None
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: a tensor torch
        _raise_if_not_ints(value, name)  # cannot convert; names the first element not an int
        raise IndexTypeError(f"{name} must hold integers only: {exc}") from None
    if array.ndim == 1:
        _raise_if_not_ints(value, name)
    elif np.asarray(value).dtype.kind not in "iu":  # nested: int64 above truncated floats
        raise IndexTypeError(f"{name} must hold integers only; it holds "
                             f"{np.asarray(value).dtype} values")
    return array


def _raise_if_not_ints(value: Sequence, name: str) -> None:
    for at, v in enumerate(value):
        if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
            hint = ("; indices are one flat sequence: flatten it"
                    if isinstance(v, (Sequence, np.ndarray, torch.Tensor))
                    and not isinstance(v, (str, bytes)) else "")
            raise IndexTypeError(f"{name} must hold integers only: {name}[{at}] = {v!r} is a "
                                 f"{type(v).__name__}{hint}")


def _out_of_range(name: str, at: int, value: int, upper_bound: int | None,
                  unit: str) -> IndexValueError:
    if upper_bound is None:
        return IndexValueError(
            f"{name}[{at}] = {shown(value)} is out of range: indices are int64 (at most "
            f"{_INT64_MAX})")
    return IndexValueError(
        f"{name}[{at}] = {shown(value)} is out of range: this side holds {upper_bound} {unit} "
        f"(valid 0..{upper_bound - 1})"
    )


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
        pages = run_array(first, last + 1)
        return PagedTokens(pages, n, pages.size * page_size_tokens - n)
    pages = unique_in_order(tokens // page_size_tokens)
    distinct = count_distinct(tokens)
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
    distinct = count_distinct(device_tokens)
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
    if count_distinct(host_pages) == host_pages.size and \
            count_distinct(device_pages) == device_pages.size:
        return host_pages, device_pages, None
    return host_pages, device_pages, _first_conflict(host_pages_all, device_pages_all)


def _first_conflict(host_pages: np.ndarray, device_pages: np.ndarray
                    ) -> tuple[str, int, int, int]:
    """The earliest pair (over both sides) whose page was paired with another page before:
    ``(side, pair index, page, its first partner)``; one exists (the caller found a page of
    one side with two partners). The host side wins a tie."""
    found = None
    for side, mine, other in (("host", host_pages, device_pages),
                              ("device", device_pages, host_pages)):
        _, first, inverse = np.unique(mine, return_index=True, return_inverse=True)
        first_partner = other[first[inverse.reshape(-1)]]
        bad = np.flatnonzero(first_partner != other)
        if bad.size and (found is None or int(bad[0]) < found[1]):
            j = int(bad[0])
            found = (side, j, int(mine[j]), int(first_partner[j]))
    assert found is not None, "a page with two partners has a pair that shows it"
    return found
