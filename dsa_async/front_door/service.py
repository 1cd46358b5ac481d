"""``OffloadService``: the asyncio front door an inference server embeds in its event loop.

Lifecycle: ``async with OffloadService(config, buffers) as s`` (or ``await s.start()`` /
``await s.close()``). ``start()`` checks the host pool against the memory budget and reserves
it in the machine-wide ledger *before* anything is allocated or page-locked, then allocates
and first-touches the arenas (off the loop), starts the engine and the loop-lag monitor.
``close()`` stops admitting, drains in-flight work (cancelling what has not started after
``drain_timeout_s``), stops the engine and returns the memory and the reservation.

``evict``, ``prefetch``, ``release``, ``allocate_host_pages`` and ``statistics`` are plain
methods for the loop thread: they validate, act or enqueue, and return at once. All waiting
happens by awaiting the returned ``Transfer``. Threads without an event loop submit with
``evict_threadsafe`` / ``prefetch_threadsafe`` and release with ``release_threadsafe``: they
validate and capture on the calling thread and hand over in batches (thread_submit.py); they
wait with ``Transfer.wait`` / ``wait_layer``. For anything else, ``call_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from .._version import __version__
from ..completion.result import TransferResult
from ..completion.transfer import Transfer
from ..config import ServiceConfig
from ..errors import (
    ArgumentTypeError,
    ArgumentValueError,
    ConfigError,
    HostPoolExhausted,
    IndexTypeError,
    IndexValueError,
    ServiceClosedError,
    UnknownHostPagesError,
    as_float,
    int_argument,
    is_real_number,
    shown,
)
from ..host_memory.budget import probe_host_budget
from ..host_memory.ledger import HostLedger
from ..host_memory.plan import reserve_host_pools
from ..host_memory.pool import HostPages, HostPool
from ..kinds import CANCELLED, D2H, DONE, FAILED, H2D, Backend, Direction
from ..observability.loop_lag import EventLoopLagMonitor
from ..observability.metrics import BudgetFigures, ServiceMetrics
from ..paging.device_indices import DeviceIndices, OnDevice, deferred_form, paired_host_pages
from ..paging.runs import PageSeq
from ..paging.tokens import Pages, paired_page_seqs, tokens_to_page_seq
from ..scheduling.request import NO_DEADLINE, POSTED, QUEUED, Request
from ..scheduling.scheduler import HostPressureCallback, Scheduler
from ..transfer.base import FaultHook, TransferEngine, resolve_backend
from ..transfer.buffers import DeviceBuffers, bind_pool, check_disjoint
from ..transfer.handoff import LoopHandoff
from .producers import NO_PRODUCERS, parse_after, parse_indices_after
from .thread_submit import HostCheck, PostedRequest, ThreadInbox
from .to_the_end import awaited_to_the_end, on_daemon_thread, to_thread_to_the_end

log = logging.getLogger("dsa_async.service")  # the logger name operators configure


class ServiceState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class ServiceStatistics:
    """Current state only (no counters, no times). Once everything is released it equals the
    snapshot taken just after ``start()``."""

    capacity_pages: int
    used_pages: int
    free_pages: int
    largest_free_extent_pages: int
    in_flight_pages: int
    ledger_bytes: int
    queued_requests: int
    inflight_requests: int


_EMPTY = range(0)
_RUNNING = ServiceState.RUNNING  # the request paths compare it per call (see kinds.py)
_NOT_CAPTURED = object()  # no producer was captured on another thread for this request


def _make_engine(backend: Backend, config: ServiceConfig, *args, **kwargs) -> TransferEngine:
    if backend is Backend.CUDA:
        from ..transfer.cuda import CudaEngine

        return CudaEngine(*args, staging_bytes=config.device_staging_bytes, **kwargs)
    from ..transfer.cpu import CpuEngine

    return CpuEngine(*args, **kwargs)


class OffloadService:
    """Moves whole pages of every pool between device buffers and a budget-checked host pool."""

    def __init__(self, config: ServiceConfig, device_buffers: DeviceBuffers | Mapping[str, DeviceBuffers],
                 *, registry: CollectorRegistry | None = None,
                 on_host_pressure: HostPressureCallback | None = None,
                 fault_hook: FaultHook | None = None,
                 engine_factory: Callable[..., TransferEngine] | None = None) -> None:
        if not isinstance(config, ServiceConfig):
            raise ConfigError(f"config must be a ServiceConfig, got {type(config).__name__}")
        names = [g.name for g in config.geometries]
        if isinstance(device_buffers, Mapping):
            if sorted(device_buffers) != sorted(names):
                raise ConfigError(f"device buffers are given for pools {sorted(device_buffers)} "
                                  f"but the config has pools {sorted(names)}; make them match")
            buffers = dict(device_buffers)
        else:
            if len(names) != 1:
                raise ConfigError(f"the config has pools {names}: pass device buffers as a "
                                  f"mapping of pool name to buffers")
            buffers = {names[0]: device_buffers}
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.on_host_pressure = on_host_pressure
        self._buffers = buffers
        self._fault_hook = fault_hook
        self._engine_factory = engine_factory  # None: the backend's engine
        self._state = ServiceState.NEW
        self._closed = asyncio.Event()
        self._start_ended = asyncio.Event()  # start() returned or raised
        self._scheduler: Scheduler | None = None
        self._pool: HostPool | None = None
        self._engine: TransferEngine | None = None
        self._reservation = None
        self._ledger: HostLedger | None = None
        self._lag_monitor: EventLoopLagMonitor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics: ServiceMetrics | None = None
        self.backend = Backend.AUTO
        self.device_pages = 0
        self._device_token_bound = self._host_token_bound = 0  # token slots on each side
        self._page_size_tokens = config.page_size_tokens
        self.plan = None
        #: a producer captured on a submitting thread, for the request the loop runs now
        self._captured: object = _NOT_CAPTURED
        #: call_threadsafe futures whose call has not run yet; once the service is closed they
        #: fail and new calls are refused, so none is left pending by a loop that stops
        self._calls_lock = threading.Lock()
        self._calls_waiting: set[concurrent.futures.Future] = set()
        self._calls_ended = False
        self._capacity_pages = 0  # host pages in all (read by submitting threads)
        self._inbox: ThreadInbox | None = None  # what threads without a loop hand over
        self._engine_defers_indices = False  # whether the engine may read any index late

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> OffloadService:
        """Plan, reserve, allocate and start. Raises ``HostBudgetExceeded`` before allocating."""
        if self._state is not ServiceState.NEW:
            raise ServiceClosedError(f"start() needs a new service; this one is {self._state.value}")
        self._state = ServiceState.STARTING
        loop = asyncio.get_running_loop()
        try:
            await self._start(loop)
        except BaseException as exc:
            # The error's traceback keeps the failed steps' frames, and their locals could
            # keep the arenas alive (views of them): their memory is returned here, off the
            # loop, not wherever the caller lets go of the error.
            traceback.clear_frames(exc.__traceback__)
            try:
                await self._release_resources()
            finally:
                self._state = ServiceState.CLOSED
                self._end_threadsafe_calls()
                self._start_ended.set()
            raise
        self._state = ServiceState.RUNNING
        self._start_ended.set()  # a close() that came meanwhile goes on from here
        return self

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        config = self.config
        self.backend = resolve_backend(config.backend)
        self._ledger = HostLedger(config.ledger_directory)
        size = config.host_pool
        # Each step runs on a worker thread to its end even if start() is cancelled meanwhile
        # (a timeout around it), and what it made is kept, so the failed start returns it.
        self.plan, self._reservation = await to_thread_to_the_end(
            functools.partial(
                reserve_host_pools, config.geometries, num_pages=size.pages,
                requested_bytes=size.bytes, max_pages=size.max_pages, root=config.budget_root,
                ledger=self._ledger, reserve_bytes=config.reserve_bytes),
            functools.partial(setattr, self, "_reservation"), keep_item=1)
        self._pool = await to_thread_to_the_end(
            functools.partial(HostPool.create, config.geometries, self.plan.num_pages),
            functools.partial(setattr, self, "_pool"))
        await to_thread_to_the_end(
            functools.partial(self._reservation.mark_allocated, self._pool.capacity_bytes))
        bindings = {g.name: bind_pool(g, self._pool.arenas[g.name], self._buffers[g.name])
                    for g in config.geometries}
        check_disjoint(tuple(bindings.values()))
        self.device_pages = min(b.device_pages for b in bindings.values())
        self._device_token_bound = self.device_pages * config.page_size_tokens
        self._host_token_bound = self._pool.capacity_pages * config.page_size_tokens
        self._capacity_pages = self._pool.capacity_pages
        self.metrics = ServiceMetrics(self.registry, version=__version__, backend=self.backend,
                                      budget_reader=self._read_budget)
        self.metrics.observe_pool_allocation(self._pool.startup_s)
        self._loop = loop
        handoff = LoopHandoff(loop)
        factory = self._engine_factory or functools.partial(_make_engine, self.backend, config)
        # Off the loop: the CUDA engine page-locks the arenas here, which takes a while; a
        # cancelled start waits for it, so that it closes what the constructor made.
        self._engine = await to_thread_to_the_end(
            functools.partial(factory, bindings, handoff, self._on_batch_done,
                              fault_hook=self._fault_hook),
            functools.partial(setattr, self, "_engine"))
        self._engine_defers_indices = (type(self._engine).defers_indices
                                       is not TransferEngine.defers_indices)
        self._scheduler = Scheduler(config, self._pool, self._engine, self.metrics, loop,
                                    self._pressure)
        scheduler = self._scheduler
        self._inbox = ThreadInbox(loop, self._accept_posted, self._take_posted_release,
                                  lambda: scheduler.queued_requests, config.max_queued_requests)
        self._lag_monitor = EventLoopLagMonitor(self.metrics.observe_loop_lag)
        self._lag_monitor.start()
        self._scheduler.publish_state(now=True)

    def _on_batch_done(self, handle) -> None:
        self._scheduler.on_batch_done(handle)

    def _pressure(self, pages_needed: int) -> object:
        if self.on_host_pressure is None:
            return None
        return self.on_host_pressure(pages_needed)

    def _read_budget(self) -> BudgetFigures:
        """Scrape-time budget figures (blocking file reads; called from the scrape thread)."""
        snapshot = probe_host_budget(self.config.budget_root, reserve_bytes=self.config.reserve_bytes)
        entries = self._ledger.peek() if self._ledger is not None else ()
        pending = sum(e.pending_bytes for e in entries)  # not yet missing from MemAvailable
        free_bytes = max(0, snapshot.available_before_reserve_bytes - pending)
        return BudgetFigures(limit_bytes=snapshot.limit_bytes,
                             reserved_bytes=sum(e.reserved_bytes for e in entries),
                             available_bytes=max(0, free_bytes - snapshot.reserve_bytes),
                             reserve_bytes=snapshot.reserve_bytes,
                             free_bytes=free_bytes)

    async def close(self) -> None:
        """Stop admitting, drain, stop the engine, free the pool and the reservation.

        Idempotent. Requests not started within ``drain_timeout_s`` are cancelled; evictions
        waiting for free host pages are cancelled at once (a closing service takes no
        releases, so none could come); copies already started always complete (never torn).
        Called while ``start()`` runs, it waits for the start to end, then closes what it
        started; cancelled in that wait, it still waits for the start, closes without the
        drain (as when cancelled in it), then raises ``CancelledError``."""
        cut = False
        if self._state is ServiceState.STARTING:
            cut = await awaited_to_the_end(self._start_ended.wait())
        if self._state is ServiceState.CLOSING:
            if cut:  # another close() is at it; this one's caller has given up waiting
                raise asyncio.CancelledError
            await self._closed.wait()
            return
        if self._state in (ServiceState.CLOSED, ServiceState.NEW):
            self._state = ServiceState.CLOSED
            if cut:
                raise asyncio.CancelledError
            return
        self._state = ServiceState.CLOSING
        try:
            if self._inbox is not None:
                self._inbox.close()  # threads' later posts raise; what they posted is drained
            if self._scheduler is not None and not cut:
                await self._scheduler.drain(self.config.drain_timeout_s)
                self._scheduler.publish_state(now=True)  # the drained state, for a last scrape
        finally:
            try:
                await self._release_resources()
            finally:  # CLOSED whatever happened, so a second close() never waits forever
                self._state = ServiceState.CLOSED
                self._end_threadsafe_calls()
                self._closed.set()
        if cut:
            raise asyncio.CancelledError

    async def _release_resources(self) -> None:
        """Return everything that can be returned, each step whatever the others did: an
        engine that fails to close (e.g. after a sticky device error) is logged, and the pool
        and the ledger reservation are still returned. Cancelled meanwhile (a timeout around
        close() or start()), it still takes every step, then raises ``CancelledError``; only
        an engine close still running then is not waited for (a wedged device may never let
        it end): it goes on on its own thread."""
        cancelled = False
        if self._scheduler is not None:  # after a full drain none are left
            cancelled |= await awaited_to_the_end(
                self._scheduler.end_pressure_hooks(self.config.drain_timeout_s))
        if self._lag_monitor is not None:
            monitor, self._lag_monitor = self._lag_monitor, None
            try:
                cancelled |= await awaited_to_the_end(monitor.stop())
            except Exception:  # noqa: BLE001 - logged; the rest must still be returned
                log.exception("close(): the event-loop lag monitor failed to stop")
        # The arenas (gigabytes) go with the last references to the pool and the engine: they
        # are dropped on a worker thread, where unmapping them does not hold the loop.
        doomed: list[object] = []
        if self._engine is not None:
            engine, self._engine = self._engine, None
            doomed.append(engine)
            # Copies still blocked on a producer fail now instead of holding engine.close():
            # after a full drain there are none, but a close() that was itself cancelled (a
            # timeout around it) gets here without one.
            engine.abandon_waits()
            try:
                await on_daemon_thread(engine.close, "dsa-async-engine-close")
            except asyncio.CancelledError:
                cancelled = True
                log.warning("close() was cancelled while the %s engine closed; returning the "
                            "host pool and the ledger reservation without waiting for it",
                            engine.backend.value)
            except Exception:  # noqa: BLE001 - logged; the rest must still be returned
                log.exception("close(): the %s engine failed to close; returning the host "
                              "pool and the ledger reservation anyway", engine.backend.value)
            engine.handoff.drain_now()  # completions posted while closing
            engine.handoff.closed = True
            engine = None
        if self._scheduler is not None:
            self._scheduler.abandon_unfinished()  # what the engine never reported ends now
            self._scheduler.detach()  # Transfers the caller keeps must not keep the arenas alive
        doomed.append(self._pool)  # also after a failed start
        self._pool = None
        cancelled |= await awaited_to_the_end(asyncio.to_thread(doomed.clear))
        if self._reservation is not None:  # after the memory went back
            reservation, self._reservation = self._reservation, None
            cancelled |= await awaited_to_the_end(asyncio.to_thread(reservation.release))
        if cancelled:
            raise asyncio.CancelledError

    async def __aenter__(self) -> OffloadService:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def state(self) -> ServiceState:
        return self._state

    @property
    def host_pool(self) -> HostPool:
        self._running()
        return self._pool

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def _running(self) -> Scheduler:
        if self._state is not _RUNNING:
            raise ServiceClosedError(
                f"the service is {self._state.value}; requests need a started service "
                f"(await service.start() or use 'async with service')")
        return self._scheduler

    def _running_here(self, call: str, instead: str) -> Scheduler:
        """:meth:`_running`, on the loop's thread only (``WrongThreadError`` elsewhere)."""
        scheduler = self._running()
        scheduler.check_loop_thread(call, instead)
        return scheduler

    # --- requests -------------------------------------------------------------------------

    def evict(self, device_tokens, *, host_tokens=None, after=None, indices_after=None,
              priority: int = 0) -> Transfer:
        """Back up the whole pages holding ``device_tokens`` (``int64 [n]``), in every pool.

        Without ``host_tokens`` the service picks host pages (in extents) and the result
        carries them (``Transfer.host_pages``). With ``host_tokens`` (same length, same in-page
        offsets) they must lie in pages from :meth:`allocate_host_pages`. The copy waits for
        the calling thread's work so far (CUDA: its current stream, captured here) and for every
        producer in ``after`` (producers.py). ``indices_after`` (see :meth:`prefetch`).
        Loop thread; does not block.
        """
        scheduler = self._running_here("evict()", "use evict_threadsafe() there")
        try:
            transfer, loop_producers = self._prepare_evict(
                scheduler, device_tokens, host_tokens, after, priority, self._captured,
                on_loop=True, indices_after=indices_after)
            self._accept(scheduler, transfer._request, loop_producers)
        finally:
            self._inbox.end_loop_admission()
        return transfer

    def prefetch(self, host: HostPages | None, device_tokens, *, host_tokens=None, after=None,
                 indices_after=None, deadline_s: float | None = None,
                 priority: int = 0) -> Transfer:
        """Load whole pages from the host into the device pages holding ``device_tokens``.

        ``host`` is a ``HostPages`` handle (its pages pair with the device pages in order) or
        ``None`` with ``host_tokens`` (same length and in-page offsets as ``device_tokens``).
        Whole device pages are overwritten, layer by layer, after the calling thread's work so
        far (CUDA: its current stream, captured here: kernels still reading the old pages) and
        every producer in ``after``. ``deadline_s``: seconds from now on the loop's clock;
        earlier deadlines, then larger ``priority``, go first. Loop thread; does not block.

        ``indices_after``, for device indices the engine reads later (a CUDA tensor on the cuda
        backend; ignored for indices read here): the device work their values wait for besides
        this thread's work so far. By default that is everything the copy waits for. The engine
        plans a copy from the values, so its issue waits for them on the CPU: when ``after``
        holds fences that only order the copy (a forward pass still reading the old pages),
        pass the producer of the indices alone, or ``()``, and the copy is planned at once
        and waits for those fences on the device only.
        """
        scheduler = self._running_here("prefetch()", "use prefetch_threadsafe() there")
        try:
            transfer, loop_producers = self._prepare_prefetch(
                scheduler, host, device_tokens, host_tokens, after, deadline_s, priority,
                self._captured, on_loop=True, indices_after=indices_after)
            self._accept(scheduler, transfer._request, loop_producers)
        finally:
            self._inbox.end_loop_admission()
        return transfer

    # --- requests from threads without an event loop --------------------------------------

    def evict_threadsafe(self, device_tokens, *, host_tokens=None, after=None,
                         indices_after=None, priority: int = 0) -> Transfer:
        """:meth:`evict` from a thread without an event loop; returns its ``Transfer`` at once.

        Validation, padding, ``after=`` and the capture of the calling thread's work (CUDA:
        an event on its current stream) happen here, on the calling thread, and raise here.
        The prepared request reaches the loop in a batch with other threads' (thread_submit.py).
        Whether ``host_tokens`` lie in live allocations is checked on the loop (the pool is
        the loop's): if not, the transfer fails with ``UnknownHostPagesError``. Wait with
        ``Transfer.wait(timeout_s)``, ``wait_layer`` or poll ``done()``. Safe on any thread,
        meant for threads without an event loop (on the loop, :meth:`evict` queues at once);
        does not block (a short lock).
        """
        scheduler = self._running()
        releases_seen = self._releases_so_far()
        transfer, loop_producers = self._prepare_evict(
            scheduler, device_tokens, host_tokens, after, priority, _NOT_CAPTURED, on_loop=False,
            indices_after=indices_after)
        check = HostCheck.NONE if host_tokens is None else HostCheck.ALLOCATED
        self._inbox.post(PostedRequest(transfer._request, loop_producers, check,
                                       releases_seen=releases_seen))
        return transfer

    def prefetch_threadsafe(self, host: HostPages | None, device_tokens, *, host_tokens=None,
                            after=None, indices_after=None, deadline_s: float | None = None,
                            priority: int = 0) -> Transfer:
        """:meth:`prefetch` from a thread without an event loop, as :meth:`evict_threadsafe`.

        A ``host`` handle that is not a live allocation of this service (or whose release was
        already posted) raises here; one released on the loop while this call ran fails the
        transfer (``UnknownHostPagesError``), as ``host_tokens`` outside live allocations do
        (a release on the loop after this call takes this request first and is refused while
        it uses the pages). ``deadline_s`` counts from this call, on the loop's clock. Safe on
        any thread; does not block (a short lock).
        """
        scheduler = self._running()
        releases_seen = self._releases_so_far()
        transfer, loop_producers = self._prepare_prefetch(
            scheduler, host, device_tokens, host_tokens, after, deadline_s, priority,
            _NOT_CAPTURED, on_loop=False, indices_after=indices_after)
        check = HostCheck.ALLOCATED if host is None else HostCheck.HANDLE
        self._inbox.post(PostedRequest(transfer._request, loop_producers, check, host,
                                       releases_seen))
        return transfer

    def _releases_so_far(self) -> int:
        """The pool's release count, read on a submitting thread before it names host pages
        (one attribute read)."""
        pool = self._pool  # read once: close() may detach it meanwhile
        if pool is None:
            raise ServiceClosedError("the service is closing or closed")
        return pool.releases

    def release_threadsafe(self, host: HostPages) -> None:
        """:meth:`release` from a thread without an event loop, without waiting for the loop.

        Raises here (changing nothing) for a handle that is not a live allocation of this
        service held by the caller, or whose release was already posted. The release reaches
        the loop in the same batched hand-off as requests (after this thread's earlier
        submissions); pages still used by a queued or running copy return to the pool once the
        last such copy ends (never refused, since that could not raise here). From this call
        on the handle is released: do not use it again. Safe on any thread; does not block
        (a short lock).
        """
        scheduler = self._running()
        _check_handle(host)
        self._inbox.post_release(host, scheduler.check_releasable)

    @property
    def thread_wakeups(self) -> int:
        """How many loop wake-ups the ``*_threadsafe`` methods have cost so far: one per batch
        of hand-offs, not one per call (for tests and the bench). Any thread."""
        return self._inbox.wakeups if self._inbox is not None else 0

    def _accept_posted(self, posted: PostedRequest) -> None:
        """Loop side of the ``*_threadsafe`` methods: accept a request prepared on a thread,
        or end it (cancelled meanwhile; host pages that are not the caller's)."""
        scheduler = self._scheduler
        request = posted.request
        request.renumber()  # queue order follows acceptance order
        request.state = QUEUED
        if request.deadline != NO_DEADLINE:  # posted as seconds from its submission
            request.deadline += self._loop.time() - (time.perf_counter() - request.submitted_at)
        error = None
        try:
            if posted.host_check is HostCheck.HANDLE:
                scheduler.check_releasable(posted.handle)
            elif posted.host_check is HostCheck.ALLOCATED:
                scheduler.check_host_tokens(request.host_pages, "host_tokens")
                page = self._pool.first_released_since(request.host_pages,
                                                       posted.releases_seen)
                if page is not None:
                    raise UnknownHostPagesError(
                        f"host_tokens names host page {page}, which was released while this "
                        f"request was on its way from its thread (and may hold another "
                        f"allocation's data now); submit with pages of an allocation that "
                        f"stays held until the transfer ends")
        except UnknownHostPagesError as exc:
            error = exc
        if error is None and not request.cancel_requested:
            self._accept(scheduler, request, posted.loop_producers)
            return
        scheduler.accept(request)  # through the page table, so that ending it retires it
        if error is None:
            scheduler.finish(request, CANCELLED)
        else:
            scheduler.finish(request, FAILED, error=error)

    def _take_posted_release(self, host: HostPages) -> None:
        scheduler = self._scheduler
        scheduler.release_posted_host(host)
        scheduler.schedule_flush()  # evictions waiting for space may go now; gauges follow

    # --- the two halves of a submission ---------------------------------------------------

    def _prepare_evict(self, scheduler: Scheduler, device_tokens, host_tokens, after: object,
                       priority: int, captured: object, *, on_loop: bool,
                       indices_after: object = None) -> tuple[Transfer, tuple[object, ...]]:
        """Validate and prepare an eviction (see :meth:`_prepare`). Any thread."""
        on_device = self._on_device(device_tokens)
        if host_tokens is None:
            device_pages, padding, num_pages = self._device_side(device_tokens, on_device)
            if num_pages > self._capacity_pages:
                raise HostPoolExhausted(
                    f"evict() of {num_pages} pages can never fit: the host pool holds "
                    f"{self._capacity_pages} pages in all; evict at most that many per "
                    f"request (split it), or raise ServiceConfig.host_pool")
            host_pages, owns = None, True
        elif on_device is None:
            host_pages, device_pages, padding = self._paired(host_tokens, device_tokens, on_loop)
            owns = False
        else:
            host_pages = self._host_pages_for(on_device, host_tokens, on_loop)
            device_pages, padding, owns = _EMPTY, 0, False
        return self._prepare(scheduler, D2H, device_pages, host_pages, owns,
                             after, priority, NO_DEADLINE, padding, captured, on_loop, on_device,
                             indices_after)

    def _device_side(self, device_tokens, on_device: OnDevice | None
                     ) -> tuple[PageSeq, int, int]:
        """Device pages, padding tokens and page count of ``device_tokens`` (no pages yet for
        indices the engine reads later). Any thread."""
        if on_device is not None:
            return _EMPTY, 0, on_device.num_pages
        device_pages, padding = tokens_to_page_seq(
            device_tokens, "device_tokens", self._device_token_bound, self._page_size_tokens)
        return device_pages, padding, len(device_pages)

    def _on_device(self, device_tokens) -> OnDevice | None:
        """For device indices the engine reads later: what their shape says (device_indices.py);
        ``None`` for indices read here. Any thread; reads no values."""
        if (type(device_tokens) is torch.Tensor and not self._engine_defers_indices
                and device_tokens.is_cpu):
            return None  # the common case, read here: no further look
        engine = self._engine
        if engine is None:  # a thread that raced close()
            raise ServiceClosedError("the service is closing or closed")
        return deferred_form(device_tokens, engine, self._page_size_tokens)

    def _host_pages_for(self, on_device: OnDevice, host_tokens, on_loop: bool) -> PageSeq:
        """Host pages paired in order with device pages the engine reads later; on the loop
        also checked to lie in live allocations. Any thread."""
        host_pages = paired_host_pages(on_device, host_tokens, self._host_token_bound,
                                       self._page_size_tokens)
        if on_loop:
            self._scheduler.check_host_tokens(host_pages, "host_tokens")
        return host_pages

    def _paired(self, host_tokens, device_tokens, on_loop: bool
                ) -> tuple[PageSeq, PageSeq, int]:
        """Host and device pages of explicit token pairs, checked to share in-page offsets;
        on the loop also that the host pages lie in live allocations (from a thread the loop
        checks that when it accepts the request). Any thread."""
        host_pages, device_pages, padding = paired_page_seqs(
            host_tokens, device_tokens, host_bound=self._host_token_bound,
            device_bound=self._device_token_bound, page_size_tokens=self._page_size_tokens)
        if on_loop:
            self._scheduler.check_host_tokens(host_pages, "host_tokens")
        return host_pages, device_pages, padding

    def _prepare_prefetch(self, scheduler: Scheduler, host: HostPages | None, device_tokens,
                          host_tokens, after: object, deadline_s: float | None, priority: int,
                          captured: object, *, on_loop: bool, indices_after: object = None
                          ) -> tuple[Transfer, tuple[object, ...]]:
        """Validate and prepare a prefetch (see :meth:`_prepare`). Any thread."""
        if host is not None and host_tokens is not None:
            raise IndexValueError("pass a HostPages handle or host_tokens=, not both")
        if host is None and host_tokens is None:
            raise IndexValueError("prefetch needs the host side: a HostPages handle (from an "
                                  "eviction or allocate_host_pages) or host_tokens=")
        on_device = self._on_device(device_tokens)
        if host is not None:
            if not isinstance(host, HostPages):
                raise IndexTypeError(
                    f"host must be a HostPages handle, got {type(host).__name__}; "
                    + ("host pages given as Pages go in host_tokens=: pass "
                       "prefetch(None, device_tokens, host_tokens=Pages(...))"
                       if isinstance(host, Pages) else
                       "a bare tensor is ambiguous (tokens or pages?): pass host_tokens=tensor "
                       "instead"))
            device_pages, padding, num_pages = self._device_side(device_tokens, on_device)
            if not on_loop and self._engine is None:  # a thread that raced close()
                raise ServiceClosedError("the service is closing or closed")
            # The caller's live allocation, not pages the service took over (a backup it
            # placed that failed or was cancelled, a handle released while copies used it).
            # Two lookups, safe off the loop; the loop checks again when it accepts.
            scheduler.check_releasable(host)
            self._inbox.refuse_if_release_posted(host)  # the loop has not taken it yet
            if num_pages != host.num_pages:
                raise IndexValueError(
                    f"device_tokens cover {num_pages} pages but {host!r} holds "
                    f"{host.num_pages}; a prefetch pairs them page by page in order")
            host_pages = host.page_seq
        elif on_device is None:
            host_pages, device_pages, padding = self._paired(host_tokens, device_tokens, on_loop)
        else:
            host_pages = self._host_pages_for(on_device, host_tokens, on_loop)
            device_pages, padding = _EMPTY, 0
        deadline = _deadline_offset_s(deadline_s)
        if deadline != NO_DEADLINE and on_loop:
            # On a thread, seconds from submission: the loop's clock is read on the loop.
            deadline += self._loop.time()
        return self._prepare(scheduler, H2D, device_pages, host_pages, False,
                             after, priority, deadline, padding, captured, on_loop, on_device,
                             indices_after)

    def _prepare(self, scheduler: Scheduler, direction: Direction, device_pages: PageSeq,
                 host_pages: PageSeq | None, owns_host: bool, after: object, priority: int,
                 deadline: float, padding: int, captured: object, on_loop: bool,
                 on_device: OnDevice | None = None, indices_after: object = None
                 ) -> tuple[Transfer, tuple[object, ...]]:
        """The first half of a submission, on the submitting thread (the loop's or another):
        check the priority and the queue bound, parse ``after=``, capture the default
        producer, and build the request and its ``Transfer``; for device indices the engine
        reads (``on_device``), queue their copy to the host after the producers. Raises,
        changing nothing; never blocks. Returns the transfer and the loop producers
        :meth:`_accept` watches."""
        if type(priority) is not int:
            priority = int_argument("priority", priority)
        num_pages = len(device_pages) if on_device is None else on_device.num_pages
        # The queue bound, counted with what threads posted (thread_submit.py); an empty
        # request ends at once, done: it never queues, so the bound does not apply to it.
        if num_pages and on_loop:
            self._inbox.admit_on_loop()
        elif num_pages:  # refused early here; checked again as it is posted
            self._inbox.check_room()
        engine = self._engine
        if engine is None:  # a thread that raced close()
            raise ServiceClosedError("the service is closing or closed")
        producers = NO_PRODUCERS if after is None else parse_after(
            after, engine=engine, scheduler=scheduler, loop=self._loop)
        index_producers = None if indices_after is None else parse_indices_after(
            indices_after, engine=engine)
        if on_loop and producers.deps and any(dep.state is POSTED for dep in producers.deps):
            self._take_handoffs_first(scheduler, host_pages, owns_host)
        # Every copy also waits for the submitting thread's work so far (CUDA: its current
        # stream), captured here, on that thread, before any hand-off to the loop.
        if captured is _NOT_CAPTURED:
            captured = engine.capture_producer()
        engine_producers = producers.engine if captured is None else (captured, *producers.engine)
        if on_device is not None:  # the last step that can raise: nothing to undo after it
            if index_producers is None:  # the values wait for whatever the copy waits for
                index_producers = engine_producers
            elif captured is not None:
                index_producers = (captured, *index_producers)
            indices = DeviceIndices(
                on_device.form, num_pages, self._page_size_tokens, self.device_pages,
                "device_tokens", engine.stage_indices(on_device.tensor, index_producers))
        future = self._loop.create_future()  # only built here; resolved on the loop
        request = Request(direction, device_pages, host_pages, owns_host, engine_producers,
                          priority, deadline, padding, num_pages * scheduler.bytes_per_page,
                          future)
        if on_device is not None:
            request.device_indices = indices
            request.num_pages = num_pages
        if not on_loop:
            request.state = POSTED
        if producers.deps:  # after those requests' copies, and only if they succeed
            request.follow((dep, True) for dep in producers.deps)
        return Transfer(request, scheduler), producers.loop

    def _take_handoffs_first(self, scheduler: Scheduler, host_pages: PageSeq | None,
                             owns_host: bool) -> None:
        """A loop submission that names in ``after=`` a Transfer a thread handed over and the
        loop has not taken yet takes the threads' hand-offs first (they were made before it):
        that request is then in the page table before this one, which follows it, instead of
        the two waiting for each other. Before anything is staged for the copy, so that a
        refusal here (a release just taken freed host pages this request names) wastes
        nothing."""
        self._inbox.drain()
        if host_pages is not None and not owns_host:
            scheduler.check_host_tokens(host_pages, "host pages")

    @staticmethod
    def _accept(scheduler: Scheduler, request: Request, loop_producers: tuple[object, ...]
                ) -> None:
        """The second half of a submission, on the loop: queue the prepared request (an empty
        one ends at once, done). Does not block."""
        if request.num_pages == 0:  # an empty request is a no-op, not an error
            scheduler.finish(request, DONE, result=TransferResult(
                request.direction, 0, 0, request.padding_tokens, 0.0, None))
        else:
            scheduler.accept(request, loop_producers)

    def release(self, host: HostPages) -> None:
        """Return host pages to the pool now. Raises ``PagesInFlightError`` (changing nothing)
        while a copy reads or writes them, ``UnknownHostPagesError`` for a stale handle. Loop
        thread (``WrongThreadError`` elsewhere: threads use :meth:`release_threadsafe`).

        Requests that threads handed over before this call are taken first, so a copy a
        thread submitted into these pages refuses the release as a loop submission does
        (without that, its pages could be allocated anew before it ran, and it would copy
        into or out of the new owner's pages)."""
        scheduler = self._running_here("release()", "use release_threadsafe() there")
        _check_handle(host)
        self._inbox.drain()
        self._inbox.release_here(host, scheduler.release_host)  # or a thread's release won
        scheduler.schedule_flush()  # evictions waiting for space may go now; gauges follow

    def allocate_host_pages(self, num_pages: int) -> HostPages:
        """Take ``num_pages`` host pages for callers that manage host slots themselves. Loop
        thread (``WrongThreadError`` elsewhere: a thread calls it through
        :meth:`call_threadsafe`)."""
        self._running_here("allocate_host_pages()",
                           "call it through call_threadsafe(service.allocate_host_pages, n)")
        num_pages = int_argument("num_pages", num_pages)
        if num_pages <= 0:
            raise ArgumentValueError(f"num_pages must be at least 1, got {shown(num_pages)}")
        handle = self._pool.allocate(num_pages)
        if handle is None:
            stats = self._pool.statistics()
            raise HostPoolExhausted(
                f"allocate_host_pages({shown(num_pages)}): needed {shown(num_pages)} pages, free "
                f"{stats.free_pages}, capacity {stats.capacity_pages}; release host pages or "
                f"raise ServiceConfig.host_pool")
        self._scheduler.publish_state()
        return handle

    def statistics(self) -> ServiceStatistics:
        """A frozen snapshot of current state, consistent because it is taken on the loop
        thread (``WrongThreadError`` elsewhere: a thread reads it through
        ``call_threadsafe(service.statistics)``); ``queued_requests`` counts requests threads
        handed over that the loop has not taken yet."""
        self._running_here("statistics()", "read it through call_threadsafe(service.statistics)")
        stats = self._pool.statistics()
        return ServiceStatistics(
            capacity_pages=stats.capacity_pages, used_pages=stats.used_pages,
            free_pages=stats.free_pages, largest_free_extent_pages=stats.largest_free_extent_pages,
            in_flight_pages=self._scheduler.hazards.busy_host_pages,
            ledger_bytes=self._reservation.reserved_bytes if self._reservation else 0,
            queued_requests=self._inbox.requests_waiting(),  # threads' hand-offs too
            inflight_requests=self._scheduler.inflight_requests)

    def call_threadsafe(self, method: Callable[..., object], *args: object, **kwargs: object
                        ) -> concurrent.futures.Future:
        """From another thread (e.g. the forward pass): run ``method(*args, **kwargs)`` — one of
        this service's request methods, or any callable that calls them — on the loop; the
        future holds its return value. The default producer of every request it submits is
        this thread's work up to this call (CUDA: an event on its current stream, recorded
        here); does not block. Once the service is closed it raises ``ServiceClosedError``,
        and a call its loop had not run by then fails with it: no future is left pending."""
        if self._loop is None:
            raise ServiceClosedError("the service has not started")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._calls_lock:
            if self._calls_ended:
                raise ServiceClosedError("the service is closed: it runs no more calls")
            self._calls_waiting.add(future)
        # A request's default producer is the calling thread's work (CUDA: its current
        # stream): capture it here, not on the loop thread that runs the method. Whatever the
        # callable (a bound method, a partial, a lambda, a subclass's override), it may
        # submit, except the calls below, which never do (a statistics poll records no event).
        engine = self._engine
        captured = (engine.capture_producer()
                    if engine is not None
                    and getattr(method, "__func__", None) not in _NEVER_SUBMIT
                    else _NOT_CAPTURED)

        def run() -> None:
            with self._calls_lock:
                if future not in self._calls_waiting:
                    return  # the service closed first and failed it
                self._calls_waiting.discard(future)
            if future.set_running_or_notify_cancel():
                self._captured = captured
                try:
                    future.set_result(method(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
                finally:
                    self._captured = _NOT_CAPTURED

        try:
            self._loop.call_soon_threadsafe(run)
        except BaseException as exc:
            with self._calls_lock:
                self._calls_waiting.discard(future)
            if isinstance(exc, RuntimeError) and self._loop.is_closed():
                raise ServiceClosedError("the service's event loop is closed: it runs no more "
                                         "calls") from None
            raise
        return future

    def _end_threadsafe_calls(self) -> None:
        """Once closed: refuse new ``call_threadsafe`` calls and fail those the loop has not
        run (a loop that stops after ``close()`` may never run them). Loop thread."""
        with self._calls_lock:
            self._calls_ended = True
            waiting, self._calls_waiting = self._calls_waiting, set()
        for future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(ServiceClosedError(
                    "the service closed before its loop ran this call"))


#: Bound methods ``call_threadsafe`` runs that never submit a request: no producer is captured
#: for them (on CUDA each capture records an event on the caller's stream).
_NEVER_SUBMIT = frozenset({OffloadService.statistics, OffloadService.release,
                           OffloadService.allocate_host_pages, Transfer.cancel,
                           Transfer.add_done_callback})


def _deadline_offset_s(deadline_s: object) -> float:
    """``deadline_s`` as float seconds from now (``NO_DEADLINE`` for None); refuses a
    non-number, and NaN, infinities and integers too large for a float."""
    if deadline_s is None:
        return NO_DEADLINE
    if not is_real_number(deadline_s):
        raise ArgumentTypeError(f"deadline_s must be a finite number of seconds or None, "
                                f"got {shown(deadline_s)} ({type(deadline_s).__name__})")
    offset_s = as_float(deadline_s)
    if not math.isfinite(offset_s):
        raise ArgumentValueError(f"deadline_s must be a finite number of seconds or None, "
                                 f"got {shown(deadline_s)}; pass None for no deadline")
    return offset_s


def _check_handle(host: object) -> None:
    """Raise ``ArgumentTypeError`` unless ``host`` is a ``HostPages`` handle."""
    if not isinstance(host, HostPages):
        raise ArgumentTypeError(
            f"release takes the HostPages handle of an allocation (a backup's "
            f"result.host_pages, or allocate_host_pages()), got {type(host).__name__}")
