"""One thread-safe hand-off from copy threads to the event loop.

Worker and completion threads ``post`` callbacks; the loop runs them in batches. At most one
``call_soon_threadsafe`` wake-up is pending at a time, however many completions arrive, so a
burst of per-layer completions costs the loop one wake-up, not one per layer.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable


class LoopHandoff:
    """Runs posted callbacks on ``loop``, in post order, in batches. ``post`` never blocks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[Callable[..., None], tuple]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.closed = False
        self._loop_thread: int | None = None  # learnt at the first drain

    def post(self, fn: Callable[..., None], *args: object) -> None:
        """Queue ``fn(*args)`` to run on the loop thread. Safe from any thread."""
        self._items.append((fn, args))
        with self._lock:
            if self._scheduled or self.closed:
                return
            self._scheduled = True
        try:
            if threading.get_ident() == self._loop_thread:
                self.loop.call_soon(self._drain)  # already on the loop: no wake-up write
            else:
                self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:
        self._loop_thread = threading.get_ident()
        with self._lock:
            self._scheduled = False
        items = self._items
        for _ in range(len(items)):  # later posts schedule the next drain: no starving the loop
            fn, args = items.popleft()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - one broken callback must not strand the rest
                self.loop.call_exception_handler({
                    "message": f"dsa_async: completion callback {fn!r} raised",
                    "exception": exc,
                })

    def drain_now(self) -> None:
        """Run whatever is queued, on the calling (loop) thread."""
        self._drain()
