"""The controller's transfer engine, replaced: SGLang's device↔host submissions as service requests.

``HybridCacheController.start_writing`` / ``start_loading`` (and ``backup_kv_cache`` /
``restore_kv_cache``) call ``submit_device_to_host(transfers)`` and
``submit_host_to_device(transfers, transfer_layer_id_max=, start_event=, on_layer_done=)`` on the
scheduler thread, which has no event loop. Each call becomes one request through the service's
thread submission path (``evict_threadsafe`` / ``prefetch_threadsafe``): validated and captured
on the scheduler thread, handed to the loop in batches, never a round trip per call. One
request moves the page pairs in every pool the service holds (MLA KV and DSA indexer), which is
what SGLang's list of transfers asks for: the indexer rides on the KV host slots with the same
indices.

Fences: the controller makes ``device_to_host_stream`` / ``host_to_device_stream`` wait on the
forward stream before it submits (``wait_stream``); here that stream becomes a producer of the
next copy in that direction. The scheduler thread's current stream (captured at submit) and the
load's ``start_event`` are producers too. On the CPU backend every producer has finished by the
time the scheduler thread submits, so only the GPU forms are passed on. Device indices are read
after the scheduler thread's current stream alone (``_INDICES_AFTER``).

Completions offer ``query()``, ``synchronize()`` and ``elapsed_time()``. A copy that failed is
fatal and loud: ``query()`` and ``synchronize()`` raise ``TransferFailedError`` (the cause
attached) and log it, on every rank that sees it. SGLang has no per-request abort on this path
and all-reduces acks over TP ranks, so a silent failure would let the ranks diverge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from ...completion.transfer import Transfer
from ...errors import TransferFailedError

log = logging.getLogger(__name__)


#: What SGLang's device indices wait for besides the scheduler thread's current stream (where
#: its allocator made them, after ``start_event`` too): nothing. The fences in ``after=`` (the
#: forward stream) order the copy only; were the indices read after them, the engine could
#: not issue a load until the previous forward pass ended, and ``wait_until`` in the next one
#: would hold the scheduler thread until then. SGLang 0.5.23 itself makes its schedule stream
#: wait for the whole previous pass after a prefill (``_apply_war_barrier`` without a finer
#: event), so there the load still waits for it; after a decode replayed from a CUDA graph
#: (which publishes an earlier event) it no longer does.
_INDICES_AFTER = ()


class TransferCompletion(NamedTuple):
    """What SGLang's ``L2TransferEngine`` returns: two events and whether they time."""

    start_event: Any
    finish_event: Any
    timing_enabled: bool


def fatal(transfer: Transfer, what: str) -> None:
    """Raise (and log) a failed copy: SGLang cannot abort one request on this path."""
    if transfer.cancelled():
        error: BaseException | None = TransferFailedError("cancelled: the service closed "
                                                          "before this copy ran")
    else:
        error = transfer.exception()
    if error is not None:
        raise_fatal(error, what)


def wait_then_fatal(transfer: Transfer, what: str) -> None:
    """Block the calling thread until the copy ended, then raise as :func:`fatal` does if it
    failed. A wait that itself fails before the copy ended (a wrong thread...) is raised as
    fatal with its own cause, not hidden behind the copy's "not done yet"."""
    try:
        transfer.wait()
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - reported below
        if not transfer.done():
            raise_fatal(exc, what)
    fatal(transfer, what)


def raise_fatal(error: BaseException, what: str) -> NoReturn:
    """Log ``error`` of ``what`` as critical and raise it as a ``TransferFailedError``."""
    log.critical("dsa_async: %s failed; SGLang has no per-request abort here and the TP ranks "
                 "must agree, so this is fatal: %r", what, error)
    raise TransferFailedError(f"dsa_async: {what} failed (fatal for this SGLang "
                              f"process): {error!r}") from error


class _Mark:
    """A completion event for one Transfer (start or finish); ``query()``/``synchronize()``
    block as a device event would: ``synchronize()`` blocks the calling thread until the copy
    ended, ``query()`` never blocks."""

    __slots__ = ("_transfer", "_what")

    def __init__(self, transfer: Transfer | None, what: str) -> None:
        self._transfer = transfer
        self._what = what

    def query(self) -> bool:
        transfer = self._transfer
        if transfer is None:
            return True
        if not transfer.done():
            return False
        fatal(transfer, self._what)
        return True

    def synchronize(self) -> None:
        if self._transfer is not None:
            wait_then_fatal(self._transfer, self._what)

    def elapsed_time(self, end: _Mark) -> float:
        """Milliseconds the copy took on the device (the service's batch timing); 0 before it
        ended. A copy that failed or was cancelled raises as :meth:`query` does."""
        mark = end if end._transfer is not None else self
        transfer = mark._transfer
        if transfer is None or not transfer.done():
            return 0.0
        fatal(transfer, mark._what)
        return transfer.result().device_s * 1e3

    def record(self, stream: object = None) -> None:  # noqa: ARG002 - event protocol
        """A no-op: the copy, not the caller, decides when this mark completes."""


def done_completion() -> TransferCompletion:
    """The completion of an empty submission (nothing to move): done at once."""
    return TransferCompletion(_Mark(None, "nothing"), _Mark(None, "nothing"), False)


class FenceStream:
    """``device_to_host_stream`` / ``host_to_device_stream``: what the controller orders the
    next copy after (``wait_stream``). On CUDA the streams it names become producers of the
    next submission in this direction; on CPU they are already done."""

    __slots__ = ("_cuda", "_pending")

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._pending: list[object] = []

    def wait_stream(self, stream: object) -> None:
        if self._cuda and isinstance(stream, torch.cuda.Stream):
            self._pending.append(stream)

    def wait_event(self, event: object) -> None:
        if self._cuda and isinstance(event, torch.cuda.Event):
            self._pending.append(event)

    def take(self) -> list[object]:
        pending, self._pending = self._pending, []
        return pending


