"""Coalescing: turn one batch's page pairs into the fewest copy calls, and run them on the CPU.

The plan is computed once per batch and shared by every pool (they share the page table):

* ``runs`` — pairs where host and device both advance together (one ``copy_`` each);
* host ``segments`` — maximal host-contiguous stretches; a segment whose device side is
  scattered moves with one gather (``index_select(out=host_segment)``) or one scatter
  (``index_copy_`` from it) per layer, a single pass over the bytes;
* otherwise (scattered on both sides) a gather into a reused staging buffer then a scatter.

With a crew (the CPU engine on more than one core), every plan copied layer by layer shares
whole layers out between the crew's threads instead, each layer one ``memmove`` per run
(long runs) or one numpy gather-scatter (:mod:`.layer_calls`), outside torch's own threads.

Index ops run on wide-integer views of the byte rows (``int64`` when the row size allows),
several times faster than on ``uint8`` rows. When the device layers are one 3-D allocation,
each run is one strided copy across a group of layers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..geometry import HostLayout
from ..kinds import Direction
from ..paging.runs import is_run, page_runs
from .buffers import PoolBinding, same_width
from .copy_crew import SERIAL_ELEMENTS, CopyCrew
from .layer_calls import RunBlocks, gather_scatter, run_copy

#: Below this many bytes per call, Python and dispatch overhead dominate a copy.
MIN_BYTES_PER_CALL = 256 * 1024
#: Runs of at least this many pages on average always take the fused run copies (measured
#: faster than per-layer index copies at runs of 16 with or without other load).
LONG_RUN_PAGES = 4
#: Most layers per fused scatter from host extents (one index_copy_ across them; groups ramp up
#: 1, 2, 4, ... to it). A 61-layer load of extents measured 0.76-0.78 of a contiguous copy at 8
#: and 0.82-0.85 at 16 (0.83-0.85 at 32), against 0.58 for 2-layer run copies; past the ramp a
#: group is about a quarter of the load.
FUSED_SEGMENT_LAYERS = 16


class CopyMode(enum.Enum):
    SEGMENTS = "segments"  #: host side in few contiguous stretches: one pass per stretch
    SCATTER = "scatter"  #: both sides scattered: gather to staging, then scatter


@dataclass(frozen=True)
class Segment:
    host_start: int
    num_pages: int
    device_start: int  #: first device page when ``device_index`` is None (contiguous)
    device_index: torch.Tensor | None  #: int64 [num_pages] when scattered on the device


@dataclass(frozen=True)
class PagePlan:
    """Precomputed indices and coalescing for one batch (all tensors ``int64``, CPU)."""

    num_pages: int
    host_index: torch.Tensor  #: [n]
    device_index: torch.Tensor  #: [n]
    runs: np.ndarray  #: [r, 3] (host_start, device_start, length)
    segments: tuple[Segment, ...]
    mode: CopyMode

    @classmethod
    def build(cls, host_pages: np.ndarray, device_pages: np.ndarray) -> PagePlan:
        n = int(host_pages.size)
        host_index = torch.from_numpy(host_pages)
        device_index = torch.from_numpy(device_pages)
        if n > 1 and is_run(host_pages) and is_run(device_pages):
            # One run on both sides (e.g. a whole sequence loaded back): the plan is one
            # segment, found without the general pass over every page, so the first layer's
            # copy (what a waiting forward pass sees) starts sooner.
            start_host, start_device = host_pages.item(0), device_pages.item(0)
            runs = np.array([[start_host, start_device, n]], dtype=np.int64)
            return cls(n, host_index, device_index, runs,
                       (Segment(start_host, n, start_device, None),), CopyMode.SEGMENTS)
        runs = page_runs(host_pages, device_pages)
        breaks = np.flatnonzero(np.diff(host_pages) != 1) + 1 if n else np.zeros(0, np.int64)
        bounds = np.concatenate(([0], breaks, [n])) if n else np.zeros(1, np.int64)
        segments = []
        if bounds.size - 1 <= max(1, n // 4):
            for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                dev = device_pages[s:e]
                contiguous = bool((np.diff(dev) == 1).all())
                segments.append(Segment(int(host_pages[s]), e - s, int(dev[0]),
                                        None if contiguous else device_index[s:e]))
            mode = CopyMode.SEGMENTS
        else:
            mode = CopyMode.SCATTER
        return cls(n, host_index, device_index, runs, tuple(segments), mode)

    def uses_fused(self, binding: PoolBinding, to_host: bool = False) -> bool:
        """Whether this plan moves ``binding``'s pages through its fused 3-D device view.

        Loads from host extents always do (one scatter per extent across the layers); run
        copies across the layers do when runs are long, and for short runs only where they
        were measured faster than per-layer index copies on this machine."""
        if binding.device_fused is None:
            return False
        if self.mode is CopyMode.SEGMENTS and not to_host:
            return True
        return (binding.fused_for_short_runs
                or self.num_pages >= LONG_RUN_PAGES * max(1, len(self.runs)))

    def crew_splits_layers(self, binding: PoolBinding, crew_size: int,
                           to_host: bool = False) -> bool:
        """Whether a crew of ``crew_size`` threads shares this plan's layers out, one layer
        per thread at a time: any plan copied layer by layer (not through a fused device
        view), each layer one call with the GIL released (:mod:`.layer_calls`). One thread
        copies a layer at well under a contiguous copy's speed, and torch's index and copy
        ops issued from the engine's threads start intra-op teams of their own that spin
        against each other and the forward pass (extents moved 8 and 6.5 GB/s that way
        against 11 GB/s both ways through a crew of 2 in the same run)."""
        return (crew_size > 1 and self.num_pages > 0
                and not self.uses_fused(binding, to_host))

    def layer_groups(self, binding: PoolBinding, num_layers: int, crew_size: int = 1
                     ) -> list[tuple[int, int]]:
        """Layer ranges ``[first, last)`` for a layer-by-layer load, readiness after each.

        Per-layer device tensors: one layer at a time (index ops per layer anyway), or, with
        a crew of ``crew_size`` threads, that many layers at a time, one per thread
        (:meth:`LayerCopies.run`; the CPU engine streams such a load layer by layer through
        its crew instead when every pool splits layers). A fused
        3-D view moves several layers per call. From host extents the groups ramp up
        (1, 2, 4, then ``FUSED_SEGMENT_LAYERS``) so the first layers are usable at once while
        later calls run at full speed ahead of a consumer still on the early layers; scattered
        pages use groups that move ``MIN_BYTES_PER_CALL`` per page copy.
        """
        if not self.runs.size or not self.uses_fused(binding):
            step = crew_size if self.crew_splits_layers(binding, crew_size) else 1
            return [(layer, min(layer + step, num_layers))
                    for layer in range(0, num_layers, step)]
        if self.mode is CopyMode.SEGMENTS:
            largest, size = FUSED_SEGMENT_LAYERS, 1
        else:
            run_bytes = self.num_pages / len(self.runs) * binding.geometry.bytes_per_page_per_layer
            largest = size = max(1, math.ceil(MIN_BYTES_PER_CALL / run_bytes))
        groups, first = [], 0
        while first < num_layers:
            last = min(first + size, num_layers)
            groups.append((first, last))
            first, size = last, min(size * 2, largest)
        return groups


class Staging:
    """A reusable gather buffer, grown on demand; one per worker thread (never shared)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def rows(self, like: torch.Tensor, num_rows: int) -> torch.Tensor:
        nbytes = num_rows * like.shape[-1] * like.element_size()
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(like.dtype).view(num_rows, like.shape[-1])


