"""The controller's layer counter, replaced: SGLang's ``LayerDoneCounter`` contract, with each
producer slot following one service prefetch layer by layer.

SGLang keeps a ring of 3 producer slots. ``start_loading`` takes the next one
(``update_producer``: SGLang's asserts the slot's last load finished; this one waits for the
service to have seen it end, see there), records its ``start_event`` on the scheduler
thread's stream, and submits the load with the slot's ``complete`` as ``on_layer_done``; the
transfer engine (engine.py) attaches the service's ``Transfer`` to that slot. A forward batch
names its slot (``set_consumer``) and the device pool's getters call ``wait_until(layer)``
before reading a layer: here that is
``Transfer.wait_layer(layer)``, a GPU-side wait of the current stream on the layer's copy on
CUDA (the CPU never blocks on the copy), a blocking wait for the copied layer on CPU.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ...completion.transfer import Transfer
from ...errors import ServiceClosedError, TransferFailedError
from .engine import fatal, raise_fatal, wait_then_fatal

NUM_SLOTS = 3  #: SGLang's ring of producer slots (LayerDoneCounter.num_counters)


class _StartEvent:
    """The slot's ``start_event`` on the CPU backend: SGLang records it; nothing waits on it."""

    def record(self, stream: object = None) -> None:  # noqa: ARG002 - event protocol
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _SlotFinish:
    """``events[i].finish_event``: done when the slot's load ended (``query`` never blocks)."""

    __slots__ = ("_slot",)

    def __init__(self, slot: LoadSlot) -> None:
        self._slot = slot

    def query(self) -> bool:
        transfer = self._slot.transfer
        if transfer is None:
            return True
        if not transfer.done():
            return False
        fatal(transfer, "a host-to-device load")
        return True

    def synchronize(self) -> None:
        transfer = self._slot.transfer
        if transfer is not None:
            wait_then_fatal(transfer, "a host-to-device load")


class LoadSlot:
    """One producer slot: SGLang's ``LayerLoadingEvent`` contract for one service prefetch."""

    def __init__(self, num_layers: int, cuda: bool) -> None:
        self._num_layers = num_layers
        self.start_event: Any = torch.cuda.Event() if cuda else _StartEvent()
        self.transfer: Transfer | None = None

    def attach(self, transfer: Transfer | None) -> None:
        """The engine's hand-over: this slot now follows ``transfer`` (None: an empty load)."""
        self.transfer = transfer

    def complete(self, layer_index: int) -> None:  # noqa: ARG002 - SGLang's engine calls it
        """SGLang's own engine marks layers here; the service's layers mark themselves."""
        return None

    def wait(self, layer_index: int) -> None:
        """Order the caller's work after ``layer_index`` of this slot's load (see module
        docstring). Forward thread."""
        transfer = self.transfer
        if transfer is None:
            return
        try:
            transfer.wait_layer(layer_index)
        except (TransferFailedError, ServiceClosedError, asyncio.CancelledError) as exc:
            raise_fatal(exc, f"a host-to-device load (layer {layer_index})")

    @property
    def finish_event(self) -> _SlotFinish:
        return _SlotFinish(self)


class ServiceLayerCounter:
    """Stands in for SGLang's ``LayerDoneCounter`` (same attributes and methods)."""

    def __init__(self, num_layers: int, cuda: bool) -> None:
        self.num_layers = num_layers
        self.num_counters = NUM_SLOTS
        self.events = [LoadSlot(num_layers, cuda) for _ in range(NUM_SLOTS)]
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self) -> int:
        """Take the next slot for a load. SGLang reuses a slot three loads later, after the
        forward pass that waited on every layer of its last load, so that copy has ended on
        the device; SGLang asserts its finish event. Here the slot is done when the service
        has seen the copy end, which can lag the device while the scheduler thread holds the
        GIL (the completion and loop threads need it): then this waits for that, briefly,
        instead of failing an assertion on one TP rank and not on the others. Raises as fatal
        if that load failed."""
        self.producer_index = (self.producer_index + 1) % self.num_counters
        finish = self.events[self.producer_index].finish_event
        if not finish.query():
            finish.synchronize()
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        """Before reading layer ``threshold``: wait for it in the consumer's load, if any."""
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(threshold)

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
