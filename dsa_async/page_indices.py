"""``Pages``: page indices given directly, wherever a request takes token indices.

A caller that already thinks in pages (a page table, a radix tree of pages) would otherwise
expand each page into its tokens only for the service to fold them back. ``Pages(indices)``
stands for every token of those pages, in that order, so these two calls ask for the same
copy (64-token pages)::

    service.evict(Pages(torch.tensor([7, 2])))
    service.evict(torch.cat([torch.arange(448, 512), torch.arange(128, 192)]))

The indices are checked like token indices (a 1-D integer CPU tensor, numpy array, sequence
or range; no negatives; below the side's page count), and a page given twice counts once, as a
token given twice does. With ``host_tokens=`` both sides must be ``Pages``: pairs are page by
page, in order, and a page may pair with one page on the other side only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .pages import IndexLike


@dataclass(frozen=True, slots=True)
class Pages:
    """Page indices (``pages``: ``int [n_pages]``), accepted for ``device_tokens`` and
    ``host_tokens``. Holds the indices as given (no copy); they are read when the request is
    submitted. Constructing one does not validate anything and never blocks."""

    pages: IndexLike

    def __repr__(self) -> str:
        pages = self.pages
        shape = getattr(pages, "shape", None)
        if shape is None and isinstance(pages, range):
            return f"Pages({pages!r})"
        size = f"shape {tuple(shape)}" if shape is not None else f"len {len(pages)}" \
            if hasattr(pages, "__len__") else "unsized"
        return f"Pages({type(pages).__name__}, {size})"
