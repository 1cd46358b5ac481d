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
    def wait_layer(self, handle: BatchHandle, layer: int) -> None:
        """Make the calling thread's consumer wait for ``layer`` of ``handle``.

        CPU: blocks the calling thread until the layer is copied. CUDA: blocks only until the
        layer's copy is enqueued, then makes the caller's current stream wait on its event.
        Never call it on the event-loop thread.
        """

    def capture_producer(self) -> object | None:
        """What a backup must wait for when the caller names no producer (loop thread).

        CPU: nothing (the caller's writes finished before it called). CUDA: an event recorded
        on the caller's current stream, so the backup follows the kernels that wrote the pages.
        """
        return None

    def normalize_after(self, after: object) -> object:
        """Check a caller-given producer; CPU accepts objects with a blocking ``wait()``."""
        if not callable(getattr(after, "wait", None)):
            raise TypeError(
                f"after={after!r} is not a producer this backend can wait for; on the CPU "
                f"backend pass an object with a wait() method (e.g. threading.Event) or a Transfer"
            )
        return after

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
