"""CUDA backend: one copy stream per direction, per-layer events, device-timed durations.

This is the only module (with its helpers ``cuda_copy``, ``cuda_driver``, ``copy_streams``,
``mapped``, ``layer_probes`` and ``pinning``) that touches ``torch.cuda``; importing it needs no
device.

Everything the engine needs on the device is made in its constructor (the service's
``start()``), never while serving: the arenas are page-locked and mapped, copy streams of its
own are created or taken over from a closed engine (``copy_streams``: one per direction, loads
at the higher priority, and one for index copies) and checked distinct, and each direction's
staging and index buffers are allocated (``ServiceConfig.device_staging_bytes`` per
direction). An out-of-memory there is a ``ConfigError`` naming the setting.

Threads, per direction::

    submit() ──queue──▶ issuing thread ──queue──▶ completion thread ──▶ handoff ──▶ loop
                        (waits, plans, copies,       (synchronizes events in order,
                         records events; never        marks layers ready, resolves
                         blocks on a copy)            timeliness probes, recycles events)

* The issuing thread makes its copy stream wait (GPU-side) for the batch's dependencies and
  producers, plans the batch once (``cuda_copy.BatchCopy``: paths, tiles, one index upload),
  then records the start timing event, issues the copies and records events: one per layer
  for H2D (appended to ``handle.layer_events``, then ``handle.mark_issued``), one end event
  for every batch. The start event is recorded after planning and the waits, so the
  device-timed duration covers the copies only. A dependency is waited for by first waiting
  (CPU-side) until its copies are *issued*, never until they complete, then
  ``stream.wait_event`` on its end event.
* The completion thread synchronizes the layer events in order, posts per-layer readiness to
  the loop, then the end event; it reports the device-timed duration and the outcome, resolves
  the timeliness probes of ``wait_layer`` calls (``layer_probes``), and only then returns the
  events to the pool (an event is re-recorded only after it completed).
* ``wait_layer`` (forward-pass thread) blocks only until the layer is issued, then makes the
  caller's current stream wait on the layer's event: no CPU wait on the copy.

Which streams a copy waits for: its ``after`` producers, each an event recorded on the
submitting thread (``capture_producer``: the submitting thread's current stream at submit;
``normalize_after``: a caller's event as given, a caller's stream as an event recorded on it
at submit), and the end events of the earlier batches it depends on (hazards).

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

import numpy as np
import torch

from ..errors import (
    ArgumentTypeError,
    ConfigError,
    CopyNotRunError,
    IndexTypeError,
    ServiceClosedError,
)
from ..geometry import HostLayout
from ..kinds import Backend, Direction
from .base import FaultHook, TransferEngine
from .batch import BatchHandle, CopyBatch
from .buffers import PoolBinding
from .copy_streams import CopyStreams
from .cuda_copy import (
    DEFAULT_STAGING_BYTES,
    BatchCopy,
    DeviceStaging,
    PoolTarget,
    issue_batch,
    record_layer_events,
)
from .event_waits import wait_for, wait_in_order
from .handoff import LoopHandoff
from .layer_probes import ON_TIME, Classify, LayerProbe, call_classify, verdict
from .mapped import mapped_view
from .pinning import DEFAULT_CHUNK_BYTES, HostPinning

log = logging.getLogger(__name__)

_STATE = "_cuda_progress"  # attribute this backend adds to its BatchHandles


def _ignore_verdict(late: bool, waited_s: float) -> None:
    """``classify`` of callers that do not count timeliness."""


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

    __slots__ = ("end", "error", "issued", "lock", "probes", "recycled", "start")

    def __init__(self) -> None:
        self.issued = threading.Event()  #: set once every copy (and the end event) is enqueued
        self.lock = threading.Lock()  #: guards reading events against their recycling
        self.start: torch.cuda.Event | None = None
        self.end: torch.cuda.Event | None = None
        self.error: BaseException | None = None  #: raised while issuing
        self.recycled = False  #: events went back to the pool: the batch completed
        self.probes: list[LayerProbe] = []  #: wait_layer calls to resolve at completion


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

    def __init__(self, engine: CudaEngine, direction: Direction, stream: torch.cuda.Stream,
                 staging: DeviceStaging) -> None:
        self.direction = direction
        self.stream = stream
        self.staging = staging
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
    """Transfer engine on CUDA streams. Page-locks the pools' host arenas for its lifetime.

    ``staging_bytes``: device staging per direction (``ServiceConfig.device_staging_bytes``;
    ``None``: the class default), allocated here, never later.
    """

    backend = Backend.CUDA
    #: What ``after=`` may hold for this backend (besides Transfers), for messages.
    producer_kinds = "torch.cuda.Event, torch.cuda.Stream"
    #: A producer is waited for on the GPU (``stream.wait_event``): that wait cannot fail alone.
    producer_waits_can_fail = False
    waits_on_device = True
    #: Default bytes of device staging per direction.
    staging_bytes = DEFAULT_STAGING_BYTES
    #: Largest single cudaHostRegister call.
    pin_chunk_bytes = DEFAULT_CHUNK_BYTES
    #: Per-layer events with timing: timeliness compares them with the consumer's probe.
    layer_event_timing = True

    def __init__(self, bindings: Mapping[str, PoolBinding], handoff: LoopHandoff,
                 on_batch_done: Callable[[BatchHandle], None], *,
                 fault_hook: FaultHook | None = None, staging_bytes: int | None = None) -> None:
        require_cuda()
        super().__init__(bindings, handoff, on_batch_done, fault_hook=fault_hook)
        if staging_bytes is not None:
            self.staging_bytes = staging_bytes
        self.device = self._check_bindings()
        self._closed = False
        self._close_lock = threading.Lock()
        self._probe_events = _EventPool(enable_timing=True)
        self._streams: CopyStreams | None = None
        self._pinning = HostPinning(self.device, chunk_bytes=self.pin_chunk_bytes)
        try:
            for name, binding in self.bindings.items():
                self._pinning.register_tensor_bytes(binding.host, f"host pool {name!r}")
            self.registrations = self._pinning.registration_map()
            own = self._pinning.own_map()
            self.targets = [PoolTarget.of(b, mapped_view(b.host, self.device, own))
                            for b in self.bindings.values()]
            self._streams = CopyStreams.create(self.device)
            #: device index tensors are staged to the host here (stage_indices); the engine's
            #: own, not one of torch's pooled streams, which may be the forward pass's
            self._index_stream = self._streams.index
            staging = self._allocate_staging()
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(self.device))
            self._lanes = {d: _Lane(self, d, self._streams.streams[d], staging[d])
                           for d in Direction}
            for lane in self._lanes.values():
                # The staging memory may have been freed by work still queued on the stream that
                # allocated it (the caching allocator orders reuse on that stream only): the copy
                # streams start after that work.
                lane.stream.wait_event(allocated)
        except BaseException:
            if self._streams is not None:
                self._streams.retire()
            self._pinning.unregister_all()
            raise
        for lane in self._lanes.values():
            lane.issuer.start()
            lane.completer.start()

    def _allocate_staging(self) -> dict[Direction, DeviceStaging]:
        """Both directions' staging and index buffers, now; ``ConfigError`` if they do not fit."""
        # A batch never repeats a page it writes: host pages of a backup, device pages of a
        # load (two backups may read one device page, two loads one host page).
        index_pages = max(min(b.host.shape[1] for b in self.bindings.values()),
                          min(b.device_pages for b in self.bindings.values()))
        widest_row = max(b.geometry.bytes_per_page_per_layer for b in self.bindings.values())
        if self.staging_bytes < 2 * widest_row:
            raise ConfigError(f"device staging of {self.staging_bytes:,} B per direction is below "
                              f"two page rows ({widest_row:,} B each); raise "
                              f"ServiceConfig.device_staging_bytes")
        try:
            return {d: DeviceStaging(self.device, self.staging_bytes, index_pages)
                    for d in Direction}
        except torch.cuda.OutOfMemoryError as exc:
            free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
            need = 2 * (self.staging_bytes + 16 * index_pages)
            raise ConfigError(
                f"the cuda backend could not allocate its device staging on {self.device}: "
                f"{need:,} B (2 directions x ({self.staging_bytes:,} B staging + "
                f"{16 * index_pages:,} B page index)); the device has {free_bytes:,} B free of "
                f"{total_bytes:,} B. Lower ServiceConfig.device_staging_bytes (at least two "
                f"page rows), or start the service before the KV cache takes the device memory"
            ) from exc

    @property
    def copy_streams(self) -> dict[Direction, torch.cuda.Stream]:
        """The stream each direction copies on (made for this engine alone)."""
        return {d: lane.stream for d, lane in self._lanes.items()}

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
        """An event recorded now on the calling thread's current stream (call it on the
        submitting thread, before any hand-off to the loop). Never blocks.

        A backup then starts after the kernels queued there that wrote its pages, and a load
        after the kernels queued there that still read (or write) the device pages it
        replaces. Work on other streams is not covered: callers pass it in ``after``."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def defers_indices(self, tensor: object) -> bool:
        """Index tensors on this engine's device are read after the request's producers."""
        return isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"

    def stage_indices(self, tensor: torch.Tensor, producers: tuple[object, ...]
                      ) -> Callable[[], np.ndarray]:
        """Queue, on this engine's index stream, a copy of ``tensor`` into page-locked host
        memory after ``producers`` (events or streams: the work that wrote the indices); the
        returned ``fetch()`` synchronizes on that copy's event (the issue thread calls it) and
        returns the values. On the submitting thread; never blocks on the device."""
        if tensor.device != self.device:
            raise IndexTypeError(f"a device index tensor is on {tensor.device}; this service's "
                                 f"cuda backend copies on {self.device}: move it there")
        stream = self._index_stream
        host = torch.empty(tensor.shape, dtype=torch.int64, pin_memory=True)
        for producer in producers:
            if isinstance(producer, torch.cuda.Stream):
                stream.wait_stream(producer)
            else:
                stream.wait_event(producer)
        with torch.cuda.stream(stream):
            wide = tensor if tensor.dtype is torch.int64 else tensor.to(torch.int64)
            host.copy_(wide, non_blocking=True)
        tensor.record_stream(stream)  # the caller may free it; the copy still reads it
        if wide is not tensor:
            wide.record_stream(stream)
        landed = torch.cuda.Event(blocking=True)  # fetch() sleeps in synchronize, no spin
        landed.record(stream)

        def fetch() -> np.ndarray:
            landed.synchronize()
            return host.numpy()

        return fetch

    def normalize_after(self, after: object) -> torch.cuda.Event:
        """One caller-given producer as an event to wait for (call on the submitting thread).

        A ``torch.cuda.Event`` is used as it is: the copy stream waits for it as last recorded
        when the batch is issued (the caller must not record it again before the transfer
        ended). For a ``torch.cuda.Stream`` an event is recorded on it now, so the copy waits
        for the work queued there by the time of submit.
        Anything else raises ``ArgumentTypeError`` (Transfers and sequences are unpacked by the
        service before this is called). Never blocks.
        """
        if isinstance(after, torch.cuda.Event):
            return after
        if isinstance(after, torch.cuda.Stream):
            event = torch.cuda.Event()
            event.record(after)
            return event
        raise ArgumentTypeError(
            f"after={after!r} ({type(after).__name__}) is not a producer the cuda backend can "
            f"wait for; pass a torch.cuda.Event (recorded after the kernels that wrote the "
            f"pages), a torch.cuda.Stream (the copy waits for what is queued on it at submit), "
            f"a Transfer, or a sequence of these"
        )

    # --- consumer side ----------------------------------------------------------------------

    def wait_layer(self, handle: BatchHandle, layer: int, timeout_s: float | None = None,
                   classify: Classify | None = None) -> None:
        """Order the calling thread's current stream after ``layer`` of ``handle``.

        Blocks the calling (forward-pass) thread at most ``timeout_s`` in total, only until
        the layer's copy is *issued* (``TimeoutError`` after that, the transfer keeps running;
        ``TransferFailedError`` if the batch failed first), then makes the current stream wait
        on the layer's event: the CPU never waits for the copy itself. ``classify(late,
        waited_s)`` is called exactly once when this returns normally, possibly later from the
        completion thread: ``late`` only if the current stream reached this point before the
        layer's copy ended (device timestamps), ``waited_s`` how long it then waited. It is not
        called when this raises (nor when it is ``None``).
        """
        classify = classify or _ignore_verdict
        if handle.layers_ready > layer:
            call_classify(classify, *ON_TIME)  # already landed: nothing to order, not late
            return
        progress: _Progress = getattr(handle, _STATE)
        consumer = torch.cuda.current_stream(self.device)
        probe_event = self._probe_events.take()
        # Timeliness: completes when the consumer's stream has run what was queued before this
        # call, i.e. when it is ready for the layer (compared with the layer's event later).
        probe_event.record(consumer)
        probe = LayerProbe(layer, probe_event, classify)
        with progress.lock:
            resolved = progress.recycled
            if not resolved:
                progress.probes.append(probe)
        if resolved:  # completed between the check above and now: landed, or failed first
            handle.raise_if_failed(layer)
            call_classify(classify, *ON_TIME)
            return
        try:
            handle.wait_issued(layer, timeout_s)  # CPU: only until the copy is enqueued
        except BaseException:
            with progress.lock:
                probe.cancelled = True  # nobody classifies a call that raised
            raise
        with progress.lock:
            if not progress.recycled:
                events = handle.layer_events
                event = events[layer] if layer < len(events) else progress.end
                if event is not None:
                    # Per-layer readiness: the consumer's kernels queued after this point read
                    # the layer only once its copy landed; the CPU does not wait for the copy.
                    consumer.wait_event(event)
                probe.armed = True  # the completion thread classifies it
                return
            result = probe.verdict or ON_TIME  # resolved by the completion thread meanwhile
        handle.raise_if_failed(layer)  # it ended meanwhile: landed, or failed first
        call_classify(classify, *result)

    # --- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Drain, then release the streams and unregister the arenas. Blocks (off the loop)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for lane in self._lanes.values():
            lane.pending.put(None)  # after everything submitted so far
        for lane in self._lanes.values():
            lane.issuer.join()
            lane.completer.join()
        # Every step runs even after a device fault, so what can be returned is returned; the
        # first error is raised at the end.
        errors: list[BaseException] = []
        for lane in self._lanes.values():
            try:
                lane.stream.synchronize()  # every copy using the arenas is done before unlocking
            except BaseException as exc:  # noqa: BLE001 - a sticky device error: carry on
                errors.append(exc)
        self._lanes = {}  # the staging goes only after its streams are idle
        try:
            self._index_stream.synchronize()  # an index copy of a request that never ran
        except BaseException as exc:  # noqa: BLE001 - a sticky device error: carry on
            errors.append(exc)
        if self._streams is not None:
            streams, self._streams = self._streams, None
            try:
                streams.retire()
            except BaseException as exc:  # noqa: BLE001 - carry on with the arenas
                errors.append(exc)
        try:
            self._pinning.unregister_all()  # logs what it could not undo
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        if errors:
            raise errors[0]

    # --- issuing thread ---------------------------------------------------------------------

    def _issue_loop(self, lane: _Lane) -> None:
        try:
            torch.cuda.set_device(self.device)
        except BaseException as exc:  # noqa: BLE001 - the device is unusable (a sticky error)
            log.exception("the %s issue thread could not select %s; every batch fails",
                          lane.direction.value, self.device)
            self._fail_every_batch(lane, exc)
            return
        with torch.cuda.stream(lane.stream):  # every op below lands on this lane's stream
            while (handle := lane.pending.get()) is not None:
                self._issue(lane, handle)
                lane.issued.put(handle)
        lane.issued.put(None)

    @staticmethod
    def _fail_every_batch(lane: _Lane, error: BaseException) -> None:
        """Hand every batch of ``lane`` to the completion thread as failed with ``error``,
        issuing nothing, until close() ends the queue: no request waits for ever."""
        while (handle := lane.pending.get()) is not None:
            progress: _Progress = getattr(handle, _STATE)
            progress.error = error
            progress.issued.set()
            lane.issued.put(handle)
        lane.issued.put(None)

    def _issue(self, lane: _Lane, handle: BatchHandle) -> None:
        progress: _Progress = getattr(handle, _STATE)
        stream = lane.stream
        batch = handle.batch
        try:
            self._wait_for_dependencies(stream, batch)
            self._wait_for_producers(stream, batch, lane.direction)
            # Device indices on the GPU: their staged copy follows the producers waited for
            # above, so this blocks this thread (not the stream) until they are readable.
            copy = BatchCopy(batch.host_pages, batch.resolve_device_pages(), self.targets,
                             lane.direction, lane.staging, self.registrations)
            copy.upload_index()
            # Device timing covers the copies only: planning, the index upload and the waits
            # above are all queued before this event.
            progress.start = lane.timing_events.take()
            progress.start.record(stream)
            if copy.num_pages:
                if lane.direction is Direction.D2H:
                    self._issue_d2h(handle, copy)
                else:
                    self._issue_h2d(handle, copy, lane)
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
                raise CopyNotRunError(
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

    def _issue_d2h(self, handle: BatchHandle, copy: BatchCopy) -> None:
        issue_batch(copy, self.num_layers, self._fault_hook_for(handle))
        handle.mark_issued(self.num_layers)

    def _issue_h2d(self, handle: BatchHandle, copy: BatchCopy, lane: _Lane) -> None:
        def layers_issued(first: int, last: int) -> None:
            # layer readiness: after every pool's copy of it
            record_layer_events(first, last, lane.layer_events.take, lane.stream,
                                handle.layer_events)
            handle.mark_issued(last)

        issue_batch(copy, self.num_layers, self._fault_hook_for(handle), layers_issued)

    def _fault_hook_for(self, handle: BatchHandle) -> Callable[[int], None] | None:
        hook = self.fault_hook
        if hook is None:
            return None
        return lambda first: hook(handle.batch, first)

    # --- completion thread ------------------------------------------------------------------

    def _complete_loop(self, lane: _Lane) -> None:
        try:
            torch.cuda.set_device(self.device)
        except BaseException:  # noqa: BLE001 - the batches still end (with their errors)
            log.exception("the %s completion thread could not select %s; it goes on",
                          lane.direction.value, self.device)
        while (handle := lane.issued.get()) is not None:
            try:
                self._complete(lane, handle)
            except BaseException:  # noqa: BLE001 - later batches must still complete
                log.exception("the %s completion thread failed on batch %d; it goes on",
                              lane.direction.value, handle.batch.batch_id)

    def _complete(self, lane: _Lane, handle: BatchHandle) -> None:
        progress: _Progress = getattr(handle, _STATE)
        error = progress.error
        duration_s = 0.0
        completed = False

        def reached(layers: int) -> None:
            for callback in handle.mark_ready(layers):
                self.handoff.post(callback)  # per-layer readiness reaches the loop now

        try:
            # this thread waits for the copy (the loop never does), letting go of the GIL only
            # for a layer the device has not reached (event_waits.py)
            wait_in_order(handle.layer_events, reached)
            if progress.end is not None:
                wait_for(progress.end)
                if progress.start is not None:
                    duration_s = progress.start.elapsed_time(progress.end) / 1e3
            completed = True
        except BaseException as exc:  # noqa: BLE001 - a device fault fails this batch
            error = error or exc
        due = handle.finish(error, duration_s)
        try:
            self._recycle(lane, handle, progress, completed)
        except Exception:  # noqa: BLE001 - e.g. a sticky device error: the events are dropped
            log.exception("recycling the events of %s batch %d failed; they are dropped",
                          lane.direction.value, handle.batch.batch_id)
        finally:
            self._report(handle, due)  # the requests end whatever happened to the events

    def _recycle(self, lane: _Lane, handle: BatchHandle, progress: _Progress,
                 completed: bool) -> None:
        due: list[tuple[LayerProbe, tuple[bool, float]]] = []
        with progress.lock:
            progress.recycled = True
            probes, progress.probes = progress.probes, []
            for probe in probes:
                if probe.cancelled:
                    continue
                events = handle.layer_events
                event = events[probe.layer] if probe.layer < len(events) else progress.end
                result = verdict(probe.event, event) if completed else ON_TIME
                if probe.armed:
                    due.append((probe, result))
                else:
                    probe.verdict = result  # its wait_layer call picks it up
        for probe, result in due:
            call_classify(probe.classify, *result)
        if not completed:
            return  # state unknown after a device error: let these events go
        for probe in probes:
            if probe.event.query():  # recorded again only once complete
                self._probe_events.give(probe.event)
        for event in handle.layer_events:
            lane.layer_events.give(event)
        for event in (progress.start, progress.end):
            if event is not None:
                lane.timing_events.give(event)
