"""The engine contract shared by the CPU and CUDA backends.

* ``submit(batch) -> BatchHandle`` only enqueues: it never waits for a copy, so it is safe on
  the event-loop thread. Batches of one direction execute in submission order (one stream, or
  one worker thread playing one); D2H and H2D run concurrently.
* A batch starts after its ``deps`` (earlier batches: hazards) and its ``after`` (the caller's
  producer). Deps always point to earlier submissions, so waits cannot form a cycle.
* H2D readiness advances layer by layer (``BatchHandle.layers_ready``); D2H completes all layers.
* Completion is reported by posting ``on_batch_done(handle)`` to the loop hand-off, once per
  batch, after success or failure. A failed batch never stops the engine.
* ``close()`` drains: everything submitted before it completes, then the threads exit.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping

from ..errors import IndexTypeError
from ..kinds import Backend
from .batch import BatchHandle, CopyBatch
from .buffers import PoolBinding
from .handoff import LoopHandoff

#: Test seam: called with (batch, first_layer) before each layer group is copied.
FaultHook = Callable[[CopyBatch, int], None]


class TransferEngine(abc.ABC):
    """Moves page batches between device buffers and host arenas of the bound pools."""

    backend: Backend

    def __init__(self, bindings: Mapping[str, PoolBinding], handoff: LoopHandoff,
                 on_batch_done: Callable[[BatchHandle], None], *,
                 fault_hook: FaultHook | None = None) -> None:
        self.bindings = dict(bindings)
        self.num_layers = max(b.geometry.num_layers for b in self.bindings.values())
        self.handoff = handoff
        self.on_batch_done = on_batch_done
        self.fault_hook = fault_hook

    @abc.abstractmethod
    def submit(self, batch: CopyBatch) -> BatchHandle:
        """Enqueue ``batch``; returns at once with its handle. Never blocks on a copy."""

    @abc.abstractmethod
    def wait_layer(self, handle: BatchHandle, layer: int, timeout_s: float | None,
                   classify: Callable[[bool, float], None]) -> None:
        """Make the calling thread's consumer wait for ``layer`` of ``handle``.

        Blocks the calling (forward-pass) thread at most ``timeout_s`` in total (``None``: no
        limit), then raises ``TimeoutError`` and leaves the transfer running; raises
        ``TransferFailedError`` if the batch failed before the layer was ready. CPU: blocks
        until the layer is copied. CUDA: blocks only until the layer's copy is enqueued, then
        makes the caller's current stream wait on its event (GPU-side).

        ``classify(late, waited_s)`` is called exactly once for a call that returns, possibly
        later and from an engine thread, never for a call that raises: ``late`` is true only
        when the consumer actually waited for the copy (CPU: the calling thread blocked; CUDA:
        the current stream reached this point before the layer's event, decided from device
        timestamps), ``waited_s`` is how long. Never call it on the event-loop thread.
        """

    #: The engine producers ``normalize_after`` accepts, for error messages.
    producer_kinds: str = ""
    #: Whether waiting for an engine producer can fail a batch (a failed future, or a wait
    #: abandoned at close). The scheduler then gives each request with producers a batch of
    #: its own, so it fails alone.
    producer_waits_can_fail: bool = False
    #: Whether ``wait_layer`` makes the consumer's stream wait (GPU-side) rather than block the
    #: thread: then whether a layer was late is the device's verdict alone.
    waits_on_device: bool = False

    def defers_indices(self, tensor: object) -> bool:
        """Whether this engine reads a device index tensor that is not on the CPU itself, after
        the request's producers (device_indices.py). The service refuses such a tensor
        otherwise. CPU: never (every index tensor is read at submit, on the CPU)."""
        return False

    def stage_indices(self, tensor: object, producers: tuple[object, ...]
                      ) -> Callable[[], object]:
        """Queue a copy of ``tensor`` (a device index tensor this engine defers) into host
        memory after ``producers``; return a ``fetch()`` that blocks until it landed and returns
        the values (a 1-D CPU array). On the submitting thread; never blocks."""
        raise IndexTypeError(f"the {self.backend.value} engine reads every index tensor at "
                             f"submit; it stages none (defers_indices is false)")

    def capture_producer(self) -> object | None:
        """What every copy waits for besides ``after=``: the submitting thread's work so far.

        Call it on the thread that submits, before any hand-off to the loop. CPU: nothing (the
        caller's writes finished before it called). CUDA: an event recorded on the calling
        thread's current stream, so a backup follows the kernels that wrote its pages and a
        load follows the kernels still reading the pages it overwrites.
        """
        return None

    @abc.abstractmethod
    def normalize_after(self, after: object) -> object:
        """Check one caller-given engine producer and return what the engine waits for.

        Raises ``ArgumentTypeError`` (a ``TypeError``) for anything but ``producer_kinds``. On
        the submitting thread.
        """

    def drop_unstarted(self, handle: BatchHandle) -> None:
        """``handle``'s every request was cancelled (``skip_requested``): an engine that queues
        batches before taking them ends it now if it has not taken it yet, so its pages return
        without waiting for the batches ahead of it. Default: nothing (the batch is enqueued on
        a stream already, or the engine drops it when it reaches it). The loop's thread."""

    def abandon_waits(self) -> None:
        """Make batches still blocked on a dependency or a producer fail instead of waiting
        (close() after its drain timeout). Copies already running complete. Any thread."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drain submitted batches and stop. Blocks (run it off the loop)."""

    def _report(self, handle: BatchHandle, due: list[Callable[[], None]]) -> None:
        post = self.handoff.post
        for callback in due:
            post(callback)
        post(self.on_batch_done, handle)


def resolve_backend(backend: Backend) -> Backend:
    """``AUTO`` becomes CUDA when a device is available, else CPU."""
    if backend is Backend.AUTO:
        import torch

        return Backend.CUDA if torch.cuda.is_available() else Backend.CPU
    return backend
