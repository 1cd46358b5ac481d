"""Device index tensors that live on the GPU: read after the request's producers, not at submit.

A server hands over device indices that GPU work on its stream has only just produced (queued,
maybe not yet run). Reading them at submit would block the submitting thread until that work
finishes. Instead, at submit, only what the tensor's shape tells is checked (a 1-D integer
tensor; for tokens, a whole number of pages), and the engine queues a small copy of the
values into page-locked host memory *after the request's producers* (``stage_indices``). The
engine's issue thread waits for that copy when the request's batch comes up, then
:meth:`DeviceIndices.resolve` checks the values and turns them into pages. A bad value fails
that transfer with ``IndexValueError`` as its cause: it cannot raise at submit.

Two forms are accepted on the device, both with each page exactly once and no padding:

* tokens: every token of each page, pages in any order (``[p * 64 + 0 .. p * 64 + 63, ...]``),
  as SGLang passes a sequence's slots;
* ``Pages(indices)``: page indices directly.

Partial pages, repeats and in-page offsets need the values to pad, so they are for CPU index
tensors (the general path pads them at submit). Host-side indices are always CPU ones.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import IndexTypeError, IndexValueError
from ..kinds import Backend
from .runs import PageSeq, distinct
from .tokens import Pages, aligned_pages, tokens_to_page_seq

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


class IndexForm(enum.Enum):
    TOKENS = "tokens"  #: every token of each page
    PAGES = "pages"  #: ``Pages(indices)``


def index_tensor(value: object) -> torch.Tensor | None:
    """The tensor behind ``value`` (a tensor, or ``Pages`` of one); ``None`` for anything
    else. Any thread; reads no values."""
    tensor = value.pages if type(value) is Pages else value
    return tensor if isinstance(tensor, torch.Tensor) else None


class DeviceIndices:
    """One request's device-side indices, staged by the engine and resolved on its issue thread.

    ``fetch()`` blocks until the staged copy has landed and returns the values as a CPU array
    (engine-specific: a CUDA event's ``synchronize`` and a pinned buffer)."""

    __slots__ = ("form", "num_pages", "page_size_tokens", "bound_pages", "name", "fetch")

    def __init__(self, form: IndexForm, num_pages: int, page_size_tokens: int, bound_pages: int,
                 name: str, fetch: Callable[[], np.ndarray]) -> None:
        self.form = form
        self.num_pages = num_pages
        self.page_size_tokens = page_size_tokens
        self.bound_pages = bound_pages
        self.name = name
        self.fetch = fetch

    def resolve(self) -> np.ndarray:
        """The device pages (``int64 [num_pages]``, request order). Blocks until the staged copy
        landed (engine issue thread only); raises ``IndexValueError`` for values that are not
        ``num_pages`` distinct whole pages inside the device buffers."""
        values = np.asarray(self.fetch()).astype(np.int64, copy=False).reshape(-1)
        ps, bound = self.page_size_tokens, self.bound_pages
        if self.form is IndexForm.PAGES:
            if values.size and (values.min() < 0 or values.max() >= bound):
                bad = values[(values < 0) | (values >= bound)][0]
                raise IndexValueError(
                    f"{self.name}: page {int(bad)} is out of range; the device buffers hold "
                    f"pages 0..{bound - 1}")
            if not distinct(values, bound):
                raise IndexValueError(
                    f"{self.name}: a page is given twice; page indices on the device must be "
                    f"distinct (pass them on the CPU to have repeats dropped)")
            return values
        pages = aligned_pages(values, ps, bound * ps)
        if pages is None:
            raise IndexValueError(
                f"{self.name}: the {values.size} tokens on the device are not every token of "
                f"{self.num_pages} distinct whole pages inside the device buffers (pages "
                f"0..{bound - 1}, {ps} tokens each, each page's tokens in order); partial "
                f"pages, repeats and out-of-range tokens need CPU index tensors, which are "
                f"padded to whole pages at submit")
        return pages


def device_form(tensor: torch.Tensor, value: object, name: str,
                page_size_tokens: int) -> tuple[IndexForm, int]:
    """Check what the shape of an off-CPU index tensor tells (dtype, rank, length), without
    reading a value: returns its form and its page count. Raises ``IndexTypeError`` /
    ``IndexValueError``. Any thread; never blocks."""
    if tensor.dtype not in _INDEX_DTYPES:
        raise IndexTypeError(f"{name} on {tensor.device} has dtype {tensor.dtype}; index "
                             f"tensors hold integers (int64 or int32)")
    if tensor.dim() != 1:
        raise IndexValueError(f"{name} on {tensor.device} has shape {tuple(tensor.shape)}; "
                              f"index tensors are 1-D")
    n = tensor.numel()
    if isinstance(value, Pages):
        return IndexForm.PAGES, n
    if n % page_size_tokens:
        raise IndexValueError(
            f"{name} on {tensor.device} holds {n} tokens, not a whole number of "
            f"{page_size_tokens}-token pages; on the device, give every token of each page "
            f"(or Pages(page_indices)); partial pages need a CPU index tensor, which is padded")
    return IndexForm.TOKENS, n // page_size_tokens


@dataclass(frozen=True)
class OnDevice:
    """Device indices the engine reads later, as far as their shape tells."""

    tensor: torch.Tensor
    form: IndexForm
    num_pages: int


class IndexReader(Protocol):
    """What :func:`deferred_form` asks of an engine (``transfer.base.TransferEngine``)."""

    backend: Backend

    def defers_indices(self, tensor: torch.Tensor) -> bool: ...


def deferred_form(device_tokens: object, engine: IndexReader,
                  page_size_tokens: int) -> OnDevice | None:
    """What the shape of ``device_tokens`` says when ``engine`` reads them later (an index
    tensor, or ``Pages`` of one, that the engine defers); ``None`` for indices read at submit.
    A tensor off the CPU that the engine does not defer is refused (``IndexTypeError`` naming
    its device). Any thread; reads no values."""
    tensor = index_tensor(device_tokens)
    if tensor is None:
        return None
    if not engine.defers_indices(tensor):
        if tensor.is_cpu:
            return None  # read at submit
        name = "device_tokens.pages" if isinstance(device_tokens, Pages) else "device_tokens"
        raise IndexTypeError(
            f"{name} is a tensor on device {tensor.device}; the "
            f"{engine.backend.value} backend reads index tensors on the CPU: pass "
            f"{name}.cpu() (the cuda backend also takes index tensors on its device, "
            f"read after the request's producers)")
    form, num_pages = device_form(tensor, device_tokens, "device_tokens", page_size_tokens)
    return OnDevice(tensor, form, num_pages)


def paired_host_pages(on_device: OnDevice, host_tokens: object, host_token_bound: int,
                      page_size_tokens: int) -> PageSeq:
    """Host pages that pair in order with device pages the engine reads later: whole pages
    (every token of each, or ``Pages`` when the device side is ``Pages``), as many, each once.
    Raises ``IndexValueError`` otherwise. Any thread."""
    device_is_pages = on_device.form is IndexForm.PAGES
    if isinstance(host_tokens, Pages) is not device_is_pages:
        raise IndexValueError("pass both sides as Pages, or neither")
    host_pages, padding = tokens_to_page_seq(host_tokens, "host_tokens", host_token_bound,
                                             page_size_tokens)
    # As many given as kept: no page was given twice (that one would pair with nothing).
    given = (_count(host_tokens.pages) if device_is_pages
             else _count(host_tokens) // page_size_tokens)
    if padding or len(host_pages) != on_device.num_pages or given != len(host_pages):
        raise IndexValueError(
            f"host_tokens must be {on_device.num_pages} distinct whole pages (every token of "
            f"each, in order) to pair page by page with device_tokens on "
            f"{on_device.tensor.device}; they cover {len(host_pages)} pages with {padding} "
            f"padding tokens")
    return host_pages


def _count(indices: object) -> int:
    return indices.numel() if isinstance(indices, torch.Tensor) else len(indices)
