"""The hand-off from threads without an event loop (a server's scheduler or forward-pass
threads) to the service's loop.

Such a thread prepares each request itself, on its own thread (validation, padding, capture of
its default producer: every error raises there), then posts it here; host-page releases are
posted the same way. The loop takes what was posted in batches: at most one
``call_soon_threadsafe`` wake-up is pending at a time, however many threads post how many
items, so a burst of submissions costs the loop one wake-up, not one per request. Items are
taken in post order, so one thread's requests are accepted in the order it submitted them.

Ordering against the loop: a drain that takes an item is in the loop's ready queue before the
``post`` that made it returns, so every callback the posting thread schedules on the loop
afterwards (``call_soon_threadsafe``, a finished ``asyncio.to_thread`` or executor future,
``call_threadsafe``) runs after the item was taken.

Once :meth:`ThreadInbox.close` ran (the service is closing), ``post`` raises
``ServiceClosedError`` in the posting thread; what was posted before was taken by ``close``.

The queue bound (``ServiceConfig.max_queued_requests``) counts queued requests, requests posted
and not taken yet, and a loop submission being admitted; it is checked under the posters' lock
by threads (as they post) and by the loop (as it submits), so concurrent submitters never pass
it together. The loop updates its side without the lock, in an order that lets a concurrent
reader count requests twice for a moment (while the loop takes a batch of them: a refusal can
come that much early, never late), never miss one.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import threading
from collections.abc import Callable

from ..errors import QueueFullError, ServiceClosedError, UnknownHostPagesError
from ..host_memory.pool import HostPages
from ..scheduling.request import Request


class HostCheck(enum.Enum):
    """What the loop checks about a posted request's host pages before accepting it: the pool
    belongs to the loop, and these checks read structures the loop changes."""

    NONE = "none"  #: service-chosen host pages: nothing to check
    ALLOCATED = "allocated"  #: ``host_tokens=``: every page lies in a live allocation
    HANDLE = "handle"  #: a ``HostPages`` handle: still the caller's (not released meanwhile)


class PostedRequest:
    """A request prepared on a thread, waiting to be accepted on the loop."""

    __slots__ = ("request", "loop_producers", "host_check", "handle", "releases_seen",
                 "counted")

    def __init__(self, request: Request, loop_producers: tuple[object, ...],
                 host_check: HostCheck, handle: HostPages | None = None,
                 releases_seen: int = 0) -> None:
        self.request = request
        self.loop_producers = loop_producers  #: asyncio futures / events, watched on the loop
        self.host_check = host_check
        self.handle = handle  #: the prefetch's handle, for ``HostCheck.HANDLE``
        #: the pool's release count when the thread began the call, for
        #: ``HostCheck.ALLOCATED``: pages released after it changed hands under the request
        self.releases_seen = releases_seen
        #: counts against the queue bound: an empty request never queues (it ends as taken)
        self.counted = request.num_pages != 0


class ThreadInbox:
    """Posted requests and releases, taken on the loop in post order, in batches.

    ``accept(posted)`` and ``take_release(handle)`` run on the loop thread; neither should
    raise (a request that cannot be accepted is ended, failed or cancelled, by ``accept``); an
    exception is reported to the loop's exception handler and the next item is taken.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 accept: Callable[[PostedRequest], None],
                 take_release: Callable[[HostPages], None],
                 queued_requests: Callable[[], int] = lambda: 0,
                 max_queued_requests: int | None = None) -> None:
        """``queued_requests()``: the loop's queued requests (read from any thread);
        ``max_queued_requests``: the queue bound (None: no bound)."""
        self._loop = loop
        self._queued_requests = queued_requests
        self._max_queued_requests = max_queued_requests
        self._accept = accept
        self._take_release = take_release
        self._items: collections.deque[PostedRequest | HostPages] = collections.deque()
        self._lock = threading.Lock()  # posters only (and close): never held by a drain
        self._scheduled = False  # a drain is in the loop's ready queue
        self._closed = False
        self._releasing: set[int] = set()  # allocation ids posted for release, not taken yet
        # Requests posted (threads, under the lock) and taken (the loop, after accepting each):
        # two counters that only grow, each with one kind of writer, so no update is lost.
        self._posted_requests = 0
        self._taken_requests = 0
        self._loop_admitting = False  #: a loop submission passed the bound and is being queued
        #: ``call_soon_threadsafe`` wake-ups used so far (one per batch; tests and the bench)
        self.wakeups = 0

    def __len__(self) -> int:
        return len(self._items)

    def requests_waiting(self) -> int:
        """Requests that count against the queue bound: the loop's queued requests plus those
        posted and not taken yet plus a loop submission being admitted. Any thread, without
        the lock: may count one twice for a moment, never misses one (the loop counts each in
        its queues before it stops counting it here, and this reads here first)."""
        admitting = self._loop_admitting
        taken = self._taken_requests
        return self._queued_requests() + self._posted_requests - taken + admitting

    # --- any thread -----------------------------------------------------------------------

    def check_room(self) -> None:
        """Raise ``QueueFullError`` if the queue bound is reached now (see :func:`queue_full`).
        Any thread, without the lock: an early refusal, before a thread prepares a request;
        :meth:`post` checks again under the lock."""
        bound = self._max_queued_requests
        if bound is not None and (waiting := self.requests_waiting()) >= bound:
            raise queue_full(waiting, bound)

    def post(self, posted: PostedRequest) -> None:
        """Hand ``posted`` to the loop unless the queue bound is reached (``QueueFullError``;
        an empty request, which never queues, is not bound). Never blocks (a short lock);
        raises ``ServiceClosedError`` once the inbox is closed. Either way a refusal hands
        nothing over."""
        with self._lock:
            if posted.counted:
                self.check_room()
            self._append(posted)
            if posted.counted:
                self._posted_requests += 1

    def admit_on_loop(self) -> None:
        """The loop's bound check for a submission of its own: raises ``QueueFullError``, or
        marks the submission as being admitted (posting threads count it) until
        :meth:`end_loop_admission`. Loop thread; a short lock."""
        with self._lock:
            self.check_room()
            self._loop_admitting = True

    def end_loop_admission(self) -> None:
        """The loop submission marked by :meth:`admit_on_loop` is queued (or ended, or was
        refused). Loop thread."""
        self._loop_admitting = False

    def post_release(self, handle: HostPages, check: Callable[[HostPages], None]) -> None:
        """Hand the release of ``handle`` to the loop, after ``check(handle)`` (which raises
        for a handle that is not the caller's). A handle can be posted for release once only:
        posting threads check and post under the lock; the loop takes a release (the handle
        stops being the caller's) before it forgets the posting, and a poster looks at the
        postings before it checks the handle, so it always sees one or the other."""
        with self._lock:
            self._check_open()  # first: once closing, the pool may be gone
            self.refuse_if_release_posted(handle)
            check(handle)
            self._append(handle)
            self._releasing.add(handle.allocation_id)

    def release_here(self, handle: HostPages, release: Callable[[HostPages], None]) -> None:
        """The loop's own release of ``handle``: ``release(handle)`` unless a thread posted
        that release already (``UnknownHostPagesError``). Under the posters' lock, so that a
        thread releasing the same handle meanwhile sees it released, and only one wins."""
        with self._lock:
            self.refuse_if_release_posted(handle)
            release(handle)

    def refuse_if_release_posted(self, handle: HostPages) -> None:
        """Raise ``UnknownHostPagesError`` if the release of ``handle`` was posted and the loop
        has not taken it yet: the handle is no longer the caller's to use or release (one set
        lookup; any thread)."""
        if handle.allocation_id in self._releasing:
            raise UnknownHostPagesError(
                f"{handle!r} was already released (from a thread; its pages return to the pool "
                f"once no copy uses them); use a handle that is still held, and release each "
                f"handle once")

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceClosedError("the service is closing or closed; it takes no more "
                                     "requests or releases from threads")

    def _append(self, item: PostedRequest | HostPages) -> None:
        """With the lock held."""
        self._check_open()
        self._items.append(item)
        if self._scheduled:
            return
        # The flag is set before the wake-up is scheduled: scheduling it can let the loop run
        # that drain at once (it clears the flag and takes the item), and a flag set after it
        # would then claim a drain that no longer exists, stranding every later post.
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: nobody is left to take it
            self._scheduled = False
            self._items.pop()
            raise ServiceClosedError("the service's event loop is closed") from None
        self.wakeups += 1

    # --- loop thread ----------------------------------------------------------------------

    def drain(self) -> None:
        """Take everything posted before this drain began, in post order. Loop thread.

        The loop never takes the lock here: a poster that had to wait for it would give up the
        interpreter lock, and the two threads could then trade both locks once per item. A
        poster appends before it reads the flag, and the flag is cleared before anything is
        taken, so every item is taken by this drain or by the one its poster schedules. Items
        posted during the drain are left to that next drain: a thread that posts faster than
        the loop takes its posts cannot keep the loop in here (timers, close() and every
        other callback run in between)."""
        self._scheduled = False
        items = self._items
        for _ in range(len(items)):
            item = items.popleft()
            try:
                if type(item) is PostedRequest:
                    try:
                        self._accept(item)
                    finally:  # after accepting it: see requests_waiting
                        if item.counted:
                            self._taken_requests += 1
                else:
                    try:
                        self._take_release(item)
                    finally:  # after taking it: see post_release
                        self._releasing.discard(item.allocation_id)
            except Exception as exc:  # noqa: BLE001 - one broken item must not strand the rest
                self._loop.call_exception_handler({
                    "message": f"dsa_async: taking {item!r} posted from a thread raised",
                    "exception": exc,
                })

    def close(self) -> None:
        """Refuse further posts, then take what was posted. Loop thread."""
        with self._lock:
            self._closed = True
        self.drain()


def queue_full(waiting: int, max_queued_requests: int) -> QueueFullError:
    return QueueFullError(
        f"{waiting} requests are queued (or handed over from threads and not taken yet); the "
        f"bound (ServiceConfig.max_queued_requests) is {max_queued_requests}: await earlier "
        f"transfers before submitting more, or raise the bound")
