"""Coalesced page copies between a page-locked host arena and device buffers.

Every function here only *issues* work on the current stream (the engine's copy stream) and
returns; nothing waits. The same code runs on CPU tensors (then every op simply runs), which is
how its tiling and indexing are tested without a device.

Per batch, the page pairs are split into **host segments** (maximal runs of consecutive host
pages) and, inside each, **device runs** (where the device pages advance too)::

    host   7 8 9 10 11 | 40 41        segments: (host 7, 5 pages), (host 40, 2 pages)
    device 3 4 5 90 91 | 12 13        device runs: (3, 3) (90, 2) | (12, 2)

Per pool and layer group, one of two paths:

* **direct** (``layer_first`` host, and every segment is one device run or long device runs):
  one ``cudaMemcpyAsync`` per layer per device run, host row block and device row block both
  contiguous; one call for a group of layers when both sides happen to be contiguous across it
  (fused 3-D device buffer and a host region spanning whole layers).
* **staged** (otherwise): the device side goes through a reused device staging buffer laid out
  ``[layers, pages, row]``, tile by tile over the batch's pairs. D2H: gather the tile's device
  pages into it (``index_select``: one kernel per layer, or one kernel across the tile's
  layers when the device layers are one 3-D allocation), then one host copy per host run in
  the tile and layer. H2D is the mirror image (host copies into staging, then ``index_copy_``
  into the device pages). A ``page_first`` host holds a page's layers next to each other, so
  its host blocks are ``[pages, layers, row]``: a second staging buffer takes the device-side
  transpose, and the host copy is one call per page, or one per host run when the whole layer
  range moves (as in D2H).

Host pages scattered one by one (no long host runs) still move host run by host run: each
costs one copy call per layer (``layer_first``) or per page (``page_first``), so single-page
runs of a ``layer_first`` host reach only a fraction of the link (a ~8 KiB call costs about as
much host time as it takes on PCIe). Keep host extents contiguous (the host pool allocates
runs) for full speed; ``page_first`` moves a scattered page in one call of all its layers.

Within one stream a copy and a kernel do not overlap, so each staged tile pays its gather or
scatter kernel (microseconds) between copies; tiles are large (up to the staging capacity) to
keep that small.

Staging is tiled so one tile never exceeds the staging capacity; tiles reuse the same buffer
back to back on one stream, so the copy that reads a tile finishes before the next tile's
gather overwrites it (stream order). Index ops run on wide-integer views of the page rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from ..geometry import HostLayout
from ..kinds import Direction
from ..pages import page_runs
from .buffers import PoolBinding, wide_view
from .copyplan import MIN_BYTES_PER_CALL

#: Bytes per staging buffer (one or two per direction, allocated on first need).
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class Segment:
    """A host run of ``num_pages`` pages from ``host_start``; pairs ``[pos, pos + num_pages)``.

    ``device_runs``: ``(pos, device_start, num_pages)`` rows covering the segment in order.
    """

    pos: int
    host_start: int
    num_pages: int
    device_runs: tuple[tuple[int, int, int], ...]

    @property
    def device_start(self) -> int | None:
        """First device page when the device side is one run, else ``None``."""
        return self.device_runs[0][1] if len(self.device_runs) == 1 else None


class DevicePlan:
    """One batch's segments; its device page index goes to the device on first use.

    Build it on the copy stream: the index upload is then ordered before the kernels that
    read it.
    """

    def __init__(self, host_pages: np.ndarray, device_pages: np.ndarray,
                 device: torch.device) -> None:
        self.num_pages = int(host_pages.size)
        self.device = device
        self._device_pages = device_pages
        self._index: torch.Tensor | None = None
        runs = page_runs(host_pages, device_pages)  # (host_start, device_start, length)
        #: the first device page when every device page follows the previous one, else None
        self.device_start: int | None = int(runs[0, 1]) if len(runs) == 1 else None
        segments: list[Segment] = []
        pos = 0
        current: list[tuple[int, int, int]] = []
        seg_host = seg_pos = 0
        for h, d, k in runs.tolist():
            if current and h != seg_host + (pos - seg_pos):
                segments.append(Segment(seg_pos, seg_host, pos - seg_pos, tuple(current)))
                current = []
            if not current:
                seg_host, seg_pos = h, pos
            current.append((pos, d, k))
            pos += k
        if current:
            segments.append(Segment(seg_pos, seg_host, pos - seg_pos, tuple(current)))
        self.segments = tuple(segments)
        self._starts = [seg.pos for seg in segments]

    @classmethod
    def build(cls, host_pages: np.ndarray, device_pages: np.ndarray,
              device: torch.device) -> DevicePlan:
        return cls(host_pages, device_pages, device)

    @property
    def device_index(self) -> torch.Tensor:
        """``int64 [n]`` device pages on the copy device (uploaded once, on first use)."""
        if self._index is None:
            self._index = upload_index(self._device_pages, self.device)
        return self._index

    def host_pieces(self, p0: int, p1: int):
        """``(offset, host_start, num_pages)`` host runs of pairs ``[p0, p1)``, in order;
        ``offset`` counts from ``p0``."""
        i = max(0, bisect.bisect_right(self._starts, p0) - 1)
        segments = self.segments
        while i < len(segments) and segments[i].pos < p1:
            seg = segments[i]
            lo, hi = max(p0, seg.pos), min(p1, seg.pos + seg.num_pages)
            if lo < hi:
                yield lo - p0, seg.host_start + lo - seg.pos, hi - lo
            i += 1


def upload_index(pages: np.ndarray, device: torch.device) -> torch.Tensor:
    """``int64 [n]`` on ``device``: through torch's page-locked staging pool on CUDA.

    The pinned block is recycled by torch only after the copy that reads it completes (the
    caching host allocator records an event on the current stream), so this never blocks.
    """
    cpu = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
    if device.type != "cuda":
        return cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


class DeviceStaging:
    """Reused device buffers for one copy stream (never shared between streams).

    Reuse is safe because every op that writes or reads a buffer is issued on that one stream,
    in order: a later tile's gather cannot start before the earlier tile's host copy has read
    the buffer. Buffers grow on demand up to ``capacity_bytes``; they are allocated on the copy
    stream (the caller's current stream), so the caching allocator only ever hands their
    memory to later work on the same stream.
    """

    def __init__(self, device: torch.device, capacity_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]

    def rows(self, which: int, shape: tuple[int, int, int]) -> torch.Tensor:
        """A contiguous ``uint8`` tensor of ``shape`` in buffer ``which`` (0 or 1)."""
        nbytes = shape[0] * shape[1] * shape[2]
        assert nbytes <= self.capacity_bytes or shape[0] * shape[1] == 1, "tile too large"
        buffer = self._buffers[which]
        if buffer.numel() < nbytes:
            buffer = self._buffers[which] = torch.empty(
                max(nbytes, min(self.capacity_bytes, 2 * buffer.numel())), dtype=torch.uint8,
                device=self.device)
        return buffer[:nbytes].view(shape)


def h2d_layer_group(bindings: list[PoolBinding]) -> int:
    """Layers loaded between two readiness events.

    ``layer_first`` hosts load one layer at a time (per-layer readiness at full granularity).
    A ``page_first`` host moves one call per page per group, so its group is widened until
    each call carries at least ``MIN_BYTES_PER_CALL``.
    """
    group = None
    for b in bindings:
        if b.geometry.host_layout is HostLayout.PAGE_FIRST:
            g = -(-MIN_BYTES_PER_CALL // b.geometry.bytes_per_page_per_layer)
            g = max(1, min(b.geometry.num_layers, g))
        else:
            g = 1
        group = g if group is None else min(group, g)
    return group or 1


def copy_pool(binding: PoolBinding, plan: DevicePlan, direction: Direction, first: int,
              last: int, staging: DeviceStaging) -> None:
    """Issue the copies of layers ``[first, last)`` of one pool for ``plan`` (current stream)."""
    if not plan.num_pages:
        return
    to_host = direction is Direction.D2H
    row = binding.geometry.bytes_per_page_per_layer
    layer_first = binding.geometry.host_layout is HostLayout.LAYER_FIRST
    if layer_first and all(_direct_pays(seg, row) for seg in plan.segments):
        for seg in plan.segments:
            for pos, d, k in seg.device_runs:
                _copy_direct(binding, first, last, seg.host_start + pos - seg.pos, d, k, to_host)
        return
    _copy_staged(binding, plan, first, last, to_host, staging, layer_first)


def _direct_pays(seg: Segment, row: int) -> bool:
    """One device run, or runs long enough that a call each beats a gather plus one call."""
    return len(seg.device_runs) == 1 or min(k for _, _, k in seg.device_runs) * row >= (
        MIN_BYTES_PER_CALL)


def _transfer(host: torch.Tensor, dev: torch.Tensor, to_host: bool) -> None:
    # non_blocking is safe: the host side is the page-locked arena (cudaHostRegister'ed), so
    # this is a true async DMA ordered on the copy stream, and the engine keeps the host
    # pages in flight until the batch's end event completes. Both sides are contiguous here,
    # so torch issues exactly one cudaMemcpyAsync.
    if to_host:
        host.copy_(dev, non_blocking=True)
    else:
        dev.copy_(host, non_blocking=True)


def _copy_direct(binding: PoolBinding, first: int, last: int, h: int, d: int, k: int,
                 to_host: bool) -> None:
    host = binding.host  # [L, host_pages, row], contiguous per layer (layer_first)
    fused = binding.device_fused
    if fused is not None and last - first > 1:
        host_region, dev_region = host[first:last, h:h + k], fused[first:last, d:d + k]
        if host_region.is_contiguous() and dev_region.is_contiguous():
            _transfer(host_region, dev_region, to_host)  # the strides allow one call
            return
    for layer in range(first, last):
        _transfer(host[layer, h:h + k], binding.device_layers[layer][d:d + k], to_host)


def _tiles(first: int, last: int, num_pages: int, row: int, capacity: int,
           layer_first: bool):
    """``(l0, l1, p0, p1)`` tiles of at most ``capacity`` bytes (one page-layer minimum).

    ``layer_first`` tiles keep whole page ranges per layer (longer host calls); ``page_first``
    tiles keep whole layer ranges per page (the host's contiguous direction).
    """
    layers = last - first
    if layer_first:
        pages = max(1, min(num_pages, capacity // row))
        group = max(1, min(layers, capacity // (pages * row)))
    else:
        group = max(1, min(layers, capacity // row))
        pages = max(1, min(num_pages, capacity // (group * row)))
    for l0 in range(first, last, group):
        for p0 in range(0, num_pages, pages):
            yield l0, min(l0 + group, last), p0, min(p0 + pages, num_pages)


def _copy_staged(binding: PoolBinding, plan: DevicePlan, first: int, last: int,
                 to_host: bool, staging: DeviceStaging, layer_first: bool) -> None:
    """Every pair of the batch through staging, tile by tile: one gather/scatter per tile
    (per layer, or across the tile's layers for a fused device buffer), and one host copy per
    host run in the tile (per layer for ``layer_first``, per page or per run for
    ``page_first``)."""
    row = binding.geometry.bytes_per_page_per_layer
    d0 = plan.device_start
    for l0, l1, p0, p1 in _tiles(first, last, plan.num_pages, row, staging.capacity_bytes,
                                 layer_first):
        groups, pages = l1 - l0, p1 - p0
        by_layer = staging.rows(0, (groups, pages, row))  # [layers, pages, row]
        dev_sel = d0 + p0 if d0 is not None else plan.device_index[p0:p1]
        pieces = list(plan.host_pieces(p0, p1))
        if to_host:
            _gather(binding, l0, l1, dev_sel, pages, by_layer)
            if layer_first:
                for o, h, c in pieces:
                    _host_layer_first(binding, l0, l1, h, c, by_layer[:, o:o + c], True)
            else:
                by_page = staging.rows(1, (pages, groups, row))
                by_page.copy_(by_layer.transpose(0, 1))  # device-side transpose, cheap
                for o, h, c in pieces:
                    _host_page_first(binding, l0, l1, h, c, by_page[o:o + c], True)
        else:
            if layer_first:
                for o, h, c in pieces:
                    _host_layer_first(binding, l0, l1, h, c, by_layer[:, o:o + c], False)
            else:
                by_page = staging.rows(1, (pages, groups, row))
                for o, h, c in pieces:
                    _host_page_first(binding, l0, l1, h, c, by_page[o:o + c], False)
                by_layer.copy_(by_page.transpose(0, 1))
            _scatter(binding, l0, l1, dev_sel, pages, by_layer)


def _host_layer_first(binding: PoolBinding, l0: int, l1: int, h0: int, pages: int,
                      by_layer: torch.Tensor, to_host: bool) -> None:
    region = binding.host[l0:l1, h0:h0 + pages]
    if region.is_contiguous() and by_layer.is_contiguous():
        _transfer(region, by_layer, to_host)
        return
    for j, layer in enumerate(range(l0, l1)):
        _transfer(binding.host[layer, h0:h0 + pages], by_layer[j], to_host)


def _host_page_first(binding: PoolBinding, l0: int, l1: int, h0: int, pages: int,
                     by_page: torch.Tensor, to_host: bool) -> None:
    arena = binding.host.transpose(0, 1)  # the arena itself: [host_pages, L, row]
    region = arena[h0:h0 + pages, l0:l1]
    if region.is_contiguous() and by_page.is_contiguous():
        _transfer(region, by_page, to_host)
        return
    for j in range(pages):
        _transfer(arena[h0 + j, l0:l1], by_page[j], to_host)


def _gather(binding: PoolBinding, l0: int, l1: int, dev_sel: torch.Tensor | int, pages: int,
            by_layer: torch.Tensor) -> None:
    """Device pages of layers ``[l0, l1)`` into ``by_layer`` ``[layers, pages, row]``."""
    fused = binding.device_fused
    if isinstance(dev_sel, int):
        if fused is not None:
            by_layer.copy_(fused[l0:l1, dev_sel:dev_sel + pages])
        else:
            for j, layer in enumerate(range(l0, l1)):
                by_layer[j].copy_(binding.device_layers[layer][dev_sel:dev_sel + pages])
        return
    if fused is not None:
        src = wide_view(fused[l0:l1])
        torch.index_select(src, 1, dev_sel, out=by_layer.view(src.dtype))  # one kernel, all layers
        return
    for j, layer in enumerate(range(l0, l1)):
        src = wide_view(binding.device_layers[layer])
        torch.index_select(src, 0, dev_sel, out=by_layer[j].view(src.dtype))


def _scatter(binding: PoolBinding, l0: int, l1: int, dev_sel: torch.Tensor | int, pages: int,
             by_layer: torch.Tensor) -> None:
    """``by_layer`` ``[layers, pages, row]`` into the device pages of layers ``[l0, l1)``."""
    fused = binding.device_fused
    if isinstance(dev_sel, int):
        if fused is not None:
            fused[l0:l1, dev_sel:dev_sel + pages].copy_(by_layer)
        else:
            for j, layer in enumerate(range(l0, l1)):
                binding.device_layers[layer][dev_sel:dev_sel + pages].copy_(by_layer[j])
        return
    if fused is not None:
        dst = wide_view(fused[l0:l1])
        dst.index_copy_(1, dev_sel, by_layer.view(dst.dtype))  # one kernel, all layers
        return
    for j, layer in enumerate(range(l0, l1)):
        dst = wide_view(binding.device_layers[layer])
        dst.index_copy_(0, dev_sel, by_layer[j].view(dst.dtype))
