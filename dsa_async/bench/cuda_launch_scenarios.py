"""CUDA calls per layer of the CUDA backend's issue code, counted without a device.

The CUDA engine's issue path (``cuda_copy``: plan the batch, upload its page index, issue
every layer as the engine does) runs here on CPU tensors under :class:`CudaCallCounter`, for
the page pairs of the copy.random and copy.extents figures, in both directions. Each counted
op is one call on the copy stream when the same code runs on a GPU: a memcpy, a kernel launch
or an index upload. A ``cudaMemcpyAsync`` or a launch costs ~2-7 us of host time, so a small
constant number per layer is what keeps a 61-layer batch off the forward pass's critical path.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..geometry import HostLayout
from ..host_memory.pool import HostPool
from ..kinds import Direction
from ..transfer.buffers import bind_pool
from ..transfer.cuda_copy import (
    DEFAULT_STAGING_BYTES,
    TIMING_EVENTS_PER_BATCH,
    BatchCopy,
    DeviceStaging,
    PoolTarget,
    issue_batch,
    record_layer_events,
)
from ..transfer.pinning import DEFAULT_CHUNK_BYTES, chunk_ranges
from ..transfer.registrations import RegistrationMap
from .copy_rig import RUN_PAGES, SPREAD, PagePattern, pages_for_bytes
from .cuda_calls import CudaCallCounter
from .registry import BenchContext, Comparison, Target, register_scenario, register_target

_DEFINITION = (
    "CUDA calls (memcpy calls, kernel launches, index uploads and event records alike) that "
    "the CUDA backend's issue code (plan, index upload, every layer, a load's per-layer "
    "readiness events, each batch's start and end events) makes per layer for one pool "
    "(DSA indexer, layer_first host, separate per-layer device tensors, host arena mapped "
    "for the device, 1 GiB registration chunks, default staging), averaged over the D2H and "
    "the H2D batch of the {figure} page pairs (one batch of >= 128 MiB each); counted by "
    "running that code on CPU tensors with every torch op that would be a CUDA call counted"
)
RANDOM = register_target(Target(
    "cuda.launches_per_layer.random", Comparison.AT_MOST, 4.0, "calls",
    _DEFINITION.format(figure="copy.random"),
))
EXTENTS = register_target(Target(
    "cuda.launches_per_layer.extents", Comparison.AT_MOST, 4.0, "calls",
    _DEFINITION.format(figure="copy.extents"),
))


def _pairs(pattern: PagePattern, n: int, rng: np.random.Generator, pool: HostPool):
    """The page pairs of the copy rig's pattern (``copy_rig.CopyRig``)."""
    if pattern is PagePattern.EXTENTS:
        handle = pool.allocate(n)
        slots = rng.choice(SPREAD * n // RUN_PAGES, n // RUN_PAGES, replace=False)
        device = (slots[:, None] * RUN_PAGES + np.arange(RUN_PAGES)).reshape(-1)
        host = handle.pages
    else:
        handle = pool.allocate(SPREAD * n)
        host = rng.choice(handle.pages, n, replace=False)
        device = rng.choice(SPREAD * n, n, replace=False)
    return (np.ascontiguousarray(host, dtype=np.int64),
            np.ascontiguousarray(device, dtype=np.int64))


def calls_per_layer(ctx: BenchContext, pattern: PagePattern) -> float:
    """Counted calls per layer, averaged over both directions of one batch of ``pattern``."""
    g = dataclasses.replace(ctx.geometry, host_layout=HostLayout.LAYER_FIRST)
    n = pages_for_bytes(g, ctx.figure_bytes)
    host_pages = n if pattern is PagePattern.EXTENTS else SPREAD * n
    pool = HostPool.create([g], host_pages)
    arena = pool.arenas[g.name]
    device = [torch.empty(SPREAD * n, g.bytes_per_page_per_layer, dtype=torch.uint8)
              for _ in range(g.num_layers)]
    binding = bind_pool(g, arena, device)
    storage = arena.untyped_storage()
    registrations = RegistrationMap(chunk_ranges(storage.data_ptr(), storage.nbytes(),
                                                 DEFAULT_CHUNK_BYTES))
    target = PoolTarget.of(binding, binding.host)  # on the CPU the mapped view is the arena
    staging = DeviceStaging(torch.device("cpu"), DEFAULT_STAGING_BYTES, min(host_pages, SPREAD * n))
    host, dev = _pairs(pattern, n, np.random.default_rng(ctx.seed), pool)
    calls = 0
    for direction in Direction:
        counter = CudaCallCounter()
        events = _CountedEvents(counter)
        with counter:
            copy = BatchCopy(host, dev, [target], direction, staging, registrations)
            copy.upload_index()
            # as the engine issues a batch (cuda.py, _issue): a start event, the layers (a
            # load records each layer's readiness event after it), an end event
            events.record_timing(TIMING_EVENTS_PER_BATCH)
            readiness = None if direction is Direction.D2H else (
                lambda first, last: record_layer_events(first, last, events.take, None, []))
            issue_batch(copy, g.num_layers, after_group=readiness)
        calls += counter.calls
        ctx.progress(f"cuda calls, {pattern.value} {direction.value}: {counter.calls} "
                     f"({dict(counter.by_op)}) for {g.num_layers} layers")
    return calls / (2 * g.num_layers)


class _CountedEvents:
    """Stand-ins for the engine's CUDA events: each ``record`` counts one call on the
    stream in ``counter`` (an event record is one, as a memcpy or a launch is)."""

    def __init__(self, counter: CudaCallCounter) -> None:
        self._counter = counter

    def take(self) -> _CountedEvents:
        return self

    def record(self, _stream: object = None) -> None:
        self._counter.calls += 1
        self._counter.by_op["event_record"] += 1

    def record_timing(self, events: int) -> None:
        for _ in range(events):
            self.record()


@register_scenario
def cuda_launches(ctx: BenchContext) -> dict[str, float]:
    return {RANDOM.name: calls_per_layer(ctx, PagePattern.RANDOM),
            EXTENTS.name: calls_per_layer(ctx, PagePattern.EXTENTS)}