def copy_layers_cpu(binding: PoolBinding, plan: PagePlan, direction: Direction, first: int,
                    last: int, staging: Staging, crew: CopyCrew | None = None) -> None:
    """Copy layers ``[first, last)`` of one pool for ``plan``. Blocks the calling thread (and
    uses ``crew``'s helpers, when given, for short run copies through a fused device view).
    A caller that copies one batch in several calls builds :class:`LayerCopies` once."""
    LayerCopies(binding, plan, direction, staging, crew).run(first, last)


class LayerCopies:
    """One pool's copy of one batch (``plan``), run layer range by layer range.

    The per-layer index calls are bound once and kept, so layers bound ahead run back to back
    and pay only the calls themselves between layers: the Python work between per-layer calls
    (views, slices, plan lookups) cost 5-7 % of an extents copy while the copy threads waited.
    A layer's calls are bound when it first runs, or ahead by :meth:`bind_all` (the CPU engine
    does that for a backup, and for a load only while it waits for a dependency or producer:
    binding ahead must not delay a load's first layers). Not thread-safe, except that when
    :attr:`splits_layers`, single layers may run on different threads at once (each binds only
    its own entry); blocks only in :meth:`run`."""

    __slots__ = ("_binding", "_plan", "_to_host", "_crew", "_staging", "_fused", "_segments",
                 "_per_layer", "_crew_layers", "_blocks")

    def __init__(self, binding: PoolBinding, plan: PagePlan, direction: Direction,
                 staging: Staging, crew: CopyCrew | None = None) -> None:
        self._binding, self._plan, self._crew, self._staging = binding, plan, crew, staging
        self._to_host = to_host = direction is Direction.D2H
        self._fused = plan.uses_fused(binding, to_host)
        self._segments = plan.mode is CopyMode.SEGMENTS and binding.host_rows_contiguous
        self._per_layer: list[tuple[Callable[[], object], ...] | None] = (
            [] if self._fused else [None] * binding.geometry.num_layers)
        #: layers shared out between the crew's threads (each layer's call is independent)
        self._crew_layers = crew is not None and plan.crew_splits_layers(binding, crew.size,
                                                                          to_host)
        self._blocks: RunBlocks | None = None  #: the runs in bytes, made at the first layer

    def _layer_call(self, host_w: torch.Tensor, dev_w: torch.Tensor) -> Callable[[], object]:
        """One layer's copy as one call for a crew thread: a block copy per run when runs
        are long (``LONG_RUN_PAGES`` on average), else a gather-scatter of rows."""
        plan = self._plan
        if plan.num_pages < LONG_RUN_PAGES * len(plan.runs):
            return gather_scatter(host_w, dev_w, plan.host_index, plan.device_index,
                                  self._to_host)
        row_bytes = host_w.shape[1] * host_w.element_size()
        blocks = self._blocks
        if blocks is None or blocks.row_bytes != row_bytes:
            # two threads may both make it for their first layers: the same value
            blocks = self._blocks = RunBlocks(plan.runs, row_bytes)
        return run_copy(host_w, dev_w, plan.runs, blocks, self._to_host)

    @property
    def splits_layers(self) -> bool:
        """Whether each layer is one independent call that any crew thread may run
        (:meth:`run` of a single layer, any thread, any order)."""
        return self._crew_layers

    def _bind(self, layer: int) -> tuple[Callable[[], object], ...]:
        host_w, dev_w = self._binding.layers_wide[layer]
        if self._crew_layers:
            calls = (self._layer_call(host_w, dev_w),)
        elif self._segments:
            calls = _segment_calls(host_w, dev_w, self._plan, self._to_host)
        else:
            calls = _scattered_calls(host_w, dev_w, self._plan, self._to_host, self._staging)
        self._per_layer[layer] = calls
        return calls

    def _run_layers(self, layers: range) -> None:
        per_layer = self._per_layer
        for layer in layers:
            calls = per_layer[layer]
            for call in self._bind(layer) if calls is None else calls:
                call()

    def bind_all(self) -> None:
        """Bind every layer not bound yet (a few us per layer). Does not copy."""
        for layer, calls in enumerate(self._per_layer):
            if calls is None:
                self._bind(layer)

    def run(self, first: int, last: int) -> None:
        """Copy layers ``[first, last)``. Blocks the calling thread (and the crew's helpers,
        which then copy some of the layers)."""
        if not self._fused:
            if self._crew_layers and last - first > 1:
                self._crew.map(self._run_layers, range(first, last))
            else:
                self._run_layers(range(first, last))
            return
        binding, plan, to_host, crew = self._binding, self._plan, self._to_host, self._crew
        host, dev = binding.host[first:last], binding.device_fused[first:last]
        if not to_host and plan.mode is CopyMode.SEGMENTS:
            _scatter_segments_fused(*same_width(host, dev), plan)
            return
        runs = plan.runs.tolist()
        if crew is not None and crew.size > 1 and len(runs) > 1:
            # Runs too short for torch to split each copy across its threads: wide elements
            # (fewer, larger steps) and the runs shared out between the crew's threads.
            host_w, dev_w = same_width(host, dev)
            per_call = (last - first) * host_w.shape[-1] * plan.num_pages / len(runs)
            if per_call < SERIAL_ELEMENTS:
                crew.map(functools.partial(_run_copies, host_w, dev_w, to_host), runs)
                return
        # Long runs stay on bytes: torch splits each such copy across its threads (wide
        # elements measured slower there, 0.43 vs 0.71).
        _run_copies(host, dev, to_host, runs)


