"""What one engine submission carries (``CopyBatch``) and how its progress is seen (``BatchHandle``).

A batch moves the same page pairs in every pool that shares the page table. The service builds
batches; an engine executes them in submission order per direction (a stream, or a worker thread
playing one) and reports progress through the handle: per-layer readiness, completion, error and
the copy's duration.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import TransferFailedError
from ..kinds import Direction

if TYPE_CHECKING:
    from ..paging.device_indices import DeviceIndices

_batch_ids = itertools.count(1)


@dataclass(frozen=True)
class Dependency:
    """Start only after ``handle`` completes; ``needs_data``: fail too if it failed (RAW)."""

    handle: BatchHandle
    needs_data: bool


@dataclass(frozen=True, init=False)
class CopyBatch:
    """Page pairs to move in one direction (``host_pages``/``device_pages``: ``int64 [n]``).

    ``after`` holds the callers' producers to wait for (events or streams on CUDA, objects with
    a blocking ``wait()`` such as ``threading.Event`` on CPU); ``deps`` are earlier batches this
    one must follow (hazards). ``device_indices``: the device pages are not known yet (a
    device index tensor on the GPU, device_indices.py): the engine resolves them on its issue
    thread, after the producers (:meth:`resolve_device_pages`), and ``device_pages`` is empty.
    The page arrays are read-only: a batch of one long request shares its array with that
    request (``paging.runs.PageList``), and engines only read them.
    """

    direction: Direction
    host_pages: np.ndarray
    device_pages: np.ndarray
    deps: tuple[Dependency, ...] = ()
    after: tuple[object, ...] = ()
    batch_id: int = 0  #: unique in the process; given at construction
    device_indices: DeviceIndices | None = None

    def __init__(self, direction: Direction, host_pages: np.ndarray, device_pages: np.ndarray,
                 deps: tuple[Dependency, ...] = (), after: tuple[object, ...] = (),
                 batch_id: int | None = None, device_indices: DeviceIndices | None = None
                 ) -> None:
        # One batch per loop tick, on a single request's path: plain stores into the instance
        # dict instead of the generated frozen __init__'s object.__setattr__ calls.
        fields = self.__dict__
        fields["direction"] = direction
        fields["host_pages"] = host_pages
        fields["device_pages"] = device_pages
        fields["deps"] = deps
        fields["after"] = after
        fields["batch_id"] = next(_batch_ids) if batch_id is None else batch_id
        fields["device_indices"] = device_indices

    def resolve_device_pages(self) -> np.ndarray:
        """The device pages to copy: ``device_pages``, or those of ``device_indices`` (blocks
        until their staged copy landed, then checks them: engine issue thread only; raises
        ``IndexValueError`` for bad values, which fails this batch alone)."""
        if self.device_indices is None:
            return self.device_pages
        pages = self.device_indices.resolve()
        assert pages.size == self.host_pages.size, "the page count is checked at submit"
        return pages

    @property
    def num_pages(self) -> int:
        return int(self.host_pages.size)


class BatchHandle:
    """Progress of one batch, shared between the engine's threads and the loop.

    ``layers_ready``: leading layers whose copy completed; ``layers_issued``: leading layers
    whose copy was enqueued (equal to ``layers_ready`` on CPU; ahead of it on CUDA, where each
    issued layer has an event in ``layer_events``). ``done`` (an Event-like view of ``finished``)
    is set once, after success or error.
    """

    def __init__(self, batch: CopyBatch, num_layers: int) -> None:
        self.batch = batch
        self.num_layers = num_layers
        self.layers_ready = 0
        self.layers_issued = 0
        self.layer_events: list[object] = []
        self.error: BaseException | None = None
        self.duration_s = 0.0
        self.finished = False  #: set once, after success or error (see ``done``)
        #: every request of the batch was cancelled: an engine that has not started its copy
        #: yet may drop it (set on the loop, read by the engine; a plain flag)
        self.skip_requested = False
        self._started = False  #: the engine took it (:meth:`claim_start`)
        # One plain lock guards the state. A blocked thread parks on a lock of its own, listed
        # with what it waits for, and is woken only once that happened: a thread waiting for
        # the whole batch (or for a late layer) is not woken by every earlier layer, which on
        # a loaded machine takes CPU from the copy itself.
        self._lock = threading.Lock()
        self._thread_waiters: list[_ThreadWaiter] = []
        self._layer_waiters: list[tuple[int, Callable[[], None]]] = []

    @property
    def done(self) -> _Done:
        """An Event-like view of ``finished`` (``is_set()``, ``wait(timeout)``); made on each
        access, so the handle is never in a reference cycle with it."""
        return _Done(self)

    def _wake_reached(self) -> None:
        """Wake the blocked threads whose condition now holds. Call with ``_lock`` held."""
        if not self._thread_waiters:
            return
        still = []
        for waiter in self._thread_waiters:
            if waiter.reached(self):
                waiter.parked.release()
            else:
                still.append(waiter)
        self._thread_waiters = still

    # --- engine side ----------------------------------------------------------------------

    def mark_issued(self, layers: int) -> None:
        with self._lock:
            self.layers_issued = layers
            self._wake_reached()

    def mark_ready(self, layers: int) -> list[Callable[[], None]]:
        """Advance readiness; returns the loop callbacks now due (the engine hands them off)."""
        with self._lock:
            self.layers_ready = layers
            self.layers_issued = max(self.layers_issued, layers)
            due: list[Callable[[], None]] = []
            if self._layer_waiters:
                ready = sorted((w for w in self._layer_waiters if w[0] < layers),
                               key=lambda w: w[0])
                due = [cb for _, cb in ready]  # in layer order, even when a group lands at once
                self._layer_waiters = [(i, cb) for i, cb in self._layer_waiters if i >= layers]
            self._wake_reached()
        return due

    def claim_start(self) -> bool:
        """The engine takes the batch to copy it: ``False`` when it already ended unstarted
        (:meth:`end_unstarted`), so the engine drops it. Any thread."""
        with self._lock:
            if self.finished:
                return False
            self._started = True
            return True

    def end_unstarted(self, error: BaseException) -> list[Callable[[], None]] | None:
        """End a batch the engine has not taken yet (every request cancelled while it still
        queued behind others): its pending loop callbacks, or ``None`` when the engine took it
        first (it then ends as its copy does). Any thread."""
        with self._lock:
            if self._started or self.finished:
                return None
            return self._finish(error, 0.0)

    def finish(self, error: BaseException | None, duration_s: float) -> list[Callable[[], None]]:
        """Record the outcome and set ``done``; returns every pending loop callback."""
        with self._lock:
            return self._finish(error, duration_s)

    def _finish(self, error: BaseException | None, duration_s: float
                ) -> list[Callable[[], None]]:
        self.error = error
        self.duration_s = duration_s
        if error is None:
            self.layers_ready = self.layers_issued = self.num_layers
        due = [cb for _, cb in self._layer_waiters]
        self._layer_waiters = []
        self.finished = True
        self._wake_reached()
        return due

    # --- waiter side ----------------------------------------------------------------------

    def on_layer_ready(self, layer: int, callback: Callable[[], None]) -> bool:
        """Register ``callback`` for when ``layer`` is ready (or the batch fails).

        Returns ``False`` (and registers nothing) if that already happened: call it yourself.
        """
        with self._lock:
            if layer < self.layers_ready or self.finished:
                return False
            self._layer_waiters.append((layer, callback))
            return True

    def wait_issued(self, layer: int, timeout_s: float | None = None) -> None:
        """Block the calling thread until ``layer`` was issued; raise if the batch failed."""
        self._wait_until(_Progress.ISSUED, layer, timeout_s)

    def wait_ready(self, layer: int, timeout_s: float | None = None) -> None:
        """Block the calling thread until ``layer`` is ready; raise if the batch failed."""
        self._wait_until(_Progress.READY, layer, timeout_s)

    def wait_finished(self, timeout_s: float | None) -> bool:
        """Block the calling thread until the batch finished (success or error); ``False`` if
        ``timeout_s`` passed first. Woken once, when it finishes."""
        return self._park(_ThreadWaiter(_Progress.FINISHED, self.num_layers), timeout_s)

    def _park(self, waiter: _ThreadWaiter, timeout_s: float | None) -> bool:
        """Block until ``waiter``'s condition holds or the timeout passes; true if it holds."""
        with self._lock:
            if waiter.reached(self):
                return True
            waiter.parked.acquire()  # held until a notifier releases it
            self._thread_waiters.append(waiter)
        woken = waiter.parked.acquire(True, -1 if timeout_s is None else max(0.0, timeout_s))
        if woken:
            return True
        with self._lock:  # timed out: leave the list, unless a notifier just took us off it
            if waiter in self._thread_waiters:
                self._thread_waiters.remove(waiter)
            return waiter.reached(self)

    def _wait_until(self, progress: _Progress, layer: int, timeout_s: float | None) -> None:
        ok = self._park(_ThreadWaiter(progress, layer + 1), timeout_s)
        self.raise_if_failed(layer)
        if not ok:
            raise TimeoutError(f"layer {layer} of batch {self.batch.batch_id} not "
                               f"{progress.value} in time")

    def raise_if_failed(self, layer: int) -> None:
        """Raise ``TransferFailedError`` if the batch failed before ``layer`` was ready. Any
        thread (reads fields the engine set before it finished the batch)."""
        if self.error is not None and self.layers_ready <= layer:
            raise TransferFailedError(
                f"{self.batch.direction.value} batch {self.batch.batch_id} failed before "
                f"layer {layer} was ready: {self.error!r}"
            ) from self.error


