"""``call_threadsafe`` never hands out a future that stays pending: once the service is closed
it refuses new calls, and a call its loop had not run by then fails, whenever the loop that
runs the service stops (``ServiceThread.stop``, or its owner simply not running it again)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import uvloop
from service_fixtures import make_buffers

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import ServiceClosedError
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer
from dsa_async.integrations.loop_thread import ServiceThread

WAIT_S = 10  # generous: only proves nothing hangs
ROUNDS = 8


def _config(tmp_path) -> ServiceConfig:
    return ServiceConfig(geometries=(dsa_indexer(num_layers=2),), host_pool=PoolSize(pages=4),
                         backend="cpu", ledger_directory=str(tmp_path / "ledger"),
                         drain_timeout_s=0.2)


def test_a_call_after_close_is_refused_while_the_loop_still_exists(tmp_path):
    """The loop's owner ran close() and will not run the loop again: a call posted now would
    sit in its queue for ever, so it is refused instead."""
    loop = uvloop.new_event_loop()
    try:
        service = OffloadService(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 4))
        loop.run_until_complete(service.start())
        future = service.call_threadsafe(service.statistics)  # the loop is not running now
        loop.run_until_complete(service.close())  # runs it first, then closes
        assert future.result(0).capacity_pages == 4
        with pytest.raises(ServiceClosedError, match="closed"):
            service.call_threadsafe(service.statistics)
    finally:
        loop.close()


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_every_call_racing_stop_resolves(tmp_path, round_):
    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 4),
                                stop_at_exit=False)
    service = owner.service
    issued: list[concurrent.futures.Future] = []
    refused = threading.Event()
    some_ran = threading.Event()

    def caller() -> None:  # as a thread reading statistics does: one call at a time
        while True:
            try:
                issued.append(service.call_threadsafe(service.statistics))
            except ServiceClosedError:
                refused.set()
                return
            some_ran.set()
            try:
                issued[-1].result(WAIT_S)
            except ServiceClosedError:
                pass  # ran on the loop while the service closed, or failed at the end
            except concurrent.futures.TimeoutError:
                return  # never resolved: reported below

    thread = threading.Thread(target=caller)
    thread.start()
    assert some_ran.wait(WAIT_S)
    owner.stop(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive() and refused.is_set()
    pending = [f for f in issued if not concurrent.futures.wait([f], timeout=WAIT_S).done]
    assert not pending, f"{len(pending)} of {len(issued)} calls never resolved"
    for future in issued:  # each either ran or was told the service closed
        error = future.exception(0)
        assert error is None or isinstance(error, ServiceClosedError), repr(error)
