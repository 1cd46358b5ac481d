"""The producer grammar (``after=``) on the CPU backend, and where producers are captured.

Each form the README lists is honoured (the copy sees the bytes the producer wrote), a failing
producer fails only its own request with the producer's error attached, and the default
producer is captured on the thread that submits. Forms outside the grammar are refused at
submit (tests/test_bad_input.py)."""

from __future__ import annotations

import asyncio
import functools
import concurrent.futures
import gc
import threading

import pytest
import torch
from service_fixtures import CaptureRecordingEngine, make_buffers, make_service, tokens

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import TransferFailedError
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer
from dsa_async.kinds import Direction

BOUND_S = 10
LAYERS = 3


def _overwrite(buffers, page: int, value: int) -> None:
    for layers in buffers.values():
        for layer in layers:
            layer[page].fill_(value)


def _host_page_bytes(service, handle) -> dict:
    index = torch.as_tensor(handle.pages)
    return {name: [arena[layer][index].clone() for layer in range(LAYERS)]
            for name, arena in service.host_pool.arenas.items()}


def _causes(error: BaseException) -> list[BaseException]:
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__
    return chain


def _forms():
    """(name, make) pairs: ``make(loop)`` -> (producer given to after=, finish())."""

    def threading_event(_loop):
        event = threading.Event()
        return event, event.set

    def cf_future(_loop):
        future = concurrent.futures.Future()
        return future, lambda: future.set_result(None)

    def asyncio_event(_loop):
        event = asyncio.Event()
        return event, event.set

    def asyncio_future(loop):
        future = loop.create_future()
        return future, lambda: future.set_result(None)

    def sequence(_loop):
        first, second = threading.Event(), asyncio.Event()
        return [first, second], lambda: (first.set(), second.set())

    return [("threading.Event", threading_event), ("concurrent.futures.Future", cf_future),
            ("asyncio.Event", asyncio_event), ("asyncio.Future", asyncio_future),
            ("sequence", sequence)]


@pytest.mark.parametrize("make", [m for _, m in _forms()], ids=[n for n, _ in _forms()])
async def test_a_backup_waits_for_every_producer_form_before_reading(tmp_path, make):
    service, buffers = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        producer, finish = make(asyncio.get_running_loop())
        backup = service.evict(tokens([2]), after=producer)
        for _ in range(3):
            await asyncio.sleep(0)  # the loop runs its flushes; the copy must still wait
        _overwrite(buffers, 2, 7)  # the producer writes the page, then says so
        finish()
        result = await backup
        assert all(torch.equal(x, torch.full_like(x, 7))
                   for per_layer in _host_page_bytes(service, result.host_pages).values()
                   for x in per_layer)
        service.release(result.host_pages)


@pytest.mark.parametrize("kind", ["concurrent", "asyncio"])
async def test_a_failing_producer_fails_only_its_own_request_with_its_error(tmp_path, kind):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        loop = asyncio.get_running_loop()
        producer = (concurrent.futures.Future() if kind == "concurrent"
                    else loop.create_future())
        failing = service.evict(tokens([0]), after=producer)
        mate = service.evict(tokens([1]))  # same loop tick: would share a batch
        producer.set_exception(RuntimeError("the kernel that wrote page 0 crashed"))
        with pytest.raises(TransferFailedError) as failed:
            await failing
        assert any("crashed" in str(e) for e in _causes(failed.value))
        done = await mate
        service.release(done.host_pages)
        assert service.statistics() == start


async def test_close_abandoning_one_producer_fails_no_batch_mate(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, drain_timeout_s=0.2)
    await service.start()
    never = threading.Event()
    stuck = service.evict(tokens([0]), after=never)
    mates = [service.evict(tokens([i])) for i in (1, 2)]  # same tick, no producer of their own
    async with asyncio.timeout(BOUND_S):
        await service.close()
    assert isinstance(stuck.exception(), TransferFailedError)
    assert [m.exception() for m in mates] == [None, None]


