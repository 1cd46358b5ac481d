"""Event-loop lag: how late the host server's loop runs a timer.

A healthy loop wakes within a millisecond; anything that blocks the loop thread shows up here
first. The monitor only observes into a callable (``ServiceMetrics.observe_loop_lag``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import ConfigError


class EventLoopLagMonitor:
    """Measures event-loop lag: how late a timer set ``interval_s`` ahead actually runs.

    A healthy loop wakes within a millisecond; anything that blocks the loop thread (a
    ``synchronize()``, a large copy on the loop, heavy Python) shows up as lag. Each wake-up
    observes ``max(0, now - scheduled)`` into ``observe`` (usually
    :meth:`ServiceMetrics.observe_loop_lag`).

    ``start()`` needs a running loop and returns at once; ``await stop()`` cancels the task and
    waits for it. If the monitor is stopped while a wake-up is already overdue (the loop was just
    blocked), that overdue lag is observed too, so a block right before shutdown is not lost.
    """

    def __init__(self, observe: Callable[[float], None], *, interval_s: float = 0.25) -> None:
        if not interval_s > 0:
            raise ConfigError(f"interval_s must be > 0, got {interval_s!r}")
        self._observe = observe
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Whether the monitor task is alive."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the monitor task on the running loop. Non-blocking; raises if already started."""
        if self._task is not None:
            raise RuntimeError("EventLoopLagMonitor is already started")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="dsa_async-event-loop-lag"
        )

    async def stop(self) -> None:
        """Cancel the monitor and wait for it to end. Idempotent.

        If the caller is cancelled while waiting, the monitor is still cancelled (it ends on its
        own) and the caller's cancellation propagates.
        """
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # asyncio.wait never raises the task's own CancelledError; our caller's does propagate.
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval_s = self._interval_s
        while True:
            due = loop.time() + interval_s
            try:
                await asyncio.sleep(interval_s)
            except asyncio.CancelledError:
                overdue_s = loop.time() - due
                if overdue_s > 0:
                    self._observe(overdue_s)
                raise
            self._observe(max(0.0, loop.time() - due))

