"""Every way SGLang looks at a copy through the plug-in reports a failed or cancelled one alike:
a ``TransferFailedError`` saying it is fatal, logged as critical. SGLang has no per-request abort
on this path, and a ``CancelledError`` (a ``BaseException``) or the service's own error escaping
from one of these calls would pass by its handlers or the log. Runs on a real CPU service."""

from __future__ import annotations

import concurrent.futures
import logging
import tempfile
import threading

import pytest
import torch

from dsa_async import Pages, PoolSize, ServiceConfig, TransferFailedError, dsa_indexer
from dsa_async.errors import WrongThreadError
from dsa_async.integrations.loop_thread import ServiceThread
from dsa_async.integrations.sglang.engine import _Mark
from dsa_async.integrations.sglang.layer_counter import LoadSlot, ServiceLayerCounter

LAYERS = 2
BOUND_S = 10


@pytest.fixture
def service_thread():
    geometry = dsa_indexer(num_layers=LAYERS)
    buffers = [torch.zeros(8, geometry.bytes_per_page_per_layer, dtype=torch.uint8)
               for _ in range(LAYERS)]
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=tempfile.mkdtemp())
    st = ServiceThread.start(config, buffers, stop_at_exit=False)
    yield st
    st.stop(BOUND_S)


def _ended_load(st: ServiceThread, outcome: str):
    """A load that failed (its producer failed) or was cancelled before its copy ran."""
    service = st.service
    handle = service.call_threadsafe(service.allocate_host_pages, 1).result(BOUND_S)
    producer: concurrent.futures.Future = concurrent.futures.Future()
    load = service.prefetch_threadsafe(handle, Pages([3]), after=producer)
    if outcome == "failed":
        producer.set_exception(OSError("injected producer fault"))
    else:
        service.call_threadsafe(load.cancel).result(BOUND_S)
    try:
        load.wait(timeout_s=BOUND_S)
    except BaseException:  # noqa: BLE001 - its error or CancelledError: what the test wants
        pass
    assert load.done()
    return load


def _slot_wait(load) -> None:
    slot = LoadSlot(LAYERS, cuda=False)
    slot.attach(load)
    slot.wait(LAYERS - 1)


LOOKS = {
    "mark.query": lambda load: _Mark(load, "a load").query(),
    "mark.synchronize": lambda load: _Mark(load, "a load").synchronize(),
    "mark.elapsed_time": lambda load: _Mark(None, "start").elapsed_time(_Mark(load, "a load")),
    "slot.finish_event.query": lambda load: _finish(load).query(),
    "slot.finish_event.synchronize": lambda load: _finish(load).synchronize(),
    "slot.wait": _slot_wait,
    "counter.update_producer": lambda load: _counter_with(load).update_producer(),
}


def _counter_with(load) -> ServiceLayerCounter:
    """A layer counter whose next producer slot last carried ``load``."""
    counter = ServiceLayerCounter(LAYERS, cuda=False)
    counter.events[0].attach(load)
    return counter


def _finish(load):
    slot = LoadSlot(LAYERS, cuda=False)
    slot.attach(load)
    return slot.finish_event


@pytest.mark.parametrize("outcome", ["failed", "cancelled"])
@pytest.mark.parametrize("look", LOOKS)
def test_every_look_at_an_ended_copy_raises_it_as_fatal(service_thread, caplog, look, outcome):
    load = _ended_load(service_thread, outcome)
    with caplog.at_level(logging.CRITICAL), \
            pytest.raises(TransferFailedError, match="fatal for this SGLang process"):
        LOOKS[look](load)
    assert any(r.levelname == "CRITICAL" for r in caplog.records)


def test_a_copy_that_succeeded_reports_its_time_and_passes_every_look(service_thread):
    service = service_thread.service
    handle = service.call_threadsafe(service.allocate_host_pages, 1).result(BOUND_S)
    load = service.prefetch_threadsafe(handle, Pages([2]))
    load.wait(timeout_s=BOUND_S)
    for look in LOOKS.values():
        look(load)
    assert _Mark(None, "start").elapsed_time(_Mark(load, "a load")) >= 0.0


def test_a_slot_whose_load_the_service_has_not_seen_end_is_waited_for_not_asserted(
        service_thread):
    # SGLang asserts the slot's device event; the service's own view of the load's end can
    # lag the device while the scheduler thread holds the GIL, so this waits for it instead.
    service = service_thread.service
    handle = service.call_threadsafe(service.allocate_host_pages, 1).result(BOUND_S)
    producer: concurrent.futures.Future = concurrent.futures.Future()
    load = service.prefetch_threadsafe(handle, Pages([3]), after=producer)
    counter = _counter_with(load)
    outcome: list[object] = []
    taker = threading.Thread(target=lambda: outcome.append(counter.update_producer()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not load.done()  # waiting for the load, not asserting
    producer.set_result(None)
    taker.join(BOUND_S)
    assert not taker.is_alive() and outcome == [0] and load.done()


def test_a_wait_that_fails_before_the_copy_ended_is_fatal_with_its_own_cause(service_thread):
    service = service_thread.service
    handle = service.call_threadsafe(service.allocate_host_pages, 1).result(BOUND_S)
    producer: concurrent.futures.Future = concurrent.futures.Future()
    load = service.prefetch_threadsafe(handle, Pages([3]), after=producer)
    try:
        for look in (lambda: _Mark(load, "a load").synchronize(),
                     lambda: _finish(load).synchronize()):
            # on the service's own loop thread a blocking wait is refused (WrongThreadError)
            with pytest.raises(TransferFailedError, match="fatal") as refused:
                service.call_threadsafe(look).result(BOUND_S)
            assert isinstance(refused.value.__cause__, WrongThreadError)
    finally:
        producer.set_result(None)
        load.wait(timeout_s=BOUND_S)
