"""Page copies between a page-locked host arena and device buffers, planned once per batch.

Every function here only *issues* work on the current stream (the engine's copy stream) and
returns; nothing waits and nothing allocates device memory (the staging buffer and the index
buffer come from :class:`DeviceStaging`, allocated when the engine starts). The same code runs
on CPU tensors (then every op simply runs), which is how its paths, its registration-edge
splits and its call counts are tested without a device.

A batch is planned once (:class:`BatchCopy`): the page pairs are cut into **runs** (host and
device both advance) and **host segments** (host advances), the page indices are uploaded in
one call, and each pool gets one of three paths, fixed for the whole batch:

* ``RUNS`` (``layer_first`` host, few or long runs): one ``cudaMemcpyAsync`` per run and layer.
* ``STAGED`` (host in few segments, device scattered): the device side is gathered into (D2H)
  or scattered from (H2D) the staging buffer by one index kernel per layer (or per layer group
  when the device layers are one 3-D allocation), and one memcpy per host segment and layer
  moves the bytes (a ``page_first`` host moves whole-layer blocks of a page run, after a
  device-side transpose in a second staging half).
* ``MAPPED`` (host pages scattered): no memcpy at all; the kernels reach the arena directly
  through unified addressing (a CUDA tensor over the mapped host memory, see ``mapped``).
  D2H: a gather of the device pages into staging, then one ``index_copy_`` into the host view
  per layer group; H2D: one ``index_select`` from the host view into staging, then one
  ``index_copy_`` into the device pages, per layer. With the device side one run, the
  staging step is skipped (one kernel).

Worked count for the DSA indexer (``layer_first``, 8,448 B rows) and one batch of 272 pages:
host extents with device runs of 16 pages take ``STAGED``: per layer one gather and one memcpy,
plus one index upload for the batch: (2 x 61 + 1) / 61 = 2.02 calls per layer. Single pages at
random take ``MAPPED``: H2D 2 kernels per layer; D2H one gather per layer and one scatter per
group of layers that fits the staging (29 layers of 2.3 MB in 64 MiB), about 1.07 per layer.

**Registration edges.** The arena is page-locked in chunks, and one memcpy must not span two
registrations (see ``registrations``): every memcpy here goes through :func:`_memcpy`, which
cuts the host range at the engine's registration edges. Kernels on the mapped view need no cut.

Staging reuse is safe because every op that writes or reads it is issued on one stream, in
order: a later tile's gather cannot start before the earlier tile's copy has read the buffer.
Index ops run on wide-integer views of the page rows (``wide_view``).

**torch's deterministic mode.** Under ``torch.use_deterministic_algorithms(True)`` (also with
``warn_only``) a CUDA ``index_copy_`` runs as ``index_put_``, whose deterministic kernel copies
the whole destination and writes all of it back unless it writes rows (dim 0) of a contiguous
tensor. Along dim 1 of a fused device view that rewrites every page of those layers, racing
the forward pass's writes to other pages on its own stream (lost KV writes), and into the
mapped host view it copies the arena slab into device memory. So while the mode is on (read
per batch: the host process may switch it), index copies write one contiguous device layer at
a time along dim 0, and backups do not take ``MAPPED`` (they take ``STAGED``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..kinds import Direction
from ..paging.runs import is_run, page_runs
from .buffers import PoolBinding, same_width
from .copyplan import MIN_BYTES_PER_CALL
from .registrations import RegistrationMap

#: Bytes of device staging per direction (``ServiceConfig.device_staging_bytes``).
DEFAULT_STAGING_BYTES = 64 << 20
#: Memcpy calls per layer a memcpy path may take before a kernel path is preferred.
MAX_MEMCPY_CALLS_PER_LAYER = 3


class CopyPath(enum.Enum):
    """How one pool's pages move for one batch."""

    RUNS = "runs"  #: one memcpy per run and layer
    STAGED = "staged"  #: device-side index kernel + one memcpy per host segment and layer
    MAPPED = "mapped"  #: index kernels on the mapped host view, no memcpy


@dataclass(frozen=True)
class PoolTarget:
    """One pool as the CUDA copy code reaches it.

    ``host_flat``: the arena's whole storage as ``uint8 [bytes]`` on the CPU (memcpy side);
    ``mapped``: ``uint8 [L, host_pages, B]`` on the copy device over the same bytes (strides
    as ``binding.host``), or ``None`` when the arena is not mapped for the device.
    """

    binding: PoolBinding
    host_flat: torch.Tensor
    mapped: torch.Tensor | None

    @classmethod
    def of(cls, binding: PoolBinding, mapped: torch.Tensor | None = None) -> PoolTarget:
        flat = torch.empty(0, dtype=torch.uint8).set_(binding.host.untyped_storage())
        return cls(binding, flat, mapped)


