"""A request of 0 pages, in every input form, on the loop and from a thread: it ends done at
once, every layer API returns at once (also after ``close()``), it counts in no metric, and it
leaves nothing behind in the scheduler."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from service_fixtures import make_service, on_plain_thread

from dsa_async import Pages
from dsa_async.kinds import Timeliness

BOUND_S = 10  # generous: only proves nothing hangs
LAYERS = 3

EMPTY_FORMS = {
    "list": list,
    "range": lambda: range(0),
    "range-offset": lambda: range(64, 64),
    "tensor": lambda: torch.empty(0, dtype=torch.int64),
    "int32-tensor": lambda: torch.empty(0, dtype=torch.int32),
    "array": lambda: np.empty(0, dtype=np.int64),
    "pages": lambda: Pages([]),
}


def _layer_counts(service) -> dict[str, float]:
    return {t.value: service.registry.get_sample_value(
        "dsa_async_prefetch_layers_total", {"timeliness": t.value}) or 0.0 for t in Timeliness}


def _pending_layer_waits(service) -> int:
    return sum(len(v) for v in service._scheduler._pending_layers.values())


def _prefetch_from_a_thread(service, make):
    """Submit an empty prefetch from a plain thread and wait on its layers there, before and
    after the loop takes it."""
    load = service.prefetch_threadsafe(None, make(), host_tokens=make())
    for layer in range(LAYERS):
        load.wait_layer(layer, 1.0)
    assert load.wait(5.0).pages == 0
    for layer in range(LAYERS):
        load.wait_layer(layer, 0.0)
    return load


@pytest.mark.parametrize("submitted_on", ["loop", "thread"])
@pytest.mark.parametrize("form", sorted(EMPTY_FORMS))
async def test_an_empty_prefetch_has_every_layer_ready_and_counts_nothing(
        tmp_path, form, submitted_on):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        layers_before = _layer_counts(service)
        stats_before = service.statistics()
        make = EMPTY_FORMS[form]
        if submitted_on == "loop":
            load = service.prefetch(None, make(), host_tokens=make())
            assert load.done()
        else:
            load = await asyncio.wrap_future(on_plain_thread(
                lambda: _prefetch_from_a_thread(service, make)))
        assert load.num_pages == 0
        for layer in range(LAYERS):
            await load.layer_ready(layer)
            await load.layer_ready(layer)  # again: still at once
        assert (await load).pages == 0
        await asyncio.wrap_future(on_plain_thread(
            lambda: [load.wait_layer(i, 1.0) for i in range(LAYERS)]))
        assert _layer_counts(service) == layers_before
        assert _pending_layer_waits(service) == 0
        assert service.statistics() == stats_before


async def test_layers_of_an_empty_prefetch_stay_ready_after_close(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with asyncio.timeout(BOUND_S):
        await service.start()
        load = service.prefetch(None, [], host_tokens=[])
        await service.close()
        for layer in range(LAYERS):
            await load.layer_ready(layer)
        await asyncio.wrap_future(on_plain_thread(lambda: load.wait_layer(LAYERS - 1, 1.0)))
        assert (await load).pages == 0


async def test_an_empty_prefetch_still_checks_its_layer_argument(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        load = service.prefetch(None, [], host_tokens=[])
        with pytest.raises(ValueError, match="out of range"):
            await load.layer_ready(LAYERS)
        with pytest.raises(TypeError, match="must be an int"):
            await load.layer_ready("0")
        with pytest.raises(ValueError, match="timeout_s"):
            load.wait_layer(0, -1.0)


async def test_an_empty_eviction_counts_nothing_and_holds_no_host_pages(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        stats_before = service.statistics()
        for make in EMPTY_FORMS.values():
            backup = service.evict(make())
            assert (await backup).pages == 0 and backup.host_pages is None
            threaded = await asyncio.wrap_future(on_plain_thread(
                lambda make=make: service.evict_threadsafe(make())))
            assert (await threaded).pages == 0
        assert service.statistics() == stats_before
