"""CUDA backend: one copy stream per direction, per-layer events, device-timed durations.

This is the only module (with its helpers ``cuda_copy`` and ``pinning``) that touches
``torch.cuda``; importing it needs no device.

Threads, per direction::

    submit() ──queue──▶ issuing thread ──queue──▶ completion thread ──▶ handoff ──▶ loop
                        (waits, copies, records      (synchronizes events in order,
                         events; never blocks         marks layers ready, finishes,
                         on a copy)                   recycles events)

* The issuing thread makes its copy stream wait (GPU-side) for the batch's dependencies and
  producers, records a timing event, issues the coalesced copies (``cuda_copy``) and records
  events: one per layer for H2D (appended to ``handle.layer_events``, then
  ``handle.mark_issued``), one end event for every batch. A dependency is waited for by first
  waiting (CPU-side) until its copies are *issued*, never until they complete, then
  ``stream.wait_event`` on its end event.
* The completion thread synchronizes the layer events in order, posts per-layer readiness to
  the loop, then the end event; it reports the device-timed duration and the outcome, and only
  then returns the events to the pool (an event is re-recorded only after it completed).
* ``wait_layer`` (forward-pass thread) blocks only until the layer is issued, then makes the
  caller's current stream wait on the layer's event: no CPU wait on the copy.

Event reuse is guarded per batch: dependents and ``wait_layer`` read a batch's events under its
lock and skip the wait once the batch completed (the work is done, nothing to wait for), and the
completion thread marks the batch recycled under the same lock before pooling its events, so no
one can wait on an event after it was handed to a later batch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping

import torch

from ..errors import ConfigError, ServiceClosedError, TransferFailedError
from ..geometry import HostLayout
from ..kinds import Backend, Direction
from .base import FaultHook, TransferEngine
from .batch import BatchHandle, CopyBatch
from .buffers import PoolBinding
from .cuda_copy import (
    DEFAULT_STAGING_BYTES,
    DevicePlan,
    DeviceStaging,
    copy_pool,
    h2d_layer_group,
)
from .handoff import LoopHandoff
from .pinning import DEFAULT_CHUNK_BYTES, HostPinning

log = logging.getLogger(__name__)

_STATE = "_cuda_progress"  # attribute this backend adds to its BatchHandles


def require_cuda() -> None:
    """Raise ``ConfigError`` unless a CUDA device is visible to this process."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "backend 'cuda' needs a CUDA device, but none is visible to this process "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False; check "
            "CUDA_VISIBLE_DEVICES and the driver); use backend 'cpu' (or 'auto') instead"
        )


class _Progress:
    """CUDA-side state of one batch, attached to its handle."""

    __slots__ = ("end", "error", "issued", "lock", "recycled", "start")

    def __init__(self) -> None:
        self.issued = threading.Event()  #: set once every copy (and the end event) is enqueued
        self.lock = threading.Lock()  #: guards reading events against their recycling
        self.start: torch.cuda.Event | None = None
        self.end: torch.cuda.Event | None = None
        self.error: BaseException | None = None  #: raised while issuing
        self.recycled = False  #: events went back to the pool: the batch completed


class _EventPool:
    """Events reused across batches; only completed events are put back.

    Events are created with blocking sync: the completion thread then sleeps in
    ``synchronize()`` instead of spinning a CPU core for the whole copy.
    """

    def __init__(self, enable_timing: bool) -> None:
        self.enable_timing = enable_timing
        self._free: queue.SimpleQueue[torch.cuda.Event] = queue.SimpleQueue()

    def take(self) -> torch.cuda.Event:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return torch.cuda.Event(enable_timing=self.enable_timing, blocking=True)

    def give(self, event: torch.cuda.Event) -> None:
        self._free.put(event)


class _Lane:
    """Everything one direction owns: stream, staging, event pools, queues, threads."""

    def __init__(self, engine: CudaEngine, direction: Direction) -> None:
        self.direction = direction
        self.stream = torch.cuda.Stream(device=engine.device)
        self.staging = DeviceStaging(engine.device, engine.staging_bytes)
        self.timing_events = _EventPool(enable_timing=True)
        self.layer_events = _EventPool(enable_timing=engine.layer_event_timing)
        self.pending: queue.SimpleQueue[BatchHandle | None] = queue.SimpleQueue()
        self.issued: queue.SimpleQueue[BatchHandle | None] = queue.SimpleQueue()
        name = direction.value
        self.issuer = threading.Thread(target=engine._issue_loop, args=(self,),
                                       name=f"dsa-async-{name}-issue", daemon=True)
        self.completer = threading.Thread(target=engine._complete_loop, args=(self,),
                                          name=f"dsa-async-{name}-complete", daemon=True)


