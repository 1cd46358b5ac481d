"""Helper threads that share one batch's small strided copies with the thread issuing them.

torch runs a copy of fewer than ``SERIAL_ELEMENTS`` elements on the calling thread alone; only
larger ones are split across its intra-op threads. Single scattered pages through a fused 3-D
device view are many such copies (one page across a group of layers each), so issued from one
thread they use one core's memory bandwidth. A crew splits them: the issuing thread copies one
share and each helper another, using as many cores as torch would for one large copy, without
touching torch's thread settings (they belong to the host process). torch releases the GIL
inside each copy, so only the Python between copies is serialized.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

#: torch copies fewer elements than this on the calling thread (``at::internal::GRAIN_SIZE``).
SERIAL_ELEMENTS = 32_768
#: Threads per crew at most (the issuing thread included): page copies are bound by memory
#: bandwidth, which a few cores saturate.
MAX_CREW_THREADS = 4

T = TypeVar("T")


class CopyCrew:
    """The issuing thread plus ``helpers`` threads, for one engine worker (never shared).

    ``map`` blocks the calling thread until every share is done; ``close`` stops the helpers.
    """

    def __init__(self, helpers: int, name: str) -> None:
        assert helpers >= 0
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(helpers)]
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        try:
            for i, inbox in enumerate(self._inboxes):
                thread = threading.Thread(target=self._serve, args=(inbox,),
                                          name=f"{name}-{i + 1}", daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.close()  # the helpers that did start
            raise

    @property
    def size(self) -> int:
        """Threads that copy in :meth:`map`, the calling one included (1 once closed)."""
        return len(self._threads) + 1

    def map(self, fn: Callable[[Sequence[T]], None], items: Sequence[T]) -> None:
        """Call ``fn`` on contiguous shares of ``items``: the first on this thread, one on each
        helper (fewer shares for few items). Returns once every share returned, so nothing is
        still writing when it does; then raises the first error any share raised. Blocks."""
        shares = min(self.size, len(items))
        if shares <= 1:
            fn(items)
            return
        bounds = [len(items) * i // shares for i in range(shares + 1)]
        for inbox, lo, hi in zip(self._inboxes, bounds[1:-1], bounds[2:]):
            inbox.put((fn, items[lo:hi]))
        error: BaseException | None = None
        try:
            fn(items[:bounds[1]])
        except BaseException as exc:  # noqa: BLE001 - raised below, once the helpers are done
            error = exc
        for _ in range(shares - 1):
            outcome = self._results.get()
            if error is None:
                error = outcome
        if error is not None:
            raise error

    def stream(self, fn: Callable[[int], None], count: int,
               reached: Callable[[int], None]) -> None:
        """Call ``fn(i)`` for every ``i`` in ``range(count)``: item ``i`` on thread
        ``i % size`` (this thread takes the multiples of ``size``), each thread through its
        items in order without waiting for the others between items (no lockstep: a thread
        that lags one item does not hold the others back). ``reached(n)`` is called on this
        thread, ``n`` increasing, once the first ``n`` items have all returned (this thread
        sees the others' items as it finishes each of its own, and once its own are done, as
        they come), last with ``n == count`` when nothing failed.

        When item ``k`` raises, no thread starts an item after ``k``, every item before ``k``
        still runs and is reached, and once every thread stopped (nothing is still writing)
        the error of the lowest failed item is raised, as a serial loop would have raised it.
        An error from ``reached`` stops every thread and is raised. Blocks."""
        shares = min(self.size, count)
        if shares <= 1:
            for i in range(count):
                fn(i)
                reached(i + 1)
            return
        run = _Stream(fn, count)
        for k, inbox in enumerate(self._inboxes[:shares - 1], 1):
            inbox.put((run.share, range(k, count, shares)))
        finished = bytearray(count)
        prefix, running = 0, shares - 1

        def take(event: object) -> None:
            nonlocal running
            if event is _END:
                running -= 1
            else:
                finished[event] = 1

        def advance() -> None:
            nonlocal prefix
            if run.stop_at < 0 or prefix == count or not finished[prefix]:
                return
            while prefix < count and finished[prefix]:
                prefix += 1
            try:
                reached(prefix)
            except BaseException as exc:  # noqa: BLE001 - raised once the helpers stopped
                run.fail(-1, exc)

        for i in range(0, count, shares):
            if i >= run.stop_at:
                break
            try:
                fn(i)
            except BaseException as exc:  # noqa: BLE001 - as above
                run.fail(i, exc)
                break
            finished[i] = 1
            while True:
                try:
                    take(run.events.get_nowait())
                except queue.Empty:
                    break
            advance()
        while running:
            take(run.events.get())
            advance()
        for _ in range(shares - 1):
            self._results.get()  # each share's own ending (its errors are in ``run``)
        if run.errors:
            raise run.errors[min(run.errors)]

    def close(self) -> None:
        """Stop the helpers (after the share they are copying, if any). Blocks; a second call
        returns at once."""
        threads, self._threads = self._threads, []
        for inbox, _thread in zip(self._inboxes, threads):
            inbox.put(None)
        for thread in threads:
            thread.join()

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (job := inbox.get()) is not None:
            fn, share = job
            try:
                fn(share)
                outcome = None
            except BaseException as exc:  # noqa: BLE001 - handed to the issuing thread
                outcome = exc
            self._results.put(outcome)


#: A streamed share's last event: it stopped (all its items done, or told to stop).
_END = object()


class _Stream:
    """The state one :meth:`CopyCrew.stream` call shares with its helpers."""

    __slots__ = ("_fn", "_lock", "stop_at", "errors", "events")

    def __init__(self, fn: Callable[[int], None], count: int) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        #: no item from this one on starts: the lowest failed item (-1: ``reached`` failed)
        self.stop_at = count
        self.errors: dict[int, BaseException] = {}  # by failed item (-1: ``reached``)
        #: a helper's finished items, then ``_END``, for the calling thread
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def fail(self, item: int, error: BaseException) -> None:
        with self._lock:
            self.errors[item] = error
            self.stop_at = min(self.stop_at, item)

    def share(self, items: range) -> None:
        """A helper's items, in order, each posted once it returned; ends with ``_END``."""
        try:
            for i in items:
                if i >= self.stop_at:
                    break
                try:
                    self._fn(i)
                except BaseException as exc:  # noqa: BLE001 - raised by the calling thread
                    self.fail(i, exc)
                    break
                self.events.put(i)
        finally:
            self.events.put(_END)


def crew_threads(intra_op_threads: int) -> int:
    """Crew size for a process whose torch uses ``intra_op_threads``: as many threads as torch
    would use for one large copy, at most ``MAX_CREW_THREADS``."""
    return max(1, min(intra_op_threads, MAX_CREW_THREADS))
