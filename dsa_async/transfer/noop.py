"""An engine that moves no bytes: completes every batch at once, on the loop.

It isolates the cost of the front door and the scheduler (validation, padding, page states,
hazards, batching, metrics) for ``dsa-async bench``; never use it to serve.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ArgumentTypeError
from ..kinds import Backend
from .base import TransferEngine
from .batch import BatchHandle, CopyBatch


class NoopEngine(TransferEngine):
    backend = Backend.CPU

    def submit(self, batch: CopyBatch) -> BatchHandle:
        handle = BatchHandle(batch, self.num_layers)
        self._report(handle, handle.finish(None, 0.0))
        return handle

    def normalize_after(self, after: object) -> object:
        raise ArgumentTypeError(f"after={after!r}: the no-op engine waits for no producer")

    def wait_layer(self, handle: BatchHandle, layer: int, timeout_s: float | None,
                   classify: Callable[[bool, float], None]) -> None:
        handle.wait_ready(layer, timeout_s)
        classify(False, 0.0)

    def close(self) -> None:
        return None
