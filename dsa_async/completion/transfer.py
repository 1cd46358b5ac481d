"""The caller's handle on one request (``Transfer``): awaiting it, its layers, cancelling it.

A ``Transfer`` is what ``evict``/``prefetch`` return: awaitable for the whole result, with
per-layer readiness (``await t.layer_ready(i)`` on the loop, ``t.wait_layer(i)`` from a
forward-pass thread), ``cancel()`` and done callbacks. Cancelling a task that awaits a
``Transfer`` cancels neither the copy nor other waiters; ``t.cancel()`` cancels the request.
Threads without an event loop wait for the whole result with ``t.wait(timeout_s)`` or poll
``t.done()`` and then read ``t.result()`` / ``t.exception()``; none of these goes through the
loop.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Protocol

from ..errors import (
    ArgumentTypeError,
    ArgumentValueError,
    CopySkipped,
    ServiceClosedError,
    TransferFailedError,
    TransferNotDoneError,
    WrongThreadError,
    int_argument,
    shown,
    wait_bound_s,
)
from ..host_memory.pool import HostPages
from ..kinds import H2D, Direction, Timeliness
from ..scheduling.request import WAITER_LOCK, Request, report_unobserved
from .result import TransferResult

if TYPE_CHECKING:
    from ..transfer.batch import BatchHandle


class Owner(Protocol):
    """What a ``Transfer`` asks of the scheduler that owns its request (scheduler.py)."""

    num_layers: int

    def cancel(self, request: Request) -> bool: ...

    def check_loop_thread(self, call: str, instead: str) -> None: ...

    def layer_future(self, request: Request, layer: int) -> asyncio.Future: ...

    @property
    def waits_on_device(self) -> bool: ...

    def engine_wait_layer(self, handle: BatchHandle, layer: int, timeout_s: float | None,
                          classify: Callable[[bool, float], None]) -> None: ...

    def record_layers(self, timeliness: Timeliness, layers: int,
                      waited_s: float | None = None) -> None: ...


def _count_unseen_as_wasted(request: Request, record: Callable[[Timeliness, int], None]) -> None:
    """When a prefetch's Transfer is collected: the layers it loaded that nobody used are
    wasted; a prefetch still running is counted when it ends (by the scheduler)."""
    if not request.future.done():
        request.count_wasted_at_end = True
        return
    unseen = request.take_unseen_loaded_layers()
    if unseen:
        record(Timeliness.WASTED, unseen)


class Transfer:
    """The caller's handle on one request (see module docstring)."""

    __slots__ = ("_request", "_scheduler", "__weakref__")

    def __init__(self, request: Request, scheduler: Owner) -> None:
        self._request = request
        self._scheduler = scheduler
        if request.direction is H2D:
            weakref.finalize(self, _count_unseen_as_wasted, request, scheduler.record_layers)

    @property
    def direction(self) -> Direction:
        return self._request.direction

    @property
    def num_pages(self) -> int:
        return self._request.num_pages

    @property
    def host_pages(self) -> HostPages | None:
        """Where an eviction backs its pages up; ``None`` until host pages are allocated."""
        return self._request.host_handle

    def done(self) -> bool:
        return self._request.future.done()

    def cancelled(self) -> bool:
        return self._request.future.cancelled()

    def cancel(self) -> bool:
        """Cancel the request. Before its copy starts it is removed and its reservations return
        at once; after that the copy completes first (data is never torn), then they return.
        Returns ``False`` if it already finished. Loop thread only (``WrongThreadError``
        elsewhere: a thread calls it through ``service.call_threadsafe(transfer.cancel)``);
        does not block."""
        scheduler = self._scheduler
        scheduler.check_loop_thread("Transfer.cancel()",
                                    "call it through service.call_threadsafe(transfer.cancel)")
        return scheduler.cancel(self._request)

    def add_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(self)`` on the loop when the request ends (done, failed or cancelled).
        Loop thread only (``WrongThreadError`` elsewhere)."""
        self._scheduler.check_loop_thread(
            "Transfer.add_done_callback()",
            "call it through service.call_threadsafe(transfer.add_done_callback, fn), or "
            "wait with Transfer.wait()")
        self._request.observed = True  # the callback sees the outcome
        self._request.future.add_done_callback(lambda _f: fn(self))

    def exception(self) -> BaseException | None:
        """The error of a finished request, ``None`` if it succeeded (as ``Future.exception``;
        ``TransferNotDoneError`` before it ended). Any thread; does not block."""
        future = self._not_before_the_end("exception")
        self._request.observed = True
        return future.exception()

    def result(self) -> TransferResult:
        """The result of a finished request (raises as ``Future.result`` does;
        ``TransferNotDoneError`` before it ended). Any thread; does not block. Reading the
        outcome uses no layer: a consumer of a prefetch's layers awaits it, ``wait()``s for it
        or waits per layer (what ``prefetch_layers_total`` counts)."""
        future = self._not_before_the_end("result")
        self._request.observed = True
        return future.result()

    def _not_before_the_end(self, call: str) -> asyncio.Future:
        future = self._request.future
        if not future.done():
            request = self._request
            raise TransferNotDoneError(
                f"Transfer.{call}() of the {request.direction.value} of {request.num_pages} "
                f"pages: it has not ended yet; await it (on the loop), wait(timeout_s) (on a "
                f"thread), or poll done() first")
        return future

    def wait(self, timeout_s: float | None = None) -> TransferResult:
        """From a thread without an event loop: block that thread until the request ends, then
        return its result or raise its error (``asyncio.CancelledError`` if it was cancelled).

        The wait does not go through the loop: the loop sets a ``threading.Event`` when the
        request ends, made only if a thread waits. Past ``timeout_s`` (``None``: no bound),
        ``TimeoutError``; the request keeps running (an infinite ``timeout_s`` is no bound).
        Refused (``WrongThreadError``, a ``RuntimeError``) on a thread that runs an event loop,
        which it would block: there, ``await`` the transfer.
        """
        request = self._request
        bound_s = wait_bound_s(timeout_s)
        waited_s = 0.0
        if not request.future.done():
            if _runs_a_loop():
                raise WrongThreadError("Transfer.wait() blocks its thread, and this thread runs "
                                       "an event loop: await the transfer instead")
            waited_from = time.perf_counter()
            if not request.wait_ended(bound_s):
                if request.direction is H2D:
                    request.give_up_wait(None, time.perf_counter() - waited_from)
                raise TimeoutError(f"the {request.direction.value} of {request.num_pages} "
                                   f"pages did not end within {timeout_s} s (it keeps running)")
            waited_s = time.perf_counter() - waited_from
        if request.direction is H2D:  # its layers are used now: late if it had to wait
            self._classify_all(waited_s)
        return self.result()

    def __del__(self) -> None:
        # A failed transfer nobody looked at is reported once, by the service's logger (the
        # service's own futures never reach asyncio's "exception was never retrieved").
        request = self._request
        if request.observed:
            return
        future = request.future
        if not future.done():
            request.dropped = True  # reported when it ends, if it fails (Request.report_failure)
        elif not future.cancelled():
            error = future.exception()
            if error is not None:
                report_unobserved(request, error)

    def __await__(self) -> Generator[object, None, TransferResult]:
        request = self._request
        request.observed = True
        future = request.future
        prefetch = request.direction is H2D
        if not future.done():
            # A waiter of our own, resolved when the request ends: cancelling this task
            # cancels only the waiter, never the request or other waiters (like shield(),
            # without its extra loop hop).
            waiter = future.get_loop().create_future()
            if request.waiters is None:
                request.waiters = [waiter]
            else:
                request.waiters.append(waiter)
            waited_from = time.perf_counter()
            try:
                yield from waiter
            finally:
                request.waiters.remove(waiter)
                if prefetch:
                    waited_s = time.perf_counter() - waited_from
                    if future.done():
                        self._classify_all(waited_s)
                    else:  # this await was cancelled: whoever uses the layers waited this too
                        request.give_up_wait(None, waited_s)
        elif prefetch:
            self._classify_all(0.0)
        return future.result()

    # --- per-layer readiness ---------------------------------------------------------------

    async def layer_ready(self, layer: int) -> None:
        """Wait on the loop until ``layer`` of this prefetch is usable. Never blocks the loop.

        A prefetch of 0 pages loads nothing: each of its layers is ready at once, and it counts
        in no layer metric."""
        request = self._request
        layer = self._check_layer(layer)
        if request.num_pages == 0:
            return
        handle = request.handle
        if handle is not None and layer < handle.layers_ready:
            self._classify(layer, 0.0)
            return
        if request.future.done() and request.handle is None:
            request.observed = True
            request.future.result()  # raises: failed or cancelled before its copy started
        waited_from = time.perf_counter()
        try:
            # shield: cancelling this task must not cancel the service's layer future
            await asyncio.shield(self._scheduler.layer_future(request, layer))
        except TransferFailedError:
            request.observed = True
            raise
        except asyncio.CancelledError:  # e.g. asyncio.wait_for's timeout: counted when used
            request.give_up_wait(layer, time.perf_counter() - waited_from)
            raise
        self._classify(layer, time.perf_counter() - waited_from)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """From a forward-pass thread: wait until ``layer`` is usable by that thread's work.

        CPU backend: blocks the calling thread until the layer is copied. CUDA backend: blocks
        only until the layer's copy is enqueued, then makes the caller's current stream wait on
        the layer's event (no CPU block on the copy). ``timeout_s`` bounds the whole wait
        (until the copy is submitted, and then until the layer is copied or enqueued): past
        it, ``TimeoutError``, and the transfer keeps running. A prefetch of 0 pages loads
        nothing: it returns at once, counting no layer. Refused (``WrongThreadError``) on a
        thread that runs an event loop unless the layer is ready or the prefetch ended (it
        would block that loop, which may be the one that has to start the copy): there,
        ``await transfer.layer_ready(layer)``.
        """
        request = self._request
        layer = self._check_layer(layer)
        timeout_s = wait_bound_s(timeout_s)
        if request.num_pages == 0:
            return
        waited_from = time.perf_counter()
        started = request.started
        if not started and not request.future.done():
            _refuse_on_a_loop_thread(layer)
        if not started and not request.wait_started(timeout_s):
            self._give_up_layer(layer, waited_from)
            raise TimeoutError(f"layer {layer}: the prefetch's copy did not start within "
                               f"{timeout_s} s (it stays queued)")
        handle = request.handle
        if handle is None:  # it ended before its copy started: its own error says why
            self.result()  # raises it (CancelledError if it was cancelled)
            raise ServiceClosedError("the prefetch ended before its copy started")
        start_wait_s = 0.0 if started else time.perf_counter() - waited_from
        # CPU: this thread waited if it blocked at all, for the start or the copy. CUDA: only
        # the consumer's stream waiting counts, and the device decides (not this thread).
        host_wait_s = 0.0 if self._scheduler.waits_on_device else start_wait_s
        if layer < handle.layers_ready:  # already copied (on CUDA: its event completed)
            self._classify(layer, host_wait_s)
            return
        if request.future.done():  # it ended without this layer (also after close())
            self.result()  # raises its error
        _refuse_on_a_loop_thread(layer)
        remaining_s = None if timeout_s is None else max(0.0, timeout_s - start_wait_s)

        def classify(late: bool, waited_s: float) -> None:
            self._classify(layer, host_wait_s + waited_s if late else host_wait_s)

        try:
            if not self._scheduler.engine_wait_layer(handle, layer, remaining_s, classify):
                # close() ended every copy since the checks above: as if it had ended first
                if layer < handle.layers_ready:
                    self._classify(layer, host_wait_s)
                    return
                self.result()  # raises its error
                raise ServiceClosedError(f"layer {layer}: the service closed before the "
                                         f"prefetch copied it")
        except TimeoutError:
            self._give_up_layer(layer, waited_from)
            raise TimeoutError(f"layer {layer} was not ready within {timeout_s} s (the "
                               f"prefetch keeps running)") from None
        except TransferFailedError:
            request.observed = True
            if request.cancel_requested and isinstance(handle.error, CopySkipped):
                raise asyncio.CancelledError(  # cancelled: its copy was dropped unstarted
                    "the prefetch was cancelled before its copy started") from None
            raise

    def _check_layer(self, layer: object) -> int:
        """``layer`` as an int (any integer type but bool), checked against the layer count."""
        if self._request.direction is not H2D:
            raise ArgumentTypeError("per-layer readiness belongs to prefetches; this Transfer "
                                    "is an eviction: await it instead")
        layers = self._scheduler.num_layers
        index = int_argument("layer", layer)
        if not 0 <= index < layers:
            raise ArgumentValueError(f"layer {shown(index)} is out of range: this service has "
                                     f"{layers} layers (0..{layers - 1})")
        return index

    def _give_up_layer(self, layer: int, waited_from: float) -> None:
        """``wait_layer`` stopped waiting for ``layer``: carry the time, unless the engine
        rules on lateness on the device (a blocking wait there does not count its host time
        either)."""
        if not self._scheduler.waits_on_device:
            self._request.give_up_wait(layer, time.perf_counter() - waited_from)

    def _classify(self, layer: int, waited_s: float) -> None:
        """Count ``layer`` once as on time or late, its wait including the waits consumers
        gave up on before (``Request.give_up_wait``), each observed once. Any thread
        (metrics are thread-safe)."""
        request = self._request
        with WAITER_LOCK:
            if request.layer_seen is None:
                request.layer_seen = bytearray(self._scheduler.num_layers)
            if request.layer_seen[layer]:
                return
            request.layer_seen[layer] = 1
            given_up_s, late = request.take_given_up((layer,))
        waited_s += given_up_s
        if waited_s > 0.0:
            self._scheduler.record_layers(Timeliness.LATE, 1, waited_s)
        elif late:  # its consumer gave up on it before; that wait was observed already
            self._scheduler.record_layers(Timeliness.LATE, 1)
        else:
            self._scheduler.record_layers(Timeliness.ON_TIME, 1)

    def _classify_all(self, waited_s: float) -> None:
        request = self._request
        future = request.future
        if not future.done() or future.cancelled() or future.exception() is not None:
            return
        if request.num_pages == 0:  # it loaded no layer: nothing to count
            return
        with WAITER_LOCK:
            seen = request.layer_seen
            if seen is None:
                seen = request.layer_seen = bytearray(self._scheduler.num_layers)
            unseen = seen.count(0)
            own = request.given_up_layer_s
            # the layers not used yet that a consumer gave up on alone (rarely any)
            alone = [layer for layer in own if not seen[layer]] if own else ()
            all_late = waited_s > 0.0 or request.gave_up_on_all
            given_up_s, _ = request.take_given_up(alone)
            seen[:] = b"\x01" * len(seen)
        if not unseen:
            return
        waited_s += given_up_s
        record = self._scheduler.record_layers
        # late: all of them when this wait (or one for the whole prefetch given up on) found
        # them not ready, else the layers a consumer gave up on alone; one observation of the
        # waits for all of them, as a blocking wait for the whole prefetch makes
        late = unseen if all_late else len(alone)
        if late:
            record(Timeliness.LATE, late, waited_s if waited_s > 0.0 else None)
        if unseen - late:
            record(Timeliness.ON_TIME, unseen - late)

    def __repr__(self) -> str:
        r = self._request
        return (f"Transfer({r.direction.value}, pages={r.num_pages}, state={r.state.value}, "
                f"done={r.future.done()})")


def _refuse_on_a_loop_thread(layer: int) -> None:
    if _runs_a_loop():
        raise WrongThreadError(f"Transfer.wait_layer({layer}) would block its thread, and this "
                               f"thread runs an event loop: await transfer.layer_ready({layer}) "
                               f"instead")


def _runs_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
