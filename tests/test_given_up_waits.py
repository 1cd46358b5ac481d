"""A consumer that polls with a timeout reads as late as one that blocks: the waits it gave up
on (a ``TimeoutError``, an ``asyncio.wait_for`` that cancelled its await) before a layer was
ready count in that layer's lateness and in ``prefetch_wait_seconds`` once it uses the layer,
whichever way it then uses it (per layer or the whole prefetch, on a thread or on the loop)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
from service_fixtures import DeviceDecides, make_buffers, make_service, tokens

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer
from dsa_async.kinds import Timeliness

BOUND_S = 10  # generous: only proves nothing hangs
POLL_S = 0.01
POLLS_BEFORE_OPENING = 4
LAYERS = 3


def _figures(service) -> dict[str, float]:
    get = service.registry.get_sample_value
    out = {t.value: get("dsa_async_prefetch_layers_total", {"timeliness": t.value}) or 0.0
           for t in Timeliness}
    out["wait_sum_s"] = get("dsa_async_prefetch_wait_seconds_sum", {}) or 0.0
    out["wait_count"] = get("dsa_async_prefetch_wait_seconds_count", {}) or 0.0
    return out


class _Polls:
    """Timed-out waits of one polling consumer: opens ``gate`` (the prefetch's producer)
    after ``POLLS_BEFORE_OPENING`` of them, and adds up how long they took."""

    def __init__(self, gate) -> None:
        self.gate, self.given_up_s, self.timeouts = gate, 0.0, 0

    def timed_out(self, called: float) -> None:
        self.given_up_s += time.perf_counter() - called
        self.timeouts += 1
        if self.timeouts == POLLS_BEFORE_OPENING:
            self.gate.set()

    def given_up(self) -> float:
        assert self.timeouts >= POLLS_BEFORE_OPENING
        return self.given_up_s


def _poll_on_thread(wait, gate) -> float:
    """Call ``wait(POLL_S)`` until it stops timing out; how long the timed-out calls took."""
    polls = _Polls(gate)
    while True:
        called = time.perf_counter()
        try:
            wait(POLL_S)
            return polls.given_up()
        except TimeoutError:
            polls.timed_out(called)


async def _poll_on_loop(make_awaitable, gate) -> float:
    """The same with ``asyncio.wait_for`` around a fresh awaitable each time."""
    polls = _Polls(gate)
    while True:
        called = time.perf_counter()
        try:
            await asyncio.wait_for(make_awaitable(), POLL_S)
            return polls.given_up()
        except TimeoutError:
            polls.timed_out(called)


async def _thread_layer(load, gate):
    given_up_s = await asyncio.to_thread(_poll_on_thread, lambda t: load.wait_layer(0, t), gate)
    await load  # the other layers, with the whole prefetch
    return given_up_s


async def _thread_whole(load, gate):
    return await asyncio.to_thread(_poll_on_thread, load.wait, gate)


async def _loop_layer(load, gate):
    given_up_s = await _poll_on_loop(lambda: load.layer_ready(0), gate)
    for layer in range(1, LAYERS):
        await load.layer_ready(layer)
    return given_up_s


async def _loop_whole(load, gate):
    return await _poll_on_loop(lambda: load, gate)


async def _thread_layer_then_loop_whole(load, gate):
    """Gives up on layer 0 on a thread, then awaits the whole prefetch on the loop."""
    def give_up_twice() -> float:
        called = time.perf_counter()
        for _ in range(2):
            with pytest.raises(TimeoutError):
                load.wait_layer(0, POLL_S)
        return time.perf_counter() - called

    given_up_s = await asyncio.to_thread(give_up_twice)
    gate.set()
    await load
    return given_up_s


CONSUMERS = {"thread-layer": _thread_layer, "thread-whole": _thread_whole,
             "loop-layer": _loop_layer, "loop-whole": _loop_whole,
             "thread-layer-then-loop-whole": _thread_layer_then_loop_whole}


def _gated_load(service):
    """Two held host pages, the figures now, and a prefetch of them held by a gate:
    ``(held, figures, gate, load)``."""
    held = service.allocate_host_pages(2)
    before = _figures(service)
    gate = threading.Event()
    return held, before, gate, service.prefetch(held, tokens([0, 1]), after=gate)


#: Observations of prefetch_wait_seconds each way of consuming makes: one for a wait for the
#: whole prefetch, one more for a layer waited for alone before it.
OBSERVATIONS = {"thread-layer": 2, "thread-whole": 1, "loop-layer": 2, "loop-whole": 1,
                "thread-layer-then-loop-whole": 1}


@pytest.mark.parametrize("consume", sorted(CONSUMERS))
async def test_waits_given_up_before_a_layer_was_ready_count_when_it_is_used(tmp_path, consume):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        held, before, gate, load = _gated_load(service)
        consumed_from = time.perf_counter()
        given_up_s = await CONSUMERS[consume](load, gate)
        consumed_s = time.perf_counter() - consumed_from
        after = _figures(service)
        delta = {k: after[k] - before[k] for k in after}
        assert delta["late"] + delta["on_time"] == LAYERS and delta["wasted"] == 0, delta
        assert delta["late"] >= 1, delta  # layer 0 (at least) was not ready when first asked
        # layer 0's recorded wait covers the waits given up on before it was ready (each
        # timed from inside the call, so a little shorter than the caller's clock says) ...
        assert delta["wait_sum_s"] >= given_up_s * 0.8, (given_up_s, delta)
        # ... and counts each of them once: the waits observed add up to no more than the
        # consumer's time, in as many observations as blocking waits would make
        assert delta["wait_sum_s"] <= consumed_s, (consumed_s, delta)
        assert 1 <= delta["wait_count"] <= OBSERVATIONS[consume], delta
        service.release(held)


class _FromThread:
    """``set()`` of an asyncio event, callable from any thread."""

    def __init__(self, event: asyncio.Event) -> None:
        self._event, self._loop = event, asyncio.get_running_loop()

    def set(self) -> None:
        self._loop.call_soon_threadsafe(self._event.set)


async def test_where_the_device_decides_polling_reads_as_blocking_does(tmp_path):
    """On an engine that rules on lateness on the device, a thread's host time waiting for a
    layer's copy to be issued is not lateness, whether it blocks or polls with a timeout."""
    geometry = dsa_indexer(num_layers=LAYERS)
    counts = {}
    for polls in (False, True):
        config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8),
                               backend="cpu", ledger_directory=str(tmp_path / f"l{polls}"))
        service = OffloadService(config, {geometry.name: make_buffers(geometry, 8)},
                                 engine_factory=DeviceDecides)
        async with service, asyncio.timeout(BOUND_S):
            held = service.allocate_host_pages(2)
            before = _figures(service)
            opened = asyncio.Event()  # a loop producer: the engine gets the batch once set
            gate = _FromThread(opened)
            load = service.prefetch(held, tokens([0, 1]), after=opened)
            if polls:
                await asyncio.to_thread(_poll_on_thread, lambda t: load.wait_layer(0, t), gate)
            else:
                waiting = asyncio.ensure_future(asyncio.to_thread(load.wait_layer, 0, BOUND_S))
                await asyncio.to_thread(time.sleep, POLLS_BEFORE_OPENING * POLL_S)
                gate.set()
                await waiting
            await asyncio.to_thread(lambda: [load.wait_layer(i) for i in range(1, LAYERS)])
            after = _figures(service)
            counts[polls] = {k: after[k] - before[k] for k in ("late", "on_time", "wait_count")}
            await load
            service.release(held)
    assert counts[True] == counts[False] == {"late": 0, "on_time": LAYERS, "wait_count": 0}


async def test_a_wait_given_up_on_a_layer_that_was_never_used_counts_nothing(tmp_path):
    """A consumer that gives up and drops the prefetch leaves its layers wasted, not late."""
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        held, before, gate, load = _gated_load(service)
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(load.wait_layer, 0, POLL_S)
        gate.set()
        while not load.done():
            await asyncio.sleep(0.001)
        del load
        gc.collect()
        after = _figures(service)
        assert after["wasted"] - before["wasted"] == LAYERS
        assert after["late"] == before["late"] and after["wait_count"] == before["wait_count"]
        service.release(held)