async def test_after_a_transfer_of_another_service_waits_for_it(tmp_path):
    first, _ = make_service(tmp_path / "a", layers=LAYERS, host_pages=4, host_wait_timeout_s=30)
    second, buffers = make_service(tmp_path / "b", layers=LAYERS)
    async with first, second, asyncio.timeout(BOUND_S):
        full = first.allocate_host_pages(4)
        other = first.evict(tokens([3]))  # queued in the other service: waits for a host page
        backup = second.evict(tokens([4]), after=other)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not backup.done()
        _overwrite(buffers, 4, 9)
        first.release(full)  # the other service submits and ends its request now
        result = await backup  # hung: the other service never told this one
        assert all(torch.equal(x, torch.full_like(x, 9))
                   for per_layer in _host_page_bytes(second, result.host_pages).values()
                   for x in per_layer)
        second.release(result.host_pages)
        first.release((await other).host_pages)


async def test_after_a_failed_transfer_of_another_service_fails_with_its_error(tmp_path):
    first, _ = make_service(tmp_path / "a", layers=LAYERS)
    second, _ = make_service(tmp_path / "b", layers=LAYERS)
    async with first, second, asyncio.timeout(BOUND_S):
        producer = concurrent.futures.Future()
        other = first.evict(tokens([3]), after=producer)
        backup = second.evict(tokens([4]), after=other)
        producer.set_exception(RuntimeError("upstream failed"))
        with pytest.raises(TransferFailedError) as failed:
            await backup
        assert isinstance(failed.value.__cause__, TransferFailedError)
        with pytest.raises(TransferFailedError):
            await other