def _run_copies(host: torch.Tensor, dev: torch.Tensor, to_host: bool,
                runs: list[list[int]]) -> None:
    """Strided copies of ``runs`` (``[host_start, device_start, pages]``) across the layers of
    ``host`` and ``dev`` (``[layers, pages, row]`` views in one element type)."""
    for h, d, k in runs:
        if to_host:
            host[:, h:h + k].copy_(dev[:, d:d + k])
        else:
            dev[:, d:d + k].copy_(host[:, h:h + k])


def _scatter_segments_fused(host: torch.Tensor, dev: torch.Tensor, plan: PagePlan) -> None:
    """Load host extents into a fused device view: one call per extent across the layers."""
    for seg in plan.segments:
        h = host[:, seg.host_start:seg.host_start + seg.num_pages]
        if seg.device_index is None:
            dev[:, seg.device_start:seg.device_start + seg.num_pages].copy_(h)
        else:
            dev.index_copy_(1, seg.device_index, h)


def _segment_calls(host: torch.Tensor, dev: torch.Tensor, plan: PagePlan, to_host: bool
                   ) -> tuple[Callable[[], object], ...]:
    """One layer's calls, a single pass per host segment; ``host`` and ``dev`` in one element
    type (``PoolBinding.layers_wide``)."""
    calls = []
    for seg in plan.segments:
        h = host[seg.host_start:seg.host_start + seg.num_pages]
        if seg.device_index is None:
            d = dev[seg.device_start:seg.device_start + seg.num_pages]
            calls.append(functools.partial(h.copy_, d) if to_host
                         else functools.partial(d.copy_, h))
        elif to_host:
            calls.append(functools.partial(torch.index_select, dev, 0, seg.device_index, out=h))
        else:
            calls.append(functools.partial(dev.index_copy_, 0, seg.device_index, h))
    return tuple(calls)