class _Done:
    """``handle.done``: the batch finished (success or error), with ``threading.Event``'s
    ``is_set()`` and ``wait(timeout)``; set by the engine through :meth:`BatchHandle.finish`."""

    __slots__ = ("_handle",)

    def __init__(self, handle: BatchHandle) -> None:
        self._handle = handle

    def is_set(self) -> bool:
        return self._handle.finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the batch finished; ``False`` on timeout."""
        handle = self._handle
        if handle.finished:
            return True
        return handle.wait_finished(timeout)


class _Progress(enum.Enum):
    """What a blocked thread waits for."""

    ISSUED = "issued"  #: ``layers_issued`` reaches the count
    READY = "ready"  #: ``layers_ready`` reaches the count
    FINISHED = "finished"  #: the batch finished


class _ThreadWaiter:
    """One blocked thread: what it waits for and the lock it is parked on."""

    __slots__ = ("layers", "parked", "progress")

    def __init__(self, progress: _Progress, layers: int) -> None:
        self.progress = progress
        self.layers = layers
        self.parked = threading.Lock()

    def reached(self, handle: BatchHandle) -> bool:
        """Whether the wait is over: its count reached, or the batch finished (success or
        error: the waiter then reads the outcome). Read with the handle's lock held."""
        if handle.finished:
            return True
        if self.progress is _Progress.READY:
            return handle.layers_ready >= self.layers
        if self.progress is _Progress.ISSUED:
            return handle.layers_issued >= self.layers
        return False