async def test_wait_layer_timeout_bounds_the_wait_after_the_copy_started(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        backup = await service.evict(tokens([0]))
        gate = threading.Event()
        load = service.prefetch(backup.host_pages, tokens([5]), after=gate)
        await asyncio.sleep(0)  # submitted: the engine now waits for the producer

        def forward_pass() -> str:
            try:
                load.wait_layer(1, timeout_s=0.2)
            except TimeoutError as exc:
                return str(exc)
            return "no timeout"

        outcome = await asyncio.to_thread(forward_pass)  # blocked forever before the fix
        assert "within 0.2 s" in outcome and not load.done()
        gate.set()
        assert (await load).pages == 1  # the transfer kept running
        service.release(backup.host_pages)


async def test_no_never_retrieved_log_when_a_layer_awaiter_is_cancelled_then_the_load_fails(
        tmp_path, caplog):
    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    def fail_h2d(batch, first_layer):
        if batch.direction is Direction.H2D:
            raise RuntimeError("injected H2D failure")

    service, _ = make_service(tmp_path, layers=LAYERS)
    service._fault_hook = fail_h2d
    try:
        async with service, asyncio.timeout(BOUND_S):
            backup = await service.evict(tokens([0]))
            gate = threading.Event()
            load = service.prefetch(backup.host_pages, tokens([5]), after=gate)
            waiter = asyncio.ensure_future(load.layer_ready(2))
            await asyncio.sleep(0)
            waiter.cancel()
            gate.set()
            with pytest.raises(TransferFailedError):
                await load
            del waiter
            service.release(backup.host_pages)
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        assert reported == []
        # Futures still alive would report when collected: none may be marked for that.
        unretrieved = [o for o in gc.get_objects()
                       if issubclass(type(o), asyncio.Future) and o._log_traceback]
        assert unretrieved == []
    finally:
        loop.set_exception_handler(None)


async def test_a_failed_transfer_nobody_looked_at_is_logged_once_by_the_service(tmp_path, caplog):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        producer = concurrent.futures.Future()
        looked_at = service.evict(tokens([1]), after=producer)
        service.evict(tokens([0]), after=producer)  # dropped at once
        producer.set_exception(RuntimeError("producer crashed"))
        with pytest.raises(TransferFailedError):
            await looked_at
        gc.collect()
    lines = [r for r in caplog.records if r.name == "dsa_async.service" and
             "nobody looked at its Transfer" in r.getMessage()]
    assert len(lines) == 1 and "producer crashed" in lines[0].getMessage()


@pytest.mark.parametrize("path", ["call_threadsafe", "call_threadsafe-partial",
                                  "call_threadsafe-lambda", "threadsafe-methods"])
@pytest.mark.parametrize("direction", ["evict", "prefetch"])
async def test_the_default_producer_is_captured_on_the_submitting_thread(tmp_path, direction,
                                                                         path):
    geometry = dsa_indexer(num_layers=LAYERS)
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    engines: list[CaptureRecordingEngine] = []

    def factory(*args, **kwargs):
        engines.append(CaptureRecordingEngine(*args, **kwargs))
        return engines[0]

    service = OffloadService(config, make_buffers(geometry, 8), engine_factory=factory)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        loop_thread = threading.get_ident()
        engines[0].captured_on.clear()

        def submit() -> int:
            evict = direction == "evict"
            if path == "threadsafe-methods":
                transfer = (service.evict_threadsafe(tokens([1]), host_tokens=held.token_indices())
                            if evict else service.prefetch_threadsafe(held, tokens([1])))
            elif path == "call_threadsafe":
                transfer = (service.call_threadsafe(service.evict, tokens([1]),
                                                    host_tokens=held.token_indices())
                            if evict else service.call_threadsafe(service.prefetch, held,
                                                                  tokens([1]))).result(BOUND_S)
            else:  # any callable that submits, not only the bound methods themselves
                call = (functools.partial(service.evict, tokens([1]),
                                          host_tokens=held.token_indices())
                        if evict else functools.partial(service.prefetch, held, tokens([1])))
                if path == "call_threadsafe-lambda":
                    call = (lambda submit: lambda: submit())(call)
                transfer = service.call_threadsafe(call).result(BOUND_S)
            transfer.wait(timeout_s=BOUND_S)
            return threading.get_ident()

        caller = await asyncio.to_thread(submit)
        assert engines[0].captured_on == [caller] and caller != loop_thread
        # calls that never submit capture nothing (on CUDA: no event per statistics poll)
        await asyncio.to_thread(lambda: service.call_threadsafe(service.statistics).result())
        assert engines[0].captured_on == [caller]
        await service.evict(tokens([2]), host_tokens=held.token_indices())  # on the loop
        assert engines[0].captured_on[-1] == loop_thread
        service.release(held)


async def test_loop_producers_leave_nothing_behind_once_their_requests_end(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        loop = asyncio.get_running_loop()
        fired, cancelled_event = loop.create_future(), asyncio.Event()
        done = service.evict(tokens([0]), after=[fired, asyncio.Event()])
        gone = service.evict(tokens([1]), after=cancelled_event)
        fired.set_result(None)
        await asyncio.sleep(0)
        assert gone.cancel() and done.cancel()
        await asyncio.sleep(0)  # the service's own waits on the events are cancelled
        assert len(service._scheduler._loop_watches) == 0
        waits = [t for t in asyncio.all_tasks() if "Event.wait" in repr(t)]
        assert waits == []
        ok = service.evict(tokens([2]), after=fired)  # already finished: goes at once
        service.release((await ok).host_pages)
        later = loop.create_future()
        waited = service.evict(tokens([3]), after=later)  # watched, then every producer fires
        later.set_result(None)
        service.release((await waited).host_pages)
        assert len(service._scheduler._loop_watches) == 0


async def test_a_thread_producer_holds_its_directions_later_copies_a_loop_producer_holds_none(
        tmp_path):
    """As documented: on the CPU backend a copy waiting for a ``threading.Event`` holds the
    later copies of its direction (stream order) but not the other direction's; a request
    waiting for an ``asyncio.Event`` stays queued and holds no copy, so later ones go first."""
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        backup = await service.evict(tokens([8]))
        thread_producer = threading.Event()
        held = service.evict(tokens([0]), after=thread_producer)
        later = service.evict(tokens([1]))
        load = await service.prefetch(backup.host_pages, tokens([9]))  # the other direction
        assert load.pages == 1 and not later.done()
        thread_producer.set()
        await held
        await later
        loop_producer = asyncio.Event()
        queued = service.evict(tokens([2]), after=loop_producer)
        assert (await service.evict(tokens([3]))).pages == 1  # goes while `queued` waits
        assert not queued.done()
        loop_producer.set()
        await queued
        for done in (backup, held.result(), later.result(), queued.result()):
            service.release(done.host_pages)
