"""Following a batch's per-layer device events from a completion thread, without a GIL
round trip per layer.

``torch.cuda.Event.synchronize()`` lets go of the GIL while it waits and ``query()`` keeps it.
A thread that lets go of the GIL waits to get it back for as long as another thread runs Python
(up to ``sys.getswitchinterval()``, 5 ms by default): in a server whose scheduler thread is
busy in Python, synchronizing each of 61 layer events one after another could cost up to 61
such waits per batch after its copy had ended (61 let-gos against a thread busy in Python took
318 ms in a CPU simulation), and everything that follows a batch's end (its requests'
completion, the pages it frees, a consumer slot SGLang checks) lagged by that. Here the events
already complete are found with ``query()`` and counted at once, and the thread lets go of the
GIL only to wait for an event the device has not reached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def wait_in_order(events: Sequence[DeviceEvent], reached: Callable[[int], None]) -> None:
    """Wait for ``events`` (recorded in order on one stream) and call ``reached(n)`` each time
    the first ``n`` are complete, ``n`` increasing, last with ``n == len(events)``: after each
    event the thread had to wait for, and first for those already complete. Blocks the calling
    thread (the GIL is let go only while an event is not complete); raises what a device error
    raises from ``query``/``synchronize``."""
    count = len(events)
    done = 0
    while done < count:
        if not events[done].query():
            events[done].synchronize()
        done += 1
        while done < count and events[done].query():
            done += 1
        reached(done)


def wait_for(event: DeviceEvent) -> None:
    """Wait for one event, letting go of the GIL only when the device has not reached it."""
    if not event.query():
        event.synchronize()
