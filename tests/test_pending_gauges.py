"""What operators see of requests accepted and not ended, on a live CPU service: the queue on
the loop and the requests in the copy engine are both counted, so that a wedged engine (every
request handed over, none ending) shows as requests waiting, not as an empty queue."""

from __future__ import annotations

import asyncio
import threading

from service_fixtures import make_service, tokens

BOUND_S = 10


def _gauges(service) -> dict[str, float]:
    get = service.registry.get_sample_value
    return {name: get(f"dsa_async_{name}", {"direction": "d2h"})
            for name in ("queue_depth", "inflight_requests", "inflight_bytes")}


async def _published(service, expected) -> dict[str, float]:
    """The gauges once they read ``expected(gauges)`` (published at most every 50 ms)."""
    while not expected(gauges := _gauges(service)):
        await asyncio.sleep(0.01)
    return gauges


async def test_requests_held_in_the_engine_show_as_in_flight_not_as_an_empty_queue(tmp_path):
    service, _ = make_service(tmp_path, layers=2)
    async with service:
        never_yet = threading.Event()  # an engine producer: the copy waits in the engine
        async with asyncio.timeout(BOUND_S):
            held = [service.evict(tokens([page]), after=never_yet) for page in range(4)]
            gauges = await _published(service, lambda g: g["inflight_requests"] == 4)
            stats = service.statistics()
            assert (stats.queued_requests, stats.inflight_requests) == (0, 4)
            assert gauges["queue_depth"] == 0
            assert gauges["inflight_bytes"] == sum(t._request.nbytes for t in held)
            never_yet.set()
            for transfer in held:
                service.release((await transfer).host_pages)
            await _published(service, lambda g: not any(g.values()))