def _scattered_calls(host: torch.Tensor, dev: torch.Tensor, plan: PagePlan, to_host: bool,
                     staging: Staging) -> tuple[Callable[[], object], ...]:
    """One layer's calls, a gather into ``staging`` then a scatter; ``host`` and ``dev`` in one
    element type (``PoolBinding.layers_wide``)."""
    src, dst = (dev, host) if to_host else (host, dev)
    src_index, dst_index = (
        (plan.device_index, plan.host_index) if to_host else (plan.host_index, plan.device_index)
    )
    buffer = staging.rows(src, plan.num_pages)
    return (functools.partial(torch.index_select, src, 0, src_index, out=buffer),
            functools.partial(dst.index_copy_, 0, dst_index, buffer))


def measure_fused_for_short_runs(binding: PoolBinding, *, sample_pages: int = 16,
                                 rounds: int = 3, seed: int = 0,
                                 crew: CopyCrew | None = None) -> bool:
    """Whether run copies across the fused device view beat per-layer index copies for single
    scattered pages on this machine: both move the same random device pages of every layer
    into a scratch buffer shaped like the host arena, ``rounds`` times each, interleaved; the
    faster best time wins; run copies go through ``crew`` when given, as the engine's do.
    Reads the device buffers, writes only the scratch. Blocks the calling thread (a few ms);
    run it off the loop."""
    fused = binding.device_fused
    if fused is None:
        return False
    num_layers, device_pages, row = fused.shape
    k = min(sample_pages, device_pages)
    if k < 2:
        return True
    rng = np.random.default_rng(seed)
    device_index = rng.choice(device_pages, k, replace=False).astype(np.int64)
    host_index = rng.permutation(k).astype(np.int64)  # scattered on the host side too
    plan = PagePlan.build(host_index, device_index)
    if binding.geometry.host_layout is HostLayout.PAGE_FIRST:  # strided like the arena
        host = torch.empty((k, num_layers, row), dtype=torch.uint8).transpose(0, 1)
    else:
        host = torch.empty((num_layers, k, row), dtype=torch.uint8)
    through_fused = dataclasses.replace(binding, host=host, fused_for_short_runs=True)
    per_layer = dataclasses.replace(through_fused, fused_for_short_runs=False)
    staging = Staging()
    best = {True: math.inf, False: math.inf}
    for _ in range(rounds):
        for fused_first, candidate in ((True, through_fused), (False, per_layer)):
            started = time.perf_counter()
            copy_layers_cpu(candidate, plan, Direction.D2H, 0, num_layers, staging, crew)
            best[fused_first] = min(best[fused_first], time.perf_counter() - started)
    return best[True] <= best[False]