class DeviceStaging:
    """One direction's device buffers, allocated once: ``buffer`` (page rows) and ``index``.

    ``index`` holds ``2 x index_pages`` ``int64`` (a batch's host and device pages); a batch
    never repeats a page it writes, so the larger side's page count bounds it.
    Allocating raises ``torch.OutOfMemoryError`` here, never while serving.
    """

    def __init__(self, device: torch.device, capacity_bytes: int, index_pages: int) -> None:
        self.device = device
        self.capacity_bytes = capacity_bytes
        self.index_pages = index_pages
        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self.index = torch.empty(2 * index_pages, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self.capacity_bytes + 16 * self.index_pages

    def rows(self, shape: tuple[int, ...], offset_bytes: int = 0) -> torch.Tensor:
        """A contiguous ``uint8`` view of ``shape`` at ``offset_bytes`` of the buffer."""
        nbytes = int(np.prod(shape))
        assert offset_bytes + nbytes <= self.capacity_bytes, "staging tile too large"
        return self.buffer[offset_bytes:offset_bytes + nbytes].view(shape)


@dataclass(frozen=True)
class _Pieces:
    """Host runs of one page tile ``[p0, p1)``: ``(offset from p0, host_start, pages)`` rows."""

    p0: int
    p1: int
    rows: tuple[tuple[int, int, int], ...]


class BatchCopy:
    """One batch's plan for every pool, and the issue of its layers (current stream).

    Build it on the copy stream's thread; :meth:`upload_index` then :meth:`issue` per layer
    group. ``host_pages``/``device_pages``: ``int64 [n]`` pairs.
    """

    def __init__(self, host_pages: np.ndarray, device_pages: np.ndarray,
                 pools: Sequence[PoolTarget], direction: Direction, staging: DeviceStaging,
                 registrations: RegistrationMap) -> None:
        n = self.num_pages = int(host_pages.size)
        self.direction = direction
        self.staging = staging
        self.registrations = registrations
        self.host_pages, self.device_pages = host_pages, device_pages
        #: torch's deterministic mode is on: index copies only along dim 0 (module docstring)
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        one_run = n > 0 and is_run(host_pages) and is_run(device_pages)
        self.runs = (np.array([[host_pages.item(0), device_pages.item(0), n]], dtype=np.int64)
                     if one_run else page_runs(host_pages, device_pages))
        self.device_start = (int(device_pages.item(0)) if n and (one_run or is_run(device_pages))
                             else None)
        breaks = (np.flatnonzero(np.diff(host_pages) != 1) + 1) if n > 1 and not one_run else (
            np.zeros(0, dtype=np.int64))
        self.segment_pos = np.concatenate(([0], breaks)).astype(np.int64) if n else breaks
        self.segment_host = host_pages[self.segment_pos] if n else breaks
        self.segment_pages = np.diff(np.append(self.segment_pos, n)) if n else breaks
        self.plans = [_PoolPlan(pool, self) for pool in pools]
        self.needs_index = any(p.needs_index for p in self.plans)
        self._host_index: torch.Tensor | None = None
        self._device_index: torch.Tensor | None = None

    @property
    def h2d_group(self) -> int:
        """Layers loaded between two readiness events (the finest any pool allows)."""
        return min((p.h2d_group for p in self.plans), default=1)

    def upload_index(self) -> None:
        """Send both page lists to the device in one call (if any path needs them).

        The host side comes from torch's page-locked staging pool: torch recycles that block
        only after this copy completed (it records an event on the current stream), so the
        call never blocks and never races a later batch.
        """
        if not self.needs_index or self._host_index is not None:
            return
        n = self.num_pages
        assert n <= self.staging.index_pages, "index buffer sized below the batch"
        both = torch.from_numpy(np.concatenate((self.host_pages, self.device_pages)))
        if self.staging.device.type == "cuda":
            both = both.pin_memory()
        target = self.staging.index[:2 * n]
        target.copy_(both, non_blocking=True)
        self._host_index, self._device_index = target[:n], target[n:]

    def index(self, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(host, device)`` page indices of pairs ``[p0, p1)`` on the copy device."""
        assert self._host_index is not None, "upload_index() first"
        return self._host_index[p0:p1], self._device_index[p0:p1]

    def host_pieces(self, p0: int, p1: int) -> _Pieces:
        """Host runs of pairs ``[p0, p1)`` (computed once per tile, not per layer)."""
        pos, host, pages = self.segment_pos, self.segment_host, self.segment_pages
        i = max(0, int(np.searchsorted(pos, p0, side="right")) - 1)
        j = int(np.searchsorted(pos, p1, side="left"))
        rows = []
        for s, h, c in zip(pos[i:j].tolist(), host[i:j].tolist(), pages[i:j].tolist()):
            lo, hi = max(p0, s), min(p1, s + c)
            if lo < hi:
                rows.append((lo - p0, h + lo - s, hi - lo))
        return _Pieces(p0, p1, tuple(rows))

    def issue(self, first: int, last: int) -> None:
        """Issue layers ``[first, last)`` of every pool (pools with fewer layers: theirs)."""
        if not self.num_pages:
            return
        for plan in self.plans:
            layers = plan.num_layers
            if first < layers:
                plan.issue(first, min(last, layers))


#: Events the engine records on the copy stream per batch, around its copies: the start (for
#: device timing) and the end (timing, and what later batches on the same pages wait for).
TIMING_EVENTS_PER_BATCH = 2


def record_layer_events(first: int, last: int, take_event: Callable[[], object],
                        stream: object, into: list) -> None:
    """Record one event per layer of ``[first, last)`` on ``stream``, after those layers'
    copies were issued there: a load's per-layer readiness (the engine's ``after_group``).
    Appends them to ``into``; never blocks."""
    for _ in range(first, last):
        event = take_event()
        event.record(stream)
        into.append(event)


def issue_batch(copy: BatchCopy, num_layers: int,
                before_group: Callable[[int], None] | None = None,
                after_group: Callable[[int, int], None] | None = None) -> None:
    """Issue every layer of a planned batch on the current stream, as the engine does.

    D2H moves all layers at once; H2D moves ``copy.h2d_group`` layers at a time, calling
    ``after_group(first, last)`` after each group (the engine records readiness events there).
    ``before_group(first)`` runs before each group (the engine's fault hook). Never blocks.
    """
    group = num_layers if copy.direction is Direction.D2H else copy.h2d_group
    for first in range(0, num_layers, group):
        last = min(first + group, num_layers)
        if before_group is not None:
            before_group(first)
        copy.issue(first, last)
        if after_group is not None:
            after_group(first, last)


class _PoolPlan:
    """One pool's path and tiles for one batch."""

    def __init__(self, pool: PoolTarget, batch: BatchCopy) -> None:
        self.pool = pool
        self.batch = batch
        b = pool.binding
        self.num_layers = b.geometry.num_layers
        row = self.row = b.geometry.bytes_per_page_per_layer
        host = b.host
        self.layer_first = host.stride(1) == row
        self.path = self._choose(batch, row)
        self.needs_index = self.path is CopyPath.MAPPED or (
            self.path is CopyPath.STAGED and batch.device_start is None)
        n = batch.num_pages
        capacity = batch.staging.capacity_bytes
        self.two_halves = self.path is CopyPath.STAGED and not self.layer_first
        if self.two_halves:
            capacity //= 2  # by layer, then by page (the host's contiguous direction)
            layers_per_tile = max(1, min(self.num_layers, capacity // row))
            self.page_step = max(1, min(n, capacity // (layers_per_tile * row)))
            self.h2d_group = max(1, min(self.num_layers, -(-MIN_BYTES_PER_CALL // row)))
        else:
            self.page_step = max(1, min(n, capacity // row))
            self.h2d_group = 1
        self.tile_capacity = capacity
        self.tiles = [batch.host_pieces(p0, min(p0 + self.page_step, n))
                      for p0 in range(0, n, self.page_step)] if self.path is not CopyPath.RUNS else []

    def _choose(self, batch: BatchCopy, row: int) -> CopyPath:
        # A MAPPED backup writes the host view with index_copy_ along dim 1 (see the module
        # docstring on deterministic mode); a MAPPED load only reads it.
        mapped = self.pool.mapped is not None and not (
            batch.deterministic and batch.direction is Direction.D2H)
        segments = len(batch.segment_pos)
        long_segments = batch.num_pages * row >= MIN_BYTES_PER_CALL * max(1, segments)
        if self.layer_first:
            runs = len(batch.runs)
            if runs <= MAX_MEMCPY_CALLS_PER_LAYER or (
                    batch.num_pages * row >= MIN_BYTES_PER_CALL * runs):
                return CopyPath.RUNS
            if segments <= MAX_MEMCPY_CALLS_PER_LAYER - 1 or long_segments or not mapped:
                return CopyPath.STAGED
            return CopyPath.MAPPED
        if not mapped:
            return CopyPath.STAGED
        if batch.direction is Direction.D2H and (
                segments <= MAX_MEMCPY_CALLS_PER_LAYER - 2 or long_segments):
            return CopyPath.STAGED  # whole-layer blocks of page runs: few long memcpys
        return CopyPath.MAPPED

    def layer_step(self, pages: int) -> int:
        return max(1, self.tile_capacity // (pages * self.row))

    def issue(self, first: int, last: int) -> None:
        to_host = self.batch.direction is Direction.D2H
        if self.path is CopyPath.RUNS:
            self._issue_runs(first, last, to_host)
            return
        for tile in self.tiles:
            pages = tile.p1 - tile.p0
            step = self.layer_step(pages)
            for l0 in range(first, last, step):
                l1 = min(l0 + step, last)
                if self.path is CopyPath.MAPPED:
                    self._issue_mapped(tile, l0, l1, to_host)
                elif self.layer_first:
                    self._issue_staged_layer_first(tile, l0, l1, to_host)
                else:
                    self._issue_staged_page_first(tile, l0, l1, to_host)

    # --- RUNS -------------------------------------------------------------------------------

    def _issue_runs(self, first: int, last: int, to_host: bool) -> None:
        b, row = self.pool.binding, self.row
        host = b.host
        s0, s1, base = host.stride(0), host.stride(1), host.storage_offset()
        runs = self.batch.runs.tolist()
        for layer in range(first, last):
            dev = b.device_layers[layer].view(-1)
            for h, d, k in runs:
                _memcpy(self, base + layer * s0 + h * s1, dev, d * row, k * row, to_host)

    # --- STAGED -----------------------------------------------------------------------------

    def _issue_staged_layer_first(self, tile: _Pieces, l0: int, l1: int, to_host: bool) -> None:
        b, row = self.pool.binding, self.row
        pages, layers = tile.p1 - tile.p0, l1 - l0
        stage = self.batch.staging.rows((layers, pages, row))
        flat = stage.view(-1)
        host = b.host
        s0, s1, base = host.stride(0), host.stride(1), host.storage_offset()
        if to_host:
            _gather_device(self, tile, l0, l1, stage)
        for j in range(layers):
            for o, h, c in tile.rows:
                _memcpy(self, base + (l0 + j) * s0 + h * s1, flat, (j * pages + o) * row,
                        c * row, to_host)
        if not to_host:
            _scatter_device(self, tile, l0, l1, stage)

    def _issue_staged_page_first(self, tile: _Pieces, l0: int, l1: int, to_host: bool) -> None:
        b, row = self.pool.binding, self.row
        pages, layers = tile.p1 - tile.p0, l1 - l0
        half = self.tile_capacity
        by_layer = self.batch.staging.rows((layers, pages, row))
        by_page = self.batch.staging.rows((pages, layers, row), half)
        flat = by_page.view(-1)
        host = b.host  # [L, H, B] view of the [H, L, B] arena
        s0, s1, base = host.stride(0), host.stride(1), host.storage_offset()
        whole_pages = layers == self.num_layers  # then a page run is one contiguous block
        if to_host:
            _gather_device(self, tile, l0, l1, by_layer)
            by_page.copy_(by_layer.transpose(0, 1))  # device-side transpose: one kernel
        for o, h, c in tile.rows:
            if whole_pages:
                _memcpy(self, base + h * s1, flat, o * layers * row, c * layers * row, to_host)
                continue
            for i in range(c):
                _memcpy(self, base + l0 * s0 + (h + i) * s1, flat, (o + i) * layers * row,
                        layers * row, to_host)
        if not to_host:
            by_layer.copy_(by_page.transpose(0, 1))
            _scatter_device(self, tile, l0, l1, by_layer)

    # --- MAPPED -----------------------------------------------------------------------------

    def _issue_mapped(self, tile: _Pieces, l0: int, l1: int, to_host: bool) -> None:
        b, row = self.pool.binding, self.row
        pages, layers = tile.p1 - tile.p0, l1 - l0
        host_index, _ = self.batch.index(tile.p0, tile.p1)
        mapped = self.pool.mapped[l0:l1]  # [layers, H, B] over the page-locked arena
        d0 = self.batch.device_start
        fused = b.device_fused
        if to_host:
            if d0 is not None and fused is not None:
                src = fused[l0:l1, d0 + tile.p0:d0 + tile.p1]
            elif d0 is not None and layers == 1:
                src = b.device_layers[l0][d0 + tile.p0:d0 + tile.p1].unsqueeze(0)
            else:
                src = self.batch.staging.rows((layers, pages, row))
                _gather_device(self, tile, l0, l1, src)
            dst_w, src_w = same_width(mapped, src)
            dst_w.index_copy_(1, host_index, src_w)  # one kernel: writes the host pages
            return
        if d0 is not None and layers == 1:
            out = b.device_layers[l0][d0 + tile.p0:d0 + tile.p1]
            src_w, out_w = same_width(mapped[0], out)
            torch.index_select(src_w, 0, host_index, out=out_w)  # one kernel, no staging
            return
        stage = self.batch.staging.rows((layers, pages, row))
        src_w, stage_w = same_width(mapped, stage)
        torch.index_select(src_w, 1, host_index, out=stage_w)  # reads the host pages
        _scatter_device(self, tile, l0, l1, stage)


# --- the calls themselves ---------------------------------------------------------------------


def _memcpy(plan: _PoolPlan, host_offset: int, dev_flat: torch.Tensor, dev_offset: int,
            nbytes: int, to_host: bool) -> None:
    """Copy ``nbytes`` between the arena at ``host_offset`` and ``dev_flat`` at ``dev_offset``,
    one ``cudaMemcpyAsync`` per registration the host range touches.

    ``non_blocking`` is safe: the host side lies in the page-locked arena, so each call is an
    asynchronous DMA ordered on the copy stream, and the engine keeps the host pages in flight
    until the batch's end event completes. Both sides are contiguous 1-D bytes, so torch
    issues exactly one memcpy per piece.
    """
    host_flat = plan.pool.host_flat
    start = host_flat.data_ptr() + host_offset
    for offset, length in plan.batch.registrations.split(start, nbytes):
        host = host_flat[host_offset + offset:host_offset + offset + length]
        dev = dev_flat[dev_offset + offset:dev_offset + offset + length]
        if to_host:
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)


def _gather_device(plan: _PoolPlan, tile: _Pieces, l0: int, l1: int,
                   out: torch.Tensor) -> None:
    """Device pages of pairs ``[p0, p1)``, layers ``[l0, l1)``, into ``out [layers, pages, B]``."""
    b = plan.pool.binding
    d0 = plan.batch.device_start
    fused = b.device_fused
    if d0 is not None:
        lo, hi = d0 + tile.p0, d0 + tile.p1
        if fused is not None:
            out.copy_(fused[l0:l1, lo:hi])
        else:
            for j, layer in enumerate(range(l0, l1)):
                out[j].copy_(b.device_layers[layer][lo:hi])
        return
    _, dev_index = plan.batch.index(tile.p0, tile.p1)
    if fused is not None:
        src, dst = same_width(fused[l0:l1], out)
        torch.index_select(src, 1, dev_index, out=dst)  # one kernel for the layer group
        return
    for j, layer in enumerate(range(l0, l1)):
        src, dst = same_width(b.device_layers[layer], out[j])
        torch.index_select(src, 0, dev_index, out=dst)


def _scatter_device(plan: _PoolPlan, tile: _Pieces, l0: int, l1: int,
                    src: torch.Tensor) -> None:
    """``src [layers, pages, B]`` into the device pages of pairs ``[p0, p1)``, layers ``[l0, l1)``."""
    b = plan.pool.binding
    d0 = plan.batch.device_start
    fused = b.device_fused
    if d0 is not None:
        lo, hi = d0 + tile.p0, d0 + tile.p1
        if fused is not None:
            fused[l0:l1, lo:hi].copy_(src)
        else:
            for j, layer in enumerate(range(l0, l1)):
                b.device_layers[layer][lo:hi].copy_(src[j])
        return
    _, dev_index = plan.batch.index(tile.p0, tile.p1)
    if fused is not None and not plan.batch.deterministic:
        dst, s = same_width(fused[l0:l1], src)
        dst.index_copy_(1, dev_index, s)  # one kernel for the layer group
        return
    # one kernel per layer, along dim 0 of a contiguous layer (deterministic mode writes only
    # those rows; the layers are checked contiguous when the pool is bound)
    for j, layer in enumerate(range(l0, l1)):
        dst, s = same_width(b.device_layers[layer], src[j])
        dst.index_copy_(0, dev_index, s)