class ServiceTransferEngine:
    """Stands in for SGLang's ``L2TransferEngine`` (see module docstring). Scheduler thread."""

    def __init__(self, service: Any, *, kv_host_pool: Any, indexer_host_pool: Any,
                 cuda: bool, on_submit: Callable[[float], None] | None = None) -> None:
        self.service = service
        self.io_backend = "dsa_async"
        self.device_to_host_stream = FenceStream(cuda)
        self.host_to_device_stream = FenceStream(cuda)
        self._cuda = cuda
        self._pools = {id(kv_host_pool): "kv", id(indexer_host_pool): "indexer"}
        self._kv_host_pool = kv_host_pool
        #: test and bench seam: called with the seconds each submission spent here
        self.on_submit = on_submit
        self._identity_mappers: set[int] = set()
        self._mappers_seen: list[object] = []

    def submit_device_to_host(self, transfers: Sequence[Any]) -> TransferCompletion:
        """Back up the transfers' pages (every layer, every pool). Does not block."""
        started = time.perf_counter()
        indices = self._indices(transfers)
        if indices is None:
            return done_completion()
        host, device = indices
        after = self.device_to_host_stream.take()
        transfer = self.service.evict_threadsafe(device, host_tokens=host, after=after or None,
                                                 indices_after=_INDICES_AFTER)
        return self._completion(transfer, "a device-to-host backup", started)

    def submit_host_to_device(self, transfers: Sequence[Any], *, transfer_layer_id_max: int,
                              start_event: object = None,
                              on_layer_done: Callable[[int], None] | None = None
                              ) -> TransferCompletion:
        """Load the transfers' pages, layer by layer. ``on_layer_done`` is the layer counter's
        slot (layer_counter.py), which then follows this transfer's layers. Does not block."""
        started = time.perf_counter()
        if transfer_layer_id_max != self.service.num_layers:
            raise ValueError(f"dsa_async: SGLang asked to load {transfer_layer_id_max} layers; "
                             f"the service holds {self.service.num_layers}")
        slot = getattr(on_layer_done, "__self__", None)
        indices = self._indices(transfers)
        if indices is None:
            if slot is not None and hasattr(slot, "attach"):
                slot.attach(None)
            return done_completion()
        host, device = indices
        after = self.host_to_device_stream.take()
        if self._cuda and isinstance(start_event, torch.cuda.Event):
            after.append(start_event)
        transfer = self.service.prefetch_threadsafe(None, device, host_tokens=host,
                                                    after=after or None,
                                                    indices_after=_INDICES_AFTER)
        if slot is not None and hasattr(slot, "attach"):
            slot.attach(transfer)
        return self._completion(transfer, "a host-to-device load", started)

    def _maps_layers_to_themselves(self, mapper: Callable[[int], int | None] | None) -> bool:
        """Whether a transfer's layer mapper is the identity on the service's layers (SGLang
        gives the indexer one even when it owns every layer); checked once per mapper."""
        if mapper is None or id(mapper) in self._identity_mappers:
            return True
        if all(mapper(layer) == layer for layer in range(self.service.num_layers)):
            self._identity_mappers.add(id(mapper))
            self._mappers_seen.append(mapper)  # keeps the id valid
            return True
        return False

    def _completion(self, transfer: Transfer, what: str, started: float) -> TransferCompletion:
        if self.on_submit is not None:
            self.on_submit(time.perf_counter() - started)
        return TransferCompletion(_Mark(transfer, what), _Mark(transfer, what), True)

    def _indices(self, transfers: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The one (host, device) index pair of a list of transfers: the KV anchor's, which
        every other transfer of the list (the indexer) shares. ``None``: nothing to move."""
        if not transfers:
            return None
        anchor = transfers[0]
        if anchor.host_pool is not self._kv_host_pool:
            raise ValueError("dsa_async: the first transfer is not the MLA KV host pool's; "
                             "this SGLang build orders transfers differently than 0.5.23")
        for transfer in transfers[1:]:
            if id(transfer.host_pool) not in self._pools:
                raise ValueError(f"dsa_async: a transfer for {type(transfer.host_pool).__name__},"
                                 f" which the service does not hold")
            if getattr(transfer, "is_draft", False) or not self._maps_layers_to_themselves(
                    getattr(transfer, "layer_mapper", None)):
                raise ValueError("dsa_async: draft transfers, and transfers whose layers map "
                                 "to other device layers, are not served")
            if not _same_indices(transfer, anchor):
                raise ValueError("dsa_async: the indexer's indices differ from the KV "
                                 "anchor's; the service moves both pools with one index pair")
        host = anchor.host_indices
        if host.device.type != "cpu":  # never here: the plug-in keeps host indices on the CPU
            host = host.cpu()
        if host.numel() == 0:
            return None
        return host, anchor.device_indices


def _same_indices(transfer: Any, anchor: Any) -> bool:
    for mine, theirs in ((transfer.host_indices, anchor.host_indices),
                         (transfer.device_indices, anchor.device_indices)):
        if mine is theirs:
            continue
        if (mine.shape, mine.dtype, mine.device) != (theirs.shape, theirs.dtype, theirs.device):
            return False
        if mine.device.type == "cpu" and not torch.equal(mine, theirs):
            return False
        # GPU indices are not compared: that would block the scheduler thread on the GPU.
        # SGLang builds every pool's indices of an operation from the same values; merged
        # operations concatenate them per pool, into separate tensors of equal values.
    return True
