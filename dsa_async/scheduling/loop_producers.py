"""Requests held on the event loop until their asyncio producers end.

``after=`` may name asyncio futures and tasks, ``asyncio.Event`` objects and Transfers of other
services on the same loop (producers.py). Those are waited for here, on the loop, before the
request can be chosen for a copy: a request with unfinished ones keeps ``loop_waits > 0`` and
stays queued, holding no copy slot. When the last one ends the scheduler is asked for a pass;
when one fails or is cancelled, the request fails with that error attached. A request that
ends first (cancelled, closed) stops its watches: callbacks come off the producers, and the
task made to wait for an ``asyncio.Event`` is cancelled. Loop thread only; nothing blocks.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request

#: (future watched, its done callback, whether the service made the future itself)
_Watch = tuple[asyncio.Future, Callable[[asyncio.Future], None], bool]


class LoopProducerWatches:
    """The unfinished loop producers of queued requests."""

    def __init__(self, on_all_ended: Callable[[], None],
                 on_failed: Callable[[Request, object, BaseException], None]) -> None:
        self._on_all_ended = on_all_ended  # a request may be chosen now: schedule a pass
        self._on_failed = on_failed  # end the request, failed, for this producer's failure
        self._watches: dict[Request, list[_Watch]] = {}

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, request: Request, producers: tuple[object, ...]) -> None:
        """Hold ``request`` until every producer ended; one that already failed ends it now."""
        watches: list[_Watch] = []
        for producer in producers:
            owned = isinstance(producer, asyncio.Event)
            if owned:
                if producer.is_set():
                    continue
                producer = asyncio.ensure_future(producer.wait())  # noqa: PLW2901 - its task
            elif producer.done():
                failure = producer_error(producer)
                if failure is not None:
                    self._stop_all(watches)
                    self._on_failed(request, producer, failure)
                    return
                continue
            callback = functools.partial(self._ended, request)
            producer.add_done_callback(callback)
            watches.append((producer, callback, owned))
        if watches:
            request.loop_waits = len(watches)
            self._watches[request] = watches

    def stop(self, request: Request) -> None:
        """``request`` ended: drop whatever of it is still watched."""
        request.loop_waits = 0
        self._stop_all(self._watches.pop(request, ()))

    def _ended(self, request: Request, producer: asyncio.Future) -> None:
        if request.loop_waits == 0:  # it ended first and stopped watching
            return
        request.loop_waits -= 1
        failure = producer_error(producer)
        if failure is not None:
            self._on_failed(request, producer, failure)  # its end stops the other watches
        elif not request.loop_waits:
            del self._watches[request]  # every producer ended: nothing left to stop
            self._on_all_ended()

    @staticmethod
    def _stop_all(watches) -> None:
        for producer, callback, owned in watches:
            producer.remove_done_callback(callback)
            if owned:  # the task this service made to wait for an asyncio.Event
                producer.cancel()


def producer_error(producer: object) -> BaseException | None:
    """The failure of a finished loop producer (``None``: it succeeded, or is an event).

    A cancelled future reads as ``asyncio.CancelledError``."""
    if isinstance(producer, asyncio.Future):
        if producer.cancelled():
            return asyncio.CancelledError(f"{producer!r} was cancelled")
        return producer.exception()
    return None
