"""A real engine on real buffers, set up for one copy case, with a byte-exact check.

A rig owns a :class:`HostPool`, the device buffers of one pool (the DSA indexer by default) and
an engine bound to both, plus the page pairs one figure moves::

    num_pages   = ceil(figure_bytes / bytes_per_page), rounded up to a multiple of 16
                  (128 MiB with 61 layers: 261 -> 272 pages of 515,328 B = 140,169,216 B)
    device side = SPREAD x num_pages pages (positions are drawn from a space 4x the batch)

Page patterns:

* ``EXTENTS``: host pages from ``HostPool.allocate(num_pages)`` (the extent allocator), device
  pages in runs of 16 at random 16-aligned positions, runs in random order.
* ``RANDOM``: the whole host pool (``SPREAD x num_pages``) is allocated and single host pages are
  drawn at random; device pages are drawn at random too; pairs in random order.

Device layouts: ``SEPARATE`` (one allocation per layer, as SGLang holds them) or ``FUSED``
(per-layer views ``big[i]`` of one ``[num_layers, device_pages, B]`` allocation).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import numpy as np
import torch

from ..geometry import PageGeometry
from ..host_memory.pool import HostPool
from ..kinds import Direction
from ..transfer.batch import BatchHandle, CopyBatch, Dependency
from ..transfer.buffers import PoolBinding, bind_pool
from ..transfer.handoff import LoopHandoff
from .registry import BenchContext

#: Device pages (and host pages for RANDOM) per moved page: positions spread over 4x the batch.
SPREAD = 4
#: Device run length of the EXTENTS pattern, in pages.
RUN_PAGES = 16
#: Pages compared (all layers) after each measured case.
VERIFY_PAGES = 4


class PagePattern(enum.Enum):
    EXTENTS = "extents"
    RANDOM = "random"


class DeviceLayout(enum.Enum):
    SEPARATE = "separate"  #: one allocation per layer
    FUSED = "fused"  #: per-layer views of one 3-D allocation


class CopyVerificationError(AssertionError):
    """A copy moved the wrong bytes: its speed must not be reported."""


def pages_for_bytes(geometry: PageGeometry, nbytes: int) -> int:
    """Whole pages (a multiple of ``RUN_PAGES``) holding at least ``nbytes``."""
    pages = math.ceil(nbytes / geometry.bytes_per_page)
    return math.ceil(pages / RUN_PAGES) * RUN_PAGES


def fill_pattern(t: torch.Tensor, start: int) -> None:
    """Give every 8-byte word of ``t`` (contiguous) a distinct value from ``start`` on."""
    words = t.view(-1).view(torch.int64)
    torch.arange(start, start + words.numel(), dtype=torch.int64, device=t.device, out=words)


def load_pages(device_pages: np.ndarray) -> np.ndarray:
    """The device pages a round trip's prefetch loads the batch's host pages into: each pair's
    device page one run (``RUN_PAGES``) further on in the batch, wrapping; one page further on
    in a batch of one run or less. Extent runs stay runs; random pages stay random."""
    n = device_pages.size
    shift = RUN_PAGES if n > RUN_PAGES else 1
    return np.roll(device_pages, -shift) if n > 1 else device_pages


def _ignore(_handle: BatchHandle) -> None:
    pass


def _check(handle: BatchHandle) -> None:
    if handle.error is not None:
        raise handle.error


class CopyRig:
    """One engine, one host pool, one pool's device buffers and the page pairs to move."""

    def __init__(self, ctx: BenchContext, pattern: PagePattern, layout: DeviceLayout) -> None:
        self.ctx = ctx
        self.pattern = pattern
        self.layout = layout
        g = self.geometry = ctx.geometry
        rng = np.random.default_rng(ctx.seed)
        n = self.num_pages = pages_for_bytes(g, ctx.figure_bytes)
        self.device_pages_total = SPREAD * n
        row = g.bytes_per_page_per_layer

        if pattern is PagePattern.EXTENTS:
            self.pool = HostPool.create([g], n)
            handle = self.pool.allocate(n)
            assert handle is not None
            host_pages = handle.pages
            slots = rng.choice(self.device_pages_total // RUN_PAGES, n // RUN_PAGES, replace=False)
            device_pages = (slots[:, None] * RUN_PAGES + np.arange(RUN_PAGES)).reshape(-1)
        else:
            self.pool = HostPool.create([g], SPREAD * n)
            handle = self.pool.allocate(SPREAD * n)
            assert handle is not None
            host_pages = rng.choice(handle.pages, n, replace=False)
            device_pages = rng.choice(self.device_pages_total, n, replace=False)
        self.host_pages = np.ascontiguousarray(host_pages, dtype=np.int64)
        self.device_pages = np.ascontiguousarray(device_pages, dtype=np.int64)

        dev = ctx.device
        if layout is DeviceLayout.FUSED:
            self._big = dev.empty(g.num_layers, self.device_pages_total, row)
            fill_pattern(self._big, 1)
            layers = [self._big[i] for i in range(g.num_layers)]
        else:
            layers = []
            for i in range(g.num_layers):
                t = dev.empty(self.device_pages_total, row)
                fill_pattern(t, 1 + i * t.numel())
                layers.append(t)
        dev.synchronize()
        self.binding: PoolBinding = bind_pool(g, self.pool.arenas[g.name], layers)
        if layout is DeviceLayout.FUSED:
            assert self.binding.device_fused is not None, "3-D views were not recognised"
        self.engine = ctx.engine_class({g.name: self.binding}, LoopHandoff(ctx.loop), _ignore)
        self._rng = torch.Generator().manual_seed(ctx.seed + 1)

    # --- the subject ------------------------------------------------------------------------

    @property
    def bytes_per_direction(self) -> int:
        return self.num_pages * self.geometry.bytes_per_page

    def _chunks(self, batch_pages: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
        step = batch_pages or self.num_pages
        return [(self.host_pages[i:i + step], self.device_pages[i:i + step])
                for i in range(0, self.num_pages, step)]

    def move(self, direction: Direction, batch_pages: int | None = None) -> None:
        """Copy every pair one way, in batches of ``batch_pages`` (default: one batch)."""
        chunks = self._chunks(batch_pages)
        self._wait([self.engine.submit(CopyBatch(direction, h, d)) for h, d in chunks])

    def round_trip(self, batch_pages: int | None = None) -> None:
        """Evict (D2H) then prefetch (H2D, after it) the same pages; returns when both are
        complete. The prefetch loads each host page into the device page one run further on
        in its batch (:func:`load_pages`): the same pages and the same kind of pairs, but a
        load that did not happen shows in :meth:`verify_round_trip`."""
        handles = []
        for h, d in self._chunks(batch_pages):
            out = self.engine.submit(CopyBatch(Direction.D2H, h, d))
            after = (Dependency(out, needs_data=True),)
            back = self.engine.submit(CopyBatch(Direction.H2D, h, load_pages(d), deps=after))
            handles += [out, back]
        self._wait(handles)

    def verify_round_trip(self, label: str) -> None:
        """Check every byte of one :meth:`round_trip`, the call the copy figures time: each
        host page must hold its device page's bytes from before, and each device page of the
        load those of the page one run back (which it did not hold before)."""
        every = torch.from_numpy(self.device_pages)
        before = self._device_rows(every)
        self.round_trip()
        if not torch.equal(self.binding.host[:, torch.from_numpy(self.host_pages)], before):
            raise CopyVerificationError(f"{label}: after the round trip's D2H, the host pages "
                                        f"differ from the device pages they back up")
        loaded = self._device_rows(torch.from_numpy(load_pages(self.device_pages)))
        if not torch.equal(loaded, before):
            raise CopyVerificationError(f"{label}: after the round trip's H2D, the device pages "
                                        f"differ from the host pages loaded into them")
        self.ctx.verified.append(label)

    def _wait(self, handles: list[BatchHandle]) -> None:
        for handle in handles:
            handle.done.wait()
            _check(handle)
        self.ctx.device.synchronize()  # on CUDA the clock stops when the bytes have landed

    # --- correctness ------------------------------------------------------------------------

    def _device_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """``uint8 [L, k, B]`` on the CPU: the device bytes of ``pages`` in every layer."""
        dev_index = pages.to(self.binding.device)
        layers = self.binding.device_layers
        return torch.stack([layer.index_select(0, dev_index) for layer in layers]).cpu()

    def _random_rows(self, k: int) -> torch.Tensor:
        g = self.geometry
        return torch.randint(0, 256, (g.num_layers, k, g.bytes_per_page_per_layer),
                             dtype=torch.uint8, generator=self._rng)

    def verify(self, label: str, d2h: Callable[[], None] | None = None,
               h2d: Callable[[], None] | None = None) -> None:
        """Check that ``d2h``/``h2d`` (default: this rig's engine) move exactly the right bytes.

        Overwrites a few host pages of the batch with noise, copies D2H and compares them with
        their device pages; then fresh noise, H2D, and the device pages must equal it.
        """
        d2h = d2h or (lambda: self.move(Direction.D2H))
        h2d = h2d or (lambda: self.move(Direction.H2D))
        n = self.num_pages
        inner = np.random.default_rng(self.ctx.seed + 2).integers(0, n, VERIFY_PAGES - 2)
        picks = sorted({0, n - 1, *inner.tolist()})
        host_pages = torch.from_numpy(self.host_pages[picks])
        device_pages = torch.from_numpy(self.device_pages[picks])
        host = self.binding.host  # [L, H, B]

        host[:, host_pages] = self._random_rows(len(picks))
        d2h()
        self.ctx.device.synchronize()
        if not torch.equal(host[:, host_pages], self._device_rows(device_pages)):
            raise CopyVerificationError(
                f"{label}: after D2H, host pages {host_pages.tolist()} differ from device pages "
                f"{device_pages.tolist()}"
            )
        noise = self._random_rows(len(picks))
        host[:, host_pages] = noise
        h2d()
        self.ctx.device.synchronize()
        if not torch.equal(self._device_rows(device_pages), noise):
            raise CopyVerificationError(
                f"{label}: after H2D, device pages {device_pages.tolist()} differ from host pages "
                f"{host_pages.tolist()}"
            )
        self.ctx.verified.append(label)

    # --- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> CopyRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