class CudaEngine(TransferEngine):
    """Transfer engine on CUDA streams. Page-locks the pools' host arenas for its lifetime."""

    backend = Backend.CUDA
    #: Bytes per device staging buffer (per direction; a page_first host uses two).
    staging_bytes = DEFAULT_STAGING_BYTES
    #: Largest single cudaHostRegister call.
    pin_chunk_bytes = DEFAULT_CHUNK_BYTES
    #: Per-layer events with timing (tests read their timestamps; slower to synchronize).
    layer_event_timing = False

    def __init__(self, bindings: Mapping[str, PoolBinding], handoff: LoopHandoff,
                 on_batch_done: Callable[[BatchHandle], None], *,
                 fault_hook: FaultHook | None = None) -> None:
        require_cuda()
        super().__init__(bindings, handoff, on_batch_done, fault_hook=fault_hook)
        self.device = self._check_bindings()
        self._closed = False
        self._close_lock = threading.Lock()
        self._pinning = HostPinning(self.device, chunk_bytes=self.pin_chunk_bytes)
        try:
            for name, binding in self.bindings.items():
                self._pinning.register_tensor_storage(binding.host, f"host pool {name!r}")
            self._lanes = {d: _Lane(self, d) for d in Direction}
        except BaseException:
            self._pinning.unregister_all()
            raise
        for lane in self._lanes.values():
            lane.issuer.start()
            lane.completer.start()

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this engine page-locked (exactly the arenas' bytes; 0 after close)."""
        return self._pinning.pinned_bytes

    def _check_bindings(self) -> torch.device:
        devices = set()
        for name, b in self.bindings.items():
            if b.host.device.type != "cpu":
                raise ConfigError(f"pool {name!r}: the host arena must be a CPU tensor, "
                                  f"got one on {b.host.device}")
            arena = b.host if b.geometry.host_layout is HostLayout.LAYER_FIRST else (
                b.host.transpose(0, 1))
            if not arena.is_contiguous():
                raise ConfigError(f"pool {name!r}: the host arena must be one contiguous "
                                  f"tensor (got strides {tuple(arena.stride())})")
            if b.device.type != "cuda":
                raise ConfigError(f"pool {name!r}: device buffers are on {b.device}; the cuda "
                                  f"backend needs them on a CUDA device (or use backend 'cpu')")
            devices.add(b.device)
        if len(devices) != 1:
            raise ConfigError(f"every pool's device buffers must be on one device, got "
                              f"{sorted(str(d) for d in devices)}")
        device = devices.pop()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    # --- loop side ------------------------------------------------------------------------

    def submit(self, batch: CopyBatch) -> BatchHandle:
        if self._closed:
            raise ServiceClosedError("the CUDA transfer engine is closed; submit before close()")
        handle = BatchHandle(batch, self.num_layers)
        setattr(handle, _STATE, _Progress())
        self._lanes[batch.direction].pending.put(handle)
        return handle

    def capture_producer(self) -> torch.cuda.Event:
        """An event on the calling thread's current stream: a backup starts after the work
        queued there before it. Work on other streams (e.g. a forward pass driven by another
        thread) is not covered: such callers pass their own event as ``after``."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def normalize_after(self, after: object) -> object:
        if isinstance(after, (torch.cuda.Event, torch.cuda.Stream)):
            return after
        raise TypeError(
            f"after={after!r} is not a producer the cuda backend can wait for; pass a "
            f"torch.cuda.Event (recorded after the kernels that wrote the pages), a "
            f"torch.cuda.Stream, or a Transfer"
        )

    # --- consumer side ----------------------------------------------------------------------

    def wait_layer(self, handle: BatchHandle, layer: int) -> None:
        handle.wait_issued(layer)  # CPU: only until the layer's copy is enqueued
        if handle.layers_ready > layer:
            return  # its copy completed: later GPU work is ordered after it already
        progress: _Progress = getattr(handle, _STATE)
        with progress.lock:
            if progress.recycled:
                return  # completed meanwhile (events already reused): nothing to wait for
            events = handle.layer_events
            event = events[layer] if layer < len(events) else progress.end
            if event is not None:
                # Per-layer readiness: the consumer's kernels queued after this point read the
                # layer only once its copy landed; the CPU does not wait for the copy.
                torch.cuda.current_stream(self.device).wait_event(event)

    # --- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for lane in self._lanes.values():
            lane.pending.put(None)  # after everything submitted so far
        for lane in self._lanes.values():
            lane.issuer.join()
            lane.completer.join()
        for lane in self._lanes.values():
            lane.stream.synchronize()  # every copy reading the arenas is done before unlocking
        self._pinning.unregister_all()

    # --- issuing thread ---------------------------------------------------------------------

    def _issue_loop(self, lane: _Lane) -> None:
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(lane.stream):  # every op below lands on this lane's stream
            while (handle := lane.pending.get()) is not None:
                self._issue(lane, handle)
                lane.issued.put(handle)
        lane.issued.put(None)

    def _issue(self, lane: _Lane, handle: BatchHandle) -> None:
        progress: _Progress = getattr(handle, _STATE)
        stream = lane.stream
        try:
            self._wait_for_dependencies(stream, handle.batch)
            self._wait_for_producers(stream, handle.batch, lane.direction)
            progress.start = lane.timing_events.take()
            progress.start.record(stream)
            plan = DevicePlan.build(handle.batch.host_pages, handle.batch.device_pages,
                                    self.device)
            if plan.num_pages:
                if lane.direction is Direction.D2H:
                    self._issue_d2h(handle, plan, lane)
                else:
                    self._issue_h2d(handle, plan, lane)
        except BaseException as exc:  # noqa: BLE001 - reaches every waiter through finish()
            progress.error = exc
        finally:
            try:
                # Recorded even after a failure: dependents then wait for whatever part of
                # this batch was enqueued before it failed.
                end = lane.timing_events.take()
                end.record(stream)
                progress.end = end
            except BaseException as exc:  # noqa: BLE001 - the device is unusable
                progress.error = progress.error or exc
            progress.issued.set()

    def _wait_for_dependencies(self, stream: torch.cuda.Stream, batch: CopyBatch) -> None:
        for dep in batch.deps:
            other: _Progress | None = getattr(dep.handle, _STATE, None)
            if other is None:  # not issued by this engine: only its completion is observable
                dep.handle.done.wait()
                error = dep.handle.error
            else:
                other.issued.wait()  # CPU side: until its copies are enqueued, not finished
                error = other.error or dep.handle.error
                with other.lock:
                    if not other.recycled and other.end is not None:
                        # Hazard: an earlier batch copies the same host or device pages (its
                        # backup must land before we read, or its readers before we write);
                        # order this stream after its last copy, on the GPU.
                        stream.wait_event(other.end)
            if dep.needs_data and error is not None:
                raise TransferFailedError(
                    f"batch {dep.handle.batch.batch_id}, which produced the host pages this "
                    f"batch reads, failed: {error!r}"
                ) from error

    @staticmethod
    def _wait_for_producers(stream: torch.cuda.Stream, batch: CopyBatch,
                            direction: Direction) -> None:
        producers = batch.after
        if producers is None:
            producers = ()
        elif not isinstance(producers, (tuple, list)):
            producers = (producers,)
        for producer in producers:
            if isinstance(producer, torch.cuda.Event):
                # D2H: the kernels that wrote these device pages must finish before we read
                # them. H2D: earlier readers of the device pages must finish before we
                # overwrite them. The event marks that point on the caller's stream.
                stream.wait_event(producer)
            elif isinstance(producer, torch.cuda.Stream):
                # Same reason, for everything queued on that stream by the time this batch is
                # issued (later than submit: waits a little more, never less).
                stream.wait_stream(producer)
            else:
                raise TypeError(f"{direction.value} batch {batch.batch_id}: cannot wait for "
                                f"producer {producer!r}; expected a torch.cuda.Event or Stream")

    def _issue_d2h(self, handle: BatchHandle, plan: DevicePlan, lane: _Lane) -> None:
        if self.fault_hook is not None:
            self.fault_hook(handle.batch, 0)
        for binding in self.bindings.values():
            copy_pool(binding, plan, Direction.D2H, 0, binding.geometry.num_layers, lane.staging)
        handle.mark_issued(self.num_layers)

    def _issue_h2d(self, handle: BatchHandle, plan: DevicePlan, lane: _Lane) -> None:
        bindings = list(self.bindings.values())
        group = h2d_layer_group(bindings)
        for first in range(0, self.num_layers, group):
            last = min(first + group, self.num_layers)
            if self.fault_hook is not None:
                self.fault_hook(handle.batch, first)
            for binding in bindings:
                layers = binding.geometry.num_layers
                if first < layers:
                    copy_pool(binding, plan, Direction.H2D, first, min(last, layers),
                              lane.staging)
            for _ in range(first, last):
                event = lane.layer_events.take()
                event.record(lane.stream)  # layer readiness: after every pool's copy of it
                handle.layer_events.append(event)
            handle.mark_issued(last)

    # --- completion thread ------------------------------------------------------------------

    def _complete_loop(self, lane: _Lane) -> None:
        torch.cuda.set_device(self.device)
        while (handle := lane.issued.get()) is not None:
            self._complete(lane, handle)

    def _complete(self, lane: _Lane, handle: BatchHandle) -> None:
        progress: _Progress = getattr(handle, _STATE)
        error = progress.error
        duration_s = 0.0
        completed = False
        try:
            for i, event in enumerate(handle.layer_events):
                event.synchronize()  # this thread waits for the copy; the loop never does
                for callback in handle.mark_ready(i + 1):
                    self.handoff.post(callback)  # per-layer readiness reaches the loop now
            if progress.end is not None:
                progress.end.synchronize()
                if progress.start is not None:
                    duration_s = progress.start.elapsed_time(progress.end) / 1e3
            completed = True
        except BaseException as exc:  # noqa: BLE001 - a device fault fails this batch
            error = error or exc
        due = handle.finish(error, duration_s)
        self._recycle(lane, handle, progress, completed)
        self._report(handle, due)

    @staticmethod
    def _recycle(lane: _Lane, handle: BatchHandle, progress: _Progress, completed: bool) -> None:
        with progress.lock:
            progress.recycled = True
        if not completed:
            return  # state unknown after a device error: let these events go
        for event in handle.layer_events:
            lane.layer_events.give(event)
        for event in (progress.start, progress.end):
            if event is not None:
                lane.timing_events.give(event)
