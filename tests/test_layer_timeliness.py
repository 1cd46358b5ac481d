"""Every way a caller consumes a whole prefetch counts each of its layers once, as on time or
late, never as wasted: ``await``, ``Transfer.wait()`` from a thread (before or after the end).
A prefetch whose layers nobody used counts them as wasted, also when its outcome was read
(``done()``, ``result()``, ``exception()``: how a caller checks for failure)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from service_fixtures import make_service, tokens

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
