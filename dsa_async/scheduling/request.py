"""A request's life inside the service (``Request``), from acceptance to its end.

The caller's view of it is ``Transfer`` (completion). A request is loop-thread state, except the
marked fields that threads read to wait for its start or end without going through the loop.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from ..host_memory.pool import HostPages
from ..kinds import D2H, H2D, Direction
from ..paging.runs import PageSeq

if TYPE_CHECKING:
    from ..paging.device_indices import DeviceIndices
    from ..transfer.batch import BatchHandle

log = logging.getLogger("dsa_async.service")
_EMPTY = range(0)
#: Guards creating start and end waiters and a prefetch's per-layer timeliness marks.
WAITER_LOCK = threading.Lock()
_seq = itertools.count()


class RequestState(enum.Enum):
    POSTED = "posted"  #: prepared on a thread, handed to the loop, not yet accepted there
    QUEUED = "queued"  #: accepted, not yet given to the engine
    SUBMITTED = "submitted"  #: its copy is in the engine
    FINISHED = "finished"


POSTED, QUEUED = RequestState.POSTED, RequestState.QUEUED
SUBMITTED, FINISHED = RequestState.SUBMITTED, RequestState.FINISHED


class Request:
    """Internal state of one accepted request. Loop-thread only, except the marked fields."""

    __slots__ = (
        "seq", "direction", "host_pages", "device_pages", "num_pages", "host_handle", "owns_host",
        "after", "priority", "deadline", "submitted_at", "padding_tokens", "nbytes",
        "deps", "data_deps", "deps_left_queue", "handle", "batch_index", "state",
        "cancel_requested", "future", "started", "_start_waiter", "end_waiter", "layer_seen",
        "waiters", "loop_waits", "observed", "dropped", "device_indices", "count_wasted_at_end",
        "given_up_all_s", "gave_up_on_all", "given_up_layer_s", "__weakref__",
    )

    def __init__(self, direction: Direction, device_pages: PageSeq, host_pages: PageSeq | None,
                 owns_host: bool, after: tuple[object, ...], priority: int, deadline: float,
                 padding_tokens: int, nbytes: int, future: asyncio.Future) -> None:
        self.seq = next(_seq)
        self.direction = direction
        self.device_pages = device_pages
        self.num_pages = len(device_pages)
        self.host_pages = host_pages  # None until allocated (service-chosen host pages)
        self.host_handle: HostPages | None = None  # set when the service allocates host pages
        #: device pages not known until the engine reads them (a device index tensor on the
        #: GPU, device_indices.py); ``device_pages`` is then empty and ``num_pages`` is set
        self.device_indices: DeviceIndices | None = None
        self.owns_host = owns_host
        self.after = after  #: engine producers (normalized, captured on the submitting thread)
        self.loop_waits = 0  #: loop producers (asyncio futures/events) not finished yet
        self.observed = False  #: the caller looked at the outcome (awaited, result(), ...)
        self.dropped = False  #: its Transfer was collected before it ended: nobody can look
        #: a prefetch whose Transfer was collected before it ended: its loaded layers that no
        #: consumer used are counted as wasted when it ends
        self.count_wasted_at_end = False
        self.priority = priority
        self.deadline = deadline
        self.submitted_at = time.perf_counter()
        self.padding_tokens = padding_tokens
        self.nbytes = nbytes
        #: earlier requests this one follows, and whether it needs their data (hazards.py)
        self.deps: tuple[tuple[Request, bool], ...] = ()
        #: those of ``deps`` whose data it needs (it fails if one of them did not end done);
        #: usually none or one, so the checks made per pass over the queue stay short
        self.data_deps: tuple[Request, ...] = ()
        #: how many leading ``deps`` have left the queue (submitted or finished; they never
        #: come back), so each pass over the queue resumes after them (scheduler.py)
        self.deps_left_queue = 0
        self.handle: BatchHandle | None = None  # set on the loop; read by threads once `started`
        self.batch_index = 0  # position of this request's pages in its batch
        self.state = QUEUED
        self.cancel_requested = False
        self.future = future
        self.started = False  # `handle` exists, or the request ended before it could start
        self._start_waiter: threading.Event | None = None  # made only if a thread waits
        #: set when the request ends; made only if a thread waits for the end (Transfer.wait)
        self.end_waiter: threading.Event | None = None
        self.layer_seen: bytearray | None = None  # timeliness per layer, created lazily
        #: time consumers spent waiting for this prefetch and gave up (a timeout, a cancelled
        #: await) before the layers were ready: for all its layers (waits for the whole
        #: prefetch; observed once, with the first layers then used, which like every layer
        #: used after it count as late) and per layer (observed with that layer). So a
        #: consumer that polls with a timeout reads as late as one that blocks. WAITER_LOCK.
        self.given_up_all_s = 0.0
        self.gave_up_on_all = False
        self.given_up_layer_s: dict[int, float] | None = None
        self.waiters: list[asyncio.Future] | None = None  # one per task awaiting the Transfer

    def follow(self, deps) -> None:
        """Add ``deps`` (``(request, needs_data)`` pairs, none already followed) to what this
        request follows. Loop thread, or the submitting thread before the hand-off."""
        deps = tuple(deps)
        self.deps = (*self.deps, *deps)
        data = tuple(dep for dep, needs_data in deps if needs_data)
        if data:
            self.data_deps = (*self.data_deps, *data)

    def mark_started(self) -> None:
        """Loop side: the copy was submitted, or the request ended. Wakes waiting threads.

        Lock-free on the loop: ``started`` is set before the waiter is read, and a waiting
        thread reads ``started`` again after publishing its waiter, so one of the two always
        sees the other (the interpreter orders these attribute accesses)."""
        self.started = True
        waiter = self._start_waiter
        if waiter is not None:
            waiter.set()

    def wait_started(self, timeout_s: float | None) -> bool:
        """Thread side: block until :meth:`mark_started`; ``False`` on timeout."""
        if self.started:
            return True
        with WAITER_LOCK:  # threads agree on one waiter
            if self._start_waiter is None:
                self._start_waiter = threading.Event()
            waiter = self._start_waiter
        if self.started:  # it started while the waiter was being published
            return True
        return waiter.wait(timeout_s)

    def mark_ended(self) -> None:
        """Loop side, once the future is resolved: wake threads waiting for the start or the
        end. Lock-free for the same reason as :meth:`mark_started` (the future is resolved
        before the end waiter is read; a waiting thread looks at the future again after
        publishing its waiter)."""
        if not self.started:
            self.mark_started()
        waiter = self.end_waiter
        if waiter is not None:
            waiter.set()

    def wait_ended(self, timeout_s: float | None) -> bool:
        """Thread side: block until the request ended (its future is resolved); ``False`` on
        timeout."""
        if self.future.done():
            return True
        with WAITER_LOCK:  # threads agree on one waiter
            if self.end_waiter is None:
                self.end_waiter = threading.Event()
            waiter = self.end_waiter
        if self.future.done():  # it ended while the waiter was being published
            return True
        return waiter.wait(timeout_s)

    def give_up_wait(self, layer: int | None, waited_s: float) -> None:
        """A consumer stopped waiting for ``layer`` (``None``: the whole prefetch) after
        ``waited_s`` without it being ready. Any thread."""
        if waited_s <= 0.0:
            return
        with WAITER_LOCK:
            if layer is None:
                self.given_up_all_s += waited_s
                self.gave_up_on_all = True
            else:
                if self.given_up_layer_s is None:
                    self.given_up_layer_s = {}
                self.given_up_layer_s[layer] = self.given_up_layer_s.get(layer, 0.0) + waited_s

    def take_given_up(self, layers) -> tuple[float, bool]:
        """With WAITER_LOCK held, as ``layers`` are first used: the given-up wait not yet
        observed that belongs to them (taken: it is observed once), and whether any consumer
        gave up waiting for them (then they count as late even with nothing left to
        observe)."""
        waited_s, self.given_up_all_s = self.given_up_all_s, 0.0
        late = self.gave_up_on_all
        own = self.given_up_layer_s
        if own:
            for layer in layers:
                layer_s = own.pop(layer, None)
                if layer_s is not None:
                    waited_s += layer_s
                    late = True
        return waited_s, late

    def take_unseen_loaded_layers(self) -> int:
        """How many layers this prefetch's copy loaded that no consumer waited for or awaited,
        marking them seen so that they count once (the wasted layers). Any thread."""
        handle = self.handle
        if self.direction is not H2D or handle is None:
            return 0
        loaded = handle.layers_ready
        with WAITER_LOCK:
            if self.layer_seen is None:
                self.layer_seen = bytearray(handle.num_layers)
            seen = self.layer_seen
            loaded = min(loaded, len(seen))
            unseen = loaded - sum(seen[:loaded])
            seen[:loaded] = b"\x01" * loaded
        return unseen

    def renumber(self) -> None:
        """Take the next submission number: a request prepared on a thread is numbered when
        the loop accepts it, so queue order follows acceptance order. Loop thread."""
        self.seq = next(_seq)

    def sort_key(self) -> tuple:
        """Queue order: prefetches by earliest deadline, then highest priority; backups by
        highest priority; then submission order."""
        if self.direction is H2D:
            return (self.deadline, -self.priority, self.seq)
        return (-self.priority, self.seq)

    def goes_before(self, other: Request) -> bool:
        """Whether this request (submitted later) must be queued before ``other``."""
        if self.direction is H2D and self.deadline != other.deadline:
            return self.deadline < other.deadline
        return self.priority > other.priority

    def read_and_write_pages(self) -> tuple[PageSeq, PageSeq]:
        host = self.host_pages if self.host_pages is not None else _EMPTY
        if self.direction is D2H:
            return self.device_pages, host
        return host, self.device_pages


def report_unobserved(request: Request, error: BaseException) -> None:
    """Log a failure that no caller will see (its Transfer is gone or was never looked at)."""
    try:
        log.error("%s request %d (%d pages) failed and nobody looked at its Transfer: %r",
                  request.direction.value, request.seq, request.num_pages, error, exc_info=error)
    except Exception:  # noqa: BLE001 - at interpreter exit logging may be gone
        pass


NO_DEADLINE = math.inf
