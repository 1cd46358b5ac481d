"""A completion thread follows a batch's layer events letting go of the GIL only to wait.

``Event.synchronize()`` lets go of the GIL and ``query()`` keeps it; against a thread busy in
Python each let-go can cost a switch interval, so a batch whose layers are already copied must
be followed without one per layer. Fake events stand in for CUDA ones: each knows whether the
device reached it and counts the waits made on it.
"""

from __future__ import annotations

import pytest

from dsa_async.transfer.event_waits import wait_for, wait_in_order


class FakeEvent:
    def __init__(self, complete: bool, log: list) -> None:
        self.complete = complete
        self.log = log

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.log.append(("wait", self))
        self.complete = True


def _events(states: str, log: list) -> list[FakeEvent]:
    return [FakeEvent(state == "x", log) for state in states]  # x: the device reached it


@pytest.mark.parametrize(("states", "waits", "reached"), [
    ("xxxxxx", 0, [6]),  # every layer copied already: one report, no GIL let-go
    ("......", 6, [1, 2, 3, 4, 5, 6]),  # the copy still running: one wait per layer
    ("xxx...", 3, [3, 4, 5, 6]),
    (".xx.xx", 2, [3, 6]),  # after each wait, the layers copied meanwhile count at once
    ("", 0, []),
])
def test_waits_only_for_events_the_device_has_not_reached(states, waits, reached):
    log: list = []
    events = _events(states, log)
    seen: list[int] = []
    wait_in_order(events, seen.append)
    assert seen == reached
    assert len(log) == waits
    assert all(event.complete for event in events)


def test_a_device_error_from_a_query_or_a_wait_reaches_the_caller():
    class Broken(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    log: list = []
    seen: list[int] = []
    events = [FakeEvent(True, log), Broken(False, log)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        wait_in_order(events, seen.append)
    assert seen == []  # the first layer is reported with the ones after it, never alone


def test_one_event_is_waited_on_only_when_not_reached():
    log: list = []
    reached, pending = FakeEvent(True, log), FakeEvent(False, log)
    wait_for(reached)
    assert log == []
    wait_for(pending)
    assert log == [("wait", pending)]
