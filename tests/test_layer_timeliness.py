"""Every way a caller consumes a whole prefetch counts each of its layers once, as on time or
late, never as wasted: ``await``, ``Transfer.wait()`` from a thread (before or after the end).
A prefetch whose layers nobody used counts them as wasted, also when its outcome was read
(``done()``, ``result()``, ``exception()``: how a caller checks for failure). Where the engine
rules on lateness on the device (CUDA), a thread's own wait for the copy to start is not
lateness, also when the layer is already copied once the copy started."""

from __future__ import annotations

import asyncio
import gc

import pytest
from service_fixtures import DeviceDecides, make_buffers, make_service, tokens

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer
from dsa_async.kinds import Timeliness

BOUND_S = 10  # generous: only proves nothing hangs
LAYERS = 3


def _layer_counts(service) -> dict[str, float]:
    return {t.value: service.registry.get_sample_value(
        "dsa_async_prefetch_layers_total", {"timeliness": t.value}) or 0.0 for t in Timeliness}


async def _await(service, load, gate):
    gate.set()
    await load


async def _wait_on_a_thread(service, load, gate):
    waiting = asyncio.to_thread(load.wait, BOUND_S)
    gate.set()
    await waiting


async def _wait_on_a_thread_after_the_end(service, load, gate):
    gate.set()
    while not load.done():
        await asyncio.sleep(0.001)
    await asyncio.to_thread(load.wait, 0)


CONSUMERS = {"await": _await, "wait-on-a-thread": _wait_on_a_thread,
             "wait-after-the-end": _wait_on_a_thread_after_the_end}


@pytest.mark.parametrize("consume", sorted(CONSUMERS))
async def test_a_consumed_prefetch_counts_every_layer_once_as_used(tmp_path, consume):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        before = _layer_counts(service)
        gate = asyncio.Event()
        load = service.prefetch(held, tokens([0, 1]), after=gate)
        await CONSUMERS[consume](service, load, gate)
        load.result()  # a second look counts nothing more
        del load
        gc.collect()  # a dropped Transfer counts only layers nobody used
        after = _layer_counts(service)
        used = (after["on_time"] - before["on_time"]) + (after["late"] - before["late"])
        assert used == LAYERS and after["wasted"] == before["wasted"], (before, after)
        service.release(held)


@pytest.mark.parametrize("read_outcome", [False, True])
async def test_a_prefetch_nobody_used_counts_its_layers_as_wasted(tmp_path, read_outcome):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        before = _layer_counts(service)
        load = service.prefetch(held, tokens([0, 1]))
        while not load.done():
            await asyncio.sleep(0.001)
        if read_outcome:  # a check for failure uses no layer
            assert load.exception() is None and load.result().pages == 2
        del load
        gc.collect()
        after = _layer_counts(service)
        assert after["wasted"] - before["wasted"] == LAYERS
        assert after["on_time"] == before["on_time"] and after["late"] == before["late"]
        service.release(held)


async def test_where_the_device_decides_a_wait_for_the_start_is_not_lateness(tmp_path):
    geometry = dsa_indexer(num_layers=LAYERS)
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    service = OffloadService(config, {geometry.name: make_buffers(geometry, 8)},
                             engine_factory=DeviceDecides)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        before = _layer_counts(service)
        gate = asyncio.Event()
        load = service.prefetch(held, tokens([0, 1]), after=gate)
        consumer = asyncio.ensure_future(asyncio.to_thread(
            lambda: [load.wait_layer(layer, BOUND_S) for layer in range(LAYERS)]))
        while load._request._start_waiter is None:  # white box: it waits for the start now
            await asyncio.sleep(0)
        gate.set()
        await consumer
        after = _layer_counts(service)
        assert after["on_time"] - before["on_time"] == LAYERS, (before, after)
        assert after["late"] == before["late"]
        await load
        service.release(held)
