"""The asyncio core: admission, per-tick batching, backpressure, hazards, completion.

Everything here runs on the event-loop thread and never blocks: requests are queued, one flush
per loop tick packs the ready ones into as few engine batches as possible (prefetches first,
by deadline then priority, so backups never starve loads), within the in-flight byte bound of
each direction. Completions arrive through the engine's hand-off and resolve the futures.
Every path that ends a request goes through :meth:`Scheduler.finish`, which returns what the
request held: its page-state entries (which also keep its host pages from being released),
host pages it allocated (unless it succeeded), in-flight bytes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable

from ..completion.result import TransferResult
from ..config import ServiceConfig
from ..errors import (
    CopyNotRunError,
    CopySkipped,
    HostPoolExhausted,
    ServiceClosedError,
    TransferFailedError,
    UnknownHostPagesError,
    WrongThreadError,
)
from ..host_memory.pool import HostPages, HostPool
from ..kinds import CANCELLED, D2H, DONE, FAILED, H2D, Direction, Outcome, Timeliness
from ..observability.metrics import ServiceMetrics
from ..paging.runs import PageSeq, concat_pages
from ..transfer.base import TransferEngine
from ..transfer.batch import BatchHandle, CopyBatch, Dependency
from .hazards import HazardTable
from .liveness import check_liveness
from .loop_producers import LoopProducerWatches
from .orphans import Orphans
from .request import FINISHED, QUEUED, SUBMITTED, Request, report_unobserved

log = logging.getLogger("dsa_async.scheduler")  # the logger name operators configure

HostPressureCallback = Callable[[int], object]

#: State gauges are refreshed at most this often on the hot path (scrapes are seconds apart).
PUBLISH_PERIOD_S = 0.05


def _services_own(handle: HostPages) -> UnknownHostPagesError:
    return UnknownHostPagesError(
        f"{handle!r} holds host pages the service frees itself once no copy uses them (an "
        f"eviction it placed that was cancelled or failed, or pages already released while "
        f"copies used them): drop the handle instead of releasing it")


class Scheduler:
    def __init__(self, config: ServiceConfig, pool: HostPool, engine: TransferEngine,
                 metrics: ServiceMetrics, loop: asyncio.AbstractEventLoop,
                 on_host_pressure: HostPressureCallback | None) -> None:
        self.config = config
        self.pool = pool
        self.engine = engine
        self._waits_on_device = engine.waits_on_device  # read by threads, also after detach()
        self.metrics = metrics
        self.loop = loop
        #: the loop's thread (made there): loop-only calls from another thread are refused
        self.loop_thread_id = threading.get_ident()
        self.on_host_pressure = on_host_pressure
        self.num_layers = config.num_layers
        self.bytes_per_page = pool.bytes_per_page
        self.bytes_per_token = sum(g.bytes_per_token for g in config.geometries)
        self.max_inflight_bytes = {D2H: config.max_inflight_bytes_d2h,
                                   H2D: config.max_inflight_bytes_h2d}
        self.queues: dict[Direction, list[Request]] = {d: [] for d in Direction}
        self._queue_sorted = {d: True for d in Direction}  # appended in order: no sort needed
        self.inflight_bytes = {d: 0 for d in Direction}
        #: requests handed to the engine and not ended, per direction
        self.inflight_requests_in = {d: 0 for d in Direction}
        self.hazards = HazardTable(pool.capacity_pages)
        self._batches: dict[BatchHandle, list[Request]] = {}
        self._host_wait_since: dict[Request, float] = {}
        #: backups that lacked host pages, now held for another reason: seconds they waited for
        #: pages so far (their host-wait clock is paused, and resumes from there)
        self._host_waited_s: dict[Request, float] = {}
        self._pending_layers: dict[Request, list[tuple[int, asyncio.Future]]] = {}
        #: requests held on the loop until their asyncio producers end
        self._loop_watches = LoopProducerWatches(self.schedule_flush, self._fail_for_producer)
        #: host pages to free once the copies still using them end (not the caller's to release)
        self._orphans = Orphans(self.hazards)
        self._pressure_tasks: set[asyncio.Task] = set()
        #: host pages the last pass over the backups lacked (the flush asks the hook for them)
        self._host_shortage_pages = 0
        #: (pages needed, pool.changes) when the hook was last called for the current shortage
        self._asked_for: tuple[int, int] | None = None
        self._flush_handle: asyncio.Handle | None = None
        self._expiry_handle: asyncio.TimerHandle | None = None
        #: loop time the armed expiry timer fires at (uvloop's handle for a time due within
        #: about a millisecond is a plain Handle, which has no ``when()``)
        self._expiry_at_s = math.inf
        self._published_at = -math.inf
        self._publish_handle: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: close() is draining: a backup short of host pages ends at once (nothing frees pages
        #: for it now, and the hook is not asked), whenever it comes to need them
        self._closing = False

    # --- admission ------------------------------------------------------------------------

    @property
    def queued_requests(self) -> int:
        return len(self.queues[D2H]) + len(self.queues[H2D])

    @property
    def inflight_requests(self) -> int:
        """Requests handed to the engine and not ended, both directions."""
        return sum(self.inflight_requests_in.values())

    def accept(self, request: Request, loop_producers: tuple[object, ...] = ()) -> None:
        """Queue an admitted request (validated by the service). Does not block.

        ``loop_producers`` (asyncio futures and events, see producers.py) keep it queued until
        each has finished; one that fails or is cancelled fails the request."""
        self.hazards.admit(request)  # also marks its host pages in use until it ends
        queue = self.queues[request.direction]
        if queue and request.goes_before(queue[-1]):
            self._queue_sorted[request.direction] = False
        queue.append(request)
        self._idle.clear()
        if loop_producers:
            self._loop_watches.watch(request, loop_producers)  # may end it (a failed one)
        self.schedule_flush()  # the flush also publishes the queue depth

    def schedule_flush(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)

    @property
    def flush_pending(self) -> bool:
        """A pass over the queues is scheduled (it runs at the loop's next turn)."""
        return self._flush_handle is not None

    def waits_for_host_pages(self, request: Request) -> bool:
        """``request`` waits for free host pages and its deadline timer is armed."""
        return request in self._host_wait_since and self._expiry_handle is not None

    def check_liveness(self) -> None:
        """Raise ``LivenessViolation`` if a queued request waits on nothing that ends by
        itself (see liveness.py). Reads state only; loop thread."""
        check_liveness(self)

    # --- batching -------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_handle = None
        if self.pool is None:  # detached at close (a late callback, e.g. a pressure hook's)
            return
        queues = self.queues
        progress = True
        while progress:  # a submitted backup can make a queued prefetch ready
            progress = False
            self._host_shortage_pages = 0  # what the last pass lacked is what counts
            for direction in (H2D, D2H):
                chosen = self._take_ready(direction)
                if chosen:
                    self._submit(direction, chosen)
                    progress = bool(queues[H2D] or queues[D2H])  # else nothing is left to try
        self.publish_state()
        # The caller's hook runs last, once what this pass chose is in the engine: whatever
        # it does (release pages, cancel a request) meets only settled requests.
        shortage, self._host_shortage_pages = self._host_shortage_pages, 0
        if shortage:
            self._ask_for_host_pages(shortage)
        else:
            self._asked_for = None  # no shortage now: the next one is news to the hook

    def _take_ready(self, direction: Direction) -> list[Request]:
        queue = self.queues[direction]
        if not queue:
            return []
        if not self._queue_sorted[direction]:
            # Sorted into a new list: list.sort() empties the list while it runs its key
            # function, and a thread counting the queue against the bound would read 0.
            queue = self.queues[direction] = sorted(queue, key=Request.sort_key)
            self._queue_sorted[direction] = True
        room = self.max_inflight_bytes[direction] - self.inflight_bytes[direction]
        busy = self.inflight_bytes[direction] > 0
        chosen: list[Request] = []
        kept: list[Request] = []
        short: list[Request] = []  # backups that found too few free host pages
        pages_needed = 0
        full = False
        # Backups into service-chosen host pages: how many pages the rest of the queue asks
        # for, so the pool can take one run for all of them (see HostPool.allocate).
        fresh_left = (sum(r.num_pages for r in queue if r.host_pages is None)
                      if direction is D2H else 0)
        try:
            for request in queue:
                fresh = request.host_pages is None
                if fresh:
                    fresh_left -= request.num_pages
                if full or request.loop_waits:
                    kept.append(request)
                    continue
                if request.deps:
                    if _waits_for_a_queued_dep(request):
                        kept.append(request)
                        continue
                    if request.data_deps:
                        failed = self._failed_data_dependency(request)
                        if failed is not None:
                            self.finish(request, FAILED, error=failed)
                            continue
                if request.nbytes > room and (busy or chosen):
                    full = True  # backpressure: wait for in-flight bytes to drain, keep order
                    kept.append(request)
                    continue
                if fresh:
                    ahead = min(fresh_left, max(0, (room - request.nbytes) // self.bytes_per_page))
                    if not self._allocate_host(request, ahead):
                        if self._closing:
                            self.finish(request, CANCELLED)
                            continue
                        pages_needed += request.num_pages
                        short.append(request)
                        kept.append(request)
                        continue
                chosen.append(request)
                room -= request.nbytes
        finally:
            self.pool.end_batch()
        self.queues[direction] = kept
        if direction is D2H:
            self._host_shortage_pages = pages_needed  # the flush asks the hook, once, at its end
            if len(self._host_wait_since) > len(short):
                # Backups held back now for another reason (in-flight bytes, a dependency, a
                # producer) wait for that, not for host pages: their host-wait clock pauses.
                waiting, now = set(short), self.loop.time()
                for request in [r for r in self._host_wait_since if r not in waiting]:
                    self._host_waited_s[request] = now - self._host_wait_since.pop(request)
        return chosen

    @staticmethod
    def _failed_data_dependency(request: Request, copied: bool = False
                                ) -> BaseException | None:
        """The error of a request this one needs (its backup, or its ``after=``) that ended,
        or (``copied``: this request's copy ran) will end, cancelled or failed."""
        for dep in request.data_deps:
            cancelled, cause = _unusable(dep, copied)
            if cancelled or cause is not None:
                error = TransferFailedError(
                    f"request {dep.seq} ({dep.direction.value}), which this "
                    f"{request.direction.value} of {request.num_pages} pages needs (the backup "
                    f"whose host pages it reads, or a Transfer named in after=), "
                    f"{'was cancelled' if cancelled else 'failed'}; "
                    + ("its copy ran, but what it wrote counts as unknown" if copied
                       else "it did not run"))
                error.__cause__ = cause
                return error
        return None

    def _allocate_host(self, request: Request, ahead_pages: int) -> bool:
        handle = self.pool.allocate(request.num_pages, ahead_pages=ahead_pages)
        if handle is None:
            if request not in self._host_wait_since:  # starts, or resumes, its clock
                since = self._host_wait_since[request] = self.loop.time() - (
                    self._host_waited_s.pop(request, 0.0) if self._host_waited_s else 0.0)
                expiry = self._expiry_handle
                if expiry is not None and (
                        since + self.config.host_wait_timeout_s < self._expiry_at_s):
                    expiry.cancel()  # a resumed clock runs out before the armed one
                    self._expiry_handle = None
                self._arm_expiry()
            return False
        self._stop_host_wait(request)
        request.host_handle = handle
        request.host_pages = handle.page_seq
        self.hazards.register_fresh_host_writes(request)
        return True

    def _stop_host_wait(self, request: Request) -> None:
        """``request`` no longer waits for host pages (it got them, or it ended)."""
        if self._host_wait_since:
            self._host_wait_since.pop(request, None)
        if self._host_waited_s:
            self._host_waited_s.pop(request, None)

    def _submit(self, direction: Direction, requests: list[Request]) -> None:
        """Hand ``requests`` to the engine: one batch for all of them, except that a request
        whose waits can fail (a producer the engine may fail to wait for, or a running request
        it needs) or whose device indices the engine reads (and may refuse) gets a batch of
        its own, so that it fails alone."""
        solo_producers = self.engine.producer_waits_can_fail
        shared: list[Request] = []
        for request in requests:
            if (request.after and solo_producers) or request.device_indices is not None or (
                    request.data_deps and any(dep.state is SUBMITTED
                                              for dep in request.data_deps)):
                self._submit_batch(direction, [request])
            else:
                shared.append(request)
        if shared:
            self._submit_batch(direction, shared)

    def _submit_batch(self, direction: Direction, requests: list[Request]) -> None:
        deps: dict[BatchHandle, bool] = {}
        after: list[object] = []
        offset = 0
        for request in requests:
            request.batch_index = offset
            offset += request.num_pages
            for dep, needs_data in request.deps:
                if dep.state is SUBMITTED and dep.handle is not None:
                    deps[dep.handle] = deps.get(dep.handle, False) or needs_data
            if request.after:
                after.extend(request.after)
        try:
            batch = CopyBatch(
                direction,
                concat_pages([r.host_pages for r in requests], offset),
                concat_pages([r.device_pages for r in requests], offset),
                deps=tuple(Dependency(h, n) for h, n in deps.items()),
                after=tuple(after),
                device_indices=requests[0].device_indices,  # such a request is alone
            )
            handle = self.engine.submit(batch)
        except Exception as exc:  # noqa: BLE001 - each request ends with it, nothing is stuck
            # The requests left the queue: they end here, failed, returning what they hold
            # (service-chosen host pages included), instead of staying queued for ever.
            for request in requests:
                failure = TransferFailedError(
                    f"{direction.value} copy of {request.num_pages} pages could not be handed "
                    f"to the copy engine: {exc!r}; it did not run")
                failure.__cause__ = exc
                self.finish(request, FAILED, error=failure)
            return
        self._batches[handle] = requests
        nbytes = 0
        pending_layers = self._pending_layers
        for request in requests:
            request.handle = handle
            request.state = SUBMITTED
            request.mark_started()
            nbytes += request.nbytes
            if pending_layers:
                for layer, future in pending_layers.pop(request, ()):
                    self._watch_layer(handle, layer, future)
        self.inflight_bytes[direction] += nbytes  # the gauges follow in publish_state()
        self.inflight_requests_in[direction] += len(requests)

    # --- completion -----------------------------------------------------------------------

    def on_batch_done(self, handle: BatchHandle) -> None:
        """Engine completion (on the loop, via the hand-off): end every request of the batch,
        returning what they held and recording their metrics once for the batch."""
        requests = self._batches.pop(handle)
        direction = handle.batch.direction
        error = handle.error
        if error is None:
            self.metrics.record_batch(direction, bytes_moved=handle.batch.num_pages *
                                      self.bytes_per_page, pages_moved=handle.batch.num_pages,
                                      duration_s=handle.duration_s)
        elif not isinstance(error, _NOT_A_COPY_ERROR):
            self.metrics.record_batch_error(direction)
        now = time.perf_counter()
        ended: dict[Outcome, tuple[list[float], list[int]]] = {}
        nbytes, duration_s, eviction = 0, handle.duration_s, direction is D2H
        for request in requests:
            nbytes += request.nbytes
            if request.cancel_requested:
                outcome, result, failure = CANCELLED, None, None
            elif error is not None:
                outcome, result = FAILED, None
                failure = TransferFailedError(
                    f"{direction.value} copy of {request.num_pages} pages failed: {error!r}")
                failure.__cause__ = error
            elif request.data_deps and (failure := self._failed_data_dependency(
                    request, copied=True)) is not None:
                # What it needs was cancelled while both were in the engine: it fails as it
                # would have had that happened while it was queued.
                outcome, result = FAILED, None
            else:
                outcome, failure = DONE, None
                result = TransferResult(
                    direction, request.num_pages, request.nbytes, request.padding_tokens,
                    duration_s, request.host_handle if eviction else None)
            figures = ended.get(outcome)
            if figures is None:
                figures = ended[outcome] = ([], [])
            figures[0].append(now - request.submitted_at)
            figures[1].append(request.padding_tokens)
            self._end(request, outcome, result, failure, check_idle=False)
        self._check_idle()
        self.inflight_bytes[direction] -= nbytes
        self.inflight_requests_in[direction] -= len(requests)
        moved = error is None  # padding counts only where the padded bytes moved
        for outcome, (latencies, paddings) in ended.items():
            self.metrics.record_requests(direction, outcome, latencies,
                                         sum(paddings) * self.bytes_per_token if moved else 0)
        self.schedule_flush()  # publishes the pool gauges once for the whole batch

    def finish(self, request: Request, outcome: Outcome, *, result: TransferResult | None = None,
               error: BaseException | None = None) -> None:
        """End a request that is not in a batch (queued, or never queued): once, returning
        everything it held, then resolve its future. Its bytes never moved: no padding."""
        self.metrics.record_request(
            request.direction, outcome, latency_s=time.perf_counter() - request.submitted_at,
            padding_bytes=0)
        self._end(request, outcome, result, error)

    def _end(self, request: Request, outcome: Outcome, result: TransferResult | None,
             error: BaseException | None, *, check_idle: bool = True) -> None:
        assert request.state is not FINISHED
        if request.state is QUEUED:
            self.queues[request.direction] = [r for r in self.queues[request.direction]
                                              if r is not request]
        request.state = FINISHED
        self._stop_host_wait(request)
        self.hazards.retire(request)  # its host pages may be released again
        handle = request.host_handle
        if (request.owns_host and outcome is not DONE and handle is not None
                and handle.allocation_id not in self._orphans):
            # The service chose these pages and the backup did not end done: they are the
            # service's to free (never the caller's), once no copy reads them. (Unless the
            # caller already released them from a thread while the backup ran: then they are
            # an orphan already, freed below or by the copy that still uses them.)
            self._orphans.free_when_unused(handle, self.pool)
        if self._orphans and request.host_pages is not None:
            # this request may have been the last copy using orphaned pages
            self._orphans.free_sharing(request.host_pages, self.pool)
        future = request.future
        if outcome is DONE:
            future.set_result(result)
        elif outcome is FAILED:
            future.set_exception(error)
            # The service's own future: whether the caller looked is tracked by its Transfer,
            # never by asyncio's "exception was never retrieved" at collection time.
            future.exception()
            if request.dropped:
                report_unobserved(request, error)
        else:
            future.cancel()
        if self._loop_watches:
            self._loop_watches.stop(request)
        if request.count_wasted_at_end:  # its Transfer is gone: nobody uses what it loaded
            unseen = request.take_unseen_loaded_layers()
            if unseen:
                self.record_layers(Timeliness.WASTED, unseen)
        if request.waiters:
            for waiter in request.waiters:
                if not waiter.done():
                    waiter.set_result(None)  # the awaiting task reads request.future itself
        if not request.started or request.end_waiter is not None:
            request.mark_ended()  # wake threads waiting for its start or its end
        if self._pending_layers:
            for _layer, layer_future in self._pending_layers.pop(request, ()):
                if not layer_future.done():
                    if error is None:
                        layer_future.cancel()
                    else:
                        layer_future.set_exception(error)
                        layer_future.exception()  # its awaiter may have been cancelled
        if check_idle:
            self._check_idle()
        # Whatever waited for this request (a dependency, its pages) may go now; also when it
        # ended inside a flush pass that chose nothing else (that pass made progress too).
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)

    def _check_idle(self) -> None:
        if not self._batches and not self.queues[D2H] and not self.queues[H2D]:
            self._idle.set()

    def release_host(self, handle: HostPages) -> None:
        """Return ``handle``'s pages to the pool now; refuses (changing nothing) while a queued
        or running copy reads or writes any of them. Does not block."""
        if handle.allocation_id in self._orphans:
            raise _services_own(handle)
        self.pool.release(handle, self.hazards.host_pages_busy)

    def release_posted_host(self, handle: HostPages) -> None:
        """Take a release a thread posted (checked there: the caller's live allocation then):
        return ``handle``'s pages now, or once the last queued or running copy that uses them
        ends; until then they are the service's (``release_host`` refuses the handle). If the
        service took the handle over since (its backup ended undone, so the service frees
        those pages itself), the release is moot: nothing is left to do. Loop thread."""
        if handle.allocation_id in self._orphans or not self.pool.holds(handle):
            return  # freed or being freed by the service; the pages come back once
        self._orphans.free_when_unused(handle, self.pool)

    def check_host_tokens(self, pages: PageSeq, name: str) -> None:
        """Raise ``UnknownHostPagesError`` unless every one of ``pages`` lies in a live
        allocation the caller holds (not one released or taken over while copies still use
        it). Changes nothing; loop thread."""
        self.pool.check_allocated(pages, name=name)
        page = self._orphans.first_owned(pages)
        if page is not None:
            raise UnknownHostPagesError(
                f"{name} names host page {page}, whose allocation was released (or is the "
                f"service's: a backup it placed that did not end done) and returns to the pool "
                f"once the copies using it end; use pages of a live allocation")

    def check_releasable(self, handle: HostPages) -> None:
        """Raise ``UnknownHostPagesError`` unless ``handle`` is a live allocation that the
        caller (not the service) holds. Changes nothing; safe on any thread (a set and a dict
        lookup)."""
        if handle.allocation_id in self._orphans:
            raise _services_own(handle)
        pool = self.pool  # read once: close() may detach it from the loop meanwhile
        if pool is None:
            raise ServiceClosedError("the service is closing or closed")
        pool.check_owned(handle)

    # --- cancellation ---------------------------------------------------------------------

    def check_loop_thread(self, call: str, instead: str) -> None:
        """Raise ``WrongThreadError`` unless this is the loop's thread: ``call`` changes loop
        state without a lock; ``instead`` says what a thread uses."""
        if threading.get_ident() != self.loop_thread_id:
            raise WrongThreadError(
                f"{call} runs on the service's event loop thread only, and was called from "
                f"thread {threading.current_thread().name!r}; {instead}")

    def cancel(self, request: Request) -> bool:
        if request.state is FINISHED:
            return False
        if request.state is QUEUED:
            self.finish(request, CANCELLED)
            self.schedule_flush()  # and republish the pool gauges
        else:
            request.cancel_requested = True  # the copy completes first; then it returns pages
            handle = request.handle
            if handle is not None and all(r.cancel_requested for r in self._batches[handle]):
                # Nobody wants this batch any more: an engine whose copy still waits for its
                # producers or dependencies drops it (the CPU engine; on CUDA it is enqueued),
                # and one that has not taken it yet ends it now.
                handle.skip_requested = True
                engine = self.engine  # None only once close() detached it
                if engine is not None:
                    engine.drop_unstarted(handle)
        return True

    # --- host pressure --------------------------------------------------------------------

    def _ask_for_host_pages(self, pages_needed: int) -> None:
        """Call the caller's hook for a shortage of ``pages_needed`` host pages: once per
        shortage, so not while an earlier call's coroutine still runs, and again only when the
        pages needed changed or host pages changed hands (an allocation or a release) since it
        was last called."""
        callback = self.on_host_pressure
        if callback is None or self._pressure_tasks:
            return
        asked_for = (pages_needed, self.pool.changes)
        if asked_for == self._asked_for:
            return  # nothing changed since the hook last ran: calling it again is a busy loop
        self._asked_for = asked_for
        try:
            outcome = callback(pages_needed)
        except Exception:  # noqa: BLE001 - a broken hook must not break the service
            log.exception("on_host_pressure(%d) raised; evictions wait for space", pages_needed)
            return
        if inspect.isawaitable(outcome):
            task = asyncio.ensure_future(outcome)
            self._pressure_tasks.add(task)
            task.add_done_callback(self._pressure_done)

    def _pressure_done(self, task: asyncio.Task) -> None:
        self._pressure_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("on_host_pressure raised: %r; evictions wait for space", task.exception())
        self.schedule_flush()

    def _arm_expiry(self) -> None:
        if self._expiry_handle is None and self._host_wait_since:
            first = min(self._host_wait_since.values())
            self._expiry_at_s = first + self.config.host_wait_timeout_s
            self._expiry_handle = self.loop.call_at(self._expiry_at_s, self._expire_host_waits)

    def _expire_host_waits(self) -> None:
        self._expiry_handle = None
        now = self.loop.time()
        timeout = self.config.host_wait_timeout_s
        for request, since in list(self._host_wait_since.items()):
            if now - since >= timeout:
                stats = self.pool.statistics()
                self.finish(request, FAILED, error=HostPoolExhausted(
                    f"eviction of {request.num_pages} pages waited {timeout:g} s for host "
                    f"pages: needed {request.num_pages}, free {stats.free_pages}, capacity "
                    f"{stats.capacity_pages} pages; release host pages (or register "
                    f"on_host_pressure to do so), raise ServiceConfig.host_pool, or raise "
                    f"host_wait_timeout_s"))
        self._arm_expiry()
        self.schedule_flush()

    # --- per-layer readiness --------------------------------------------------------------

    def layer_future(self, request: Request, layer: int) -> asyncio.Future:
        """A future resolved when ``layer`` of ``request`` is usable (failed or cancelled as the
        request is, if it ends without the layer). Loop thread; does not block."""
        future = self.loop.create_future()
        if request.handle is not None:
            self._watch_layer(request.handle, layer, future)
        elif request.future.done():  # it ended before any copy: nothing will resolve a wait
            ended = request.future
            if ended.cancelled():
                future.cancel()
            elif ended.exception() is not None:
                future.set_exception(ended.exception())
                future.exception()  # its awaiter may have been cancelled
            else:
                future.set_result(None)  # done without a copy: nothing was left to load
        else:
            self._pending_layers.setdefault(request, []).append((layer, future))
        return future

    def _watch_layer(self, handle: BatchHandle, layer: int, future: asyncio.Future) -> None:
        def resolve() -> None:
            if future.done():
                return
            if isinstance(handle.error, CopySkipped):
                future.cancel()  # the prefetch was cancelled before its copy started
            elif handle.error is not None and handle.layers_ready <= layer:
                future.set_exception(TransferFailedError(
                    f"prefetch failed before layer {layer} was ready: {handle.error!r}"))
                future.exception()  # its awaiter may have been cancelled
            else:
                future.set_result(None)

        if not handle.on_layer_ready(layer, resolve):
            resolve()

    @property
    def waits_on_device(self) -> bool:
        """Whether a layer wait ends on the device (CUDA: the consumer's stream waits), not by
        blocking the waiting thread until the copy is done (CPU)."""
        return self._waits_on_device

    def engine_wait_layer(self, handle: BatchHandle, layer: int, timeout_s: float | None,
                          classify: Callable[[bool, float], None]) -> bool:
        """The engine's layer wait (any thread; blocks up to ``timeout_s``); ``False``, having
        waited for nothing, once close() has detached the engine: every copy has ended then."""
        engine = self.engine  # read once: close() may detach it from the loop meanwhile
        if engine is None:
            return False
        engine.wait_layer(handle, layer, timeout_s, classify)
        return True

    def _fail_for_producer(self, request: Request, producer: object,
                           failure: BaseException) -> None:
        error = TransferFailedError(
            f"{request.direction.value} of {request.num_pages} pages did not run: its producer "
            f"{producer!r} {'was cancelled' if isinstance(failure, asyncio.CancelledError) else 'failed'}")
        error.__cause__ = failure
        self.finish(request, FAILED, error=error)

    def record_layers(self, timeliness: Timeliness, layers: int, waited_s: float | None = None
                      ) -> None:
        self.metrics.record_prefetch_layers(timeliness, layers, waited_s=waited_s)

    # --- state ----------------------------------------------------------------------------

    def publish_state(self, *, now: bool = False) -> None:
        """Set the state gauges (queue depth, in-flight bytes, pool bytes) from current state.

        At most once per ``PUBLISH_PERIOD_S`` on the hot path, with one trailing update
        scheduled so the last state always shows; ``now`` forces it (start, release)."""
        loop_now = self.loop.time()
        if not now and loop_now - self._published_at < PUBLISH_PERIOD_S:
            if self._publish_handle is None:
                self._publish_handle = self.loop.call_at(
                    self._published_at + PUBLISH_PERIOD_S, self._publish_trailing)
            return
        self._published_at = loop_now
        metrics = self.metrics
        for direction in Direction:
            metrics.set_queue_depth(direction, len(self.queues[direction]))
            metrics.set_inflight_bytes(direction, self.inflight_bytes[direction])
            metrics.set_inflight_requests(direction, self.inflight_requests_in[direction])
        stats = self.pool.statistics()
        bpp = self.bytes_per_page
        metrics.set_host_pool(
            used_bytes=stats.used_pages * bpp, free_bytes=stats.free_pages * bpp,
            in_flight_bytes=self.hazards.busy_host_pages * bpp,
            capacity_bytes=stats.capacity_pages * bpp)

    def _publish_trailing(self) -> None:
        self._publish_handle = None
        self.publish_state(now=True)

    async def _idle_within(self, timeout_s: float) -> bool:
        """True once nothing is queued or in flight, False if that takes over ``timeout_s``
        (idle reached in the same turn the timeout fires counts as idle)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return self._idle.is_set()
        return True

    def abandon_unfinished(self) -> None:
        """After the engine stopped: end every request it never reported (failed) and any
        still queued (cancelled), returning what they held. Loop thread."""
        for handle, requests in list(self._batches.items()):
            del self._batches[handle]
            direction = handle.batch.direction
            for request in requests:
                self.inflight_bytes[direction] -= request.nbytes
                self.inflight_requests_in[direction] -= 1
                self.finish(request, FAILED, error=ServiceClosedError(
                    f"the service closed before the engine reported this {direction.value} "
                    f"copy of {request.num_pages} pages (the engine failed or hung)"))
        self._cancel_queued()

    def _cancel_queued(self) -> None:
        """End every queued request, cancelled. Each queue is emptied first, so that ending a
        request does not copy the rest of its queue: O(queue), not O(queue ** 2)."""
        for direction in Direction:
            queued, self.queues[direction] = self.queues[direction], []
            for request in queued:
                if request.state is QUEUED:
                    self.finish(request, CANCELLED)

    def detach(self) -> None:
        """After close: stop timers, zero the state gauges (the pool is gone) and drop the pool
        and engine (and with them the arenas)."""
        for handle in (self._publish_handle, self._expiry_handle, self._flush_handle):
            if handle is not None:
                handle.cancel()
        self._publish_handle = self._expiry_handle = self._flush_handle = None
        for direction in Direction:
            self.metrics.set_queue_depth(direction, 0)
            self.metrics.set_inflight_bytes(direction, 0)
            self.metrics.set_inflight_requests(direction, 0)
        self.metrics.set_host_pool(used_bytes=0, free_bytes=0, in_flight_bytes=0,
                                   capacity_bytes=0)
        self.pool = self.engine = None

    async def drain(self, timeout_s: float) -> None:
        """Wait until nothing is queued or in flight. After ``timeout_s`` cancel what is queued;
        copies already running complete (never torn), and after another ``timeout_s`` copies
        still blocked on a producer that never finished are abandoned (they fail). A backup
        short of host pages is cancelled at once, now or when it comes to need them."""
        self._closing = True
        for request in [*self._host_wait_since, *self._host_waited_s]:  # short of host pages
            if request.state is not FINISHED:
                self.finish(request, CANCELLED)
        self.schedule_flush()
        if not await self._idle_within(timeout_s):
            self._cancel_queued()
            if not await self._idle_within(timeout_s):
                log.error("close(): %d requests still wait for a producer or dependency after "
                          "%.3g s; abandoning them", self.inflight_requests, 2 * timeout_s)
                self.engine.abandon_waits()
                if not await self._idle_within(timeout_s):
                    log.error("close(): the engine did not report %d copies within %.3g s "
                              "more; closing without them", self.inflight_requests, timeout_s)
        await self.end_pressure_hooks(timeout_s)  # they end before the pool goes

    async def end_pressure_hooks(self, timeout_s: float) -> None:
        """Cancel the caller's hook coroutines still running and wait up to ``timeout_s`` for
        them to end (close(): on every path, a cancelled close() too)."""
        if self._pressure_tasks:
            for task in self._pressure_tasks:
                task.cancel()
            await asyncio.wait(list(self._pressure_tasks), timeout=timeout_s)


#: Batch errors of copies that never ran: dropped because every request was cancelled, a
#: producer or needed backup failed, the service closed while it waited. They fail (or cancel)
#: its requests, but ``transfer_errors_total`` counts failed copies only.
_NOT_A_COPY_ERROR = (CopySkipped, CopyNotRunError, ServiceClosedError)


def _waits_for_a_queued_dep(request: Request) -> bool:
    """Whether a request ``request`` follows is still queued. Amortized O(1) per pass: a dep
    that left the queue never returns to it, so the scan resumes at the first one that may
    not have (a long chain on one page is then not re-read on every pass)."""
    deps = request.deps
    at, count = request.deps_left_queue, len(deps)
    while at < count and ((state := deps[at][0].state) is SUBMITTED or state is FINISHED):
        at += 1
    request.deps_left_queue = at
    return at < count


def _unusable(dep: Request, copied: bool) -> tuple[bool, BaseException | None]:
    """Whether ``dep`` ended cancelled, and its error when it failed. ``copied``: a copy that
    needed ``dep`` ran, so ``dep``'s own copy ended in the engine, while its ending may not
    have reached the loop yet (the engines hand endings over as they come): then what it
    will end as, from its cancel flag, its batch's error, or what it needs in turn."""
    if dep.state is FINISHED:
        if dep.future.cancelled():
            return True, None
        return False, dep.future.exception()
    if not copied:
        return False, None
    if dep.cancel_requested:
        return True, None
    handle = dep.handle
    if handle is not None and handle.finished and handle.error is not None:
        return False, handle.error
    for inner in dep.data_deps:
        cancelled, cause = _unusable(inner, copied)
        if cancelled or cause is not None:
            return False, cause if cause is not None else TransferFailedError(
                f"request {inner.seq}, which it needs, was cancelled")
    return False, None
