"""Races between the caller's code and the service's own steps: a host-pressure hook that
cancels or outlives what the service is doing, producers cancelled without an executor, an
``after=`` Transfer cancelled while both copies are in the engine, waits for host pages that
turn into waits for in-flight bytes, and ``close()`` racing ``start()`` or itself cancelled.

Each test checks the rule, not one schedule: every request ends, its outcome does not depend on
which step the race hit, every count returns to zero and nothing raises on the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import pytest
from service_fixtures import make_service, on_plain_thread

from dsa_async import Pages
from dsa_async.errors import (
    CopyNotRunError,
    HostPoolExhausted,
    ServiceClosedError,
    TransferFailedError,
)
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.transfer.cpu import CpuEngine

BOUND_S = 10


def _idle(service) -> None:
    stats = service.statistics()
    assert (stats.queued_requests, stats.inflight_requests, stats.in_flight_pages) == (0, 0, 0)


async def _settle(service) -> None:
    """Let the loop run the passes that ended requests scheduled (gauges, freed pages)."""
    for _ in range(3):
        await asyncio.sleep(0)


# --- the host-pressure hook ------------------------------------------------------------------


async def test_a_hook_that_cancels_a_backup_chosen_in_the_same_pass(tmp_path):
    """The hook runs once the pass's chosen backups are in the engine: cancelling one of them
    from the hook is a cancel of a running copy (it completes, then returns its pages)."""
    transfers: dict[str, object] = {}
    calls = []

    def hook(pages_needed: int) -> None:
        calls.append(pages_needed)
        transfers["small"].cancel()

    service, _ = make_service(tmp_path, host_pages=4, host_wait_timeout_s=0.5)
    service.on_host_pressure = hook
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        transfers["small"] = small = service.evict(Pages([0]))  # fits: chosen
        large = service.evict(Pages([1, 2, 3, 4]))  # 4 pages, 3 free after it: the hook runs
        with pytest.raises(asyncio.CancelledError):
            await small
        result = await large  # the cancelled backup's page came back
        assert calls and calls[0] == 4
        service.release(result.host_pages)
        for page in range(5, 8):  # the pool and its page states are intact
            again = await service.evict(Pages([page]))
            service.release(again.host_pages)
        await _settle(service)
        _idle(service)
        assert service.statistics() == start


async def test_an_async_hook_is_asked_once_per_shortage(tmp_path):
    """A coroutine hook that frees nothing is not called again until the shortage changes: no
    busy loop of hook calls while a backup waits for host pages."""
    calls = []

    async def hook(pages_needed: int) -> None:
        calls.append(pages_needed)

    service, _ = make_service(tmp_path, host_pages=4, host_wait_timeout_s=0.3)
    service.on_host_pressure = hook
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(4)
        with pytest.raises(HostPoolExhausted):
            await service.evict(Pages([0]))
        assert calls == [1]
        waiting = service.evict(Pages([0, 1]))  # a new shortage: asked again, once
        await _settle(service)
        service.release(held)  # the shortage ends: the backup goes
        service.release((await waiting).host_pages)
        assert calls == [1, 2]


@pytest.mark.parametrize("close", ["whole", "cut"])
async def test_a_hook_still_running_at_close_ends_before_the_pool_goes(tmp_path, close):
    """close() cancels a hook's coroutine and waits for it (its clean-up may still await):
    nothing it triggers afterwards meets a service without a pool. Also when the close is
    itself cut short by a timeout around it while its drain waits for a copy."""
    cleaned_up = asyncio.Event()

    async def hook(pages_needed: int) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # clean-up that awaits
            cleaned_up.set()

    service, _ = make_service(tmp_path, host_pages=3, host_wait_timeout_s=60,
                              drain_timeout_s=0.2 if close == "whole" else 30)
    service.on_host_pressure = hook
    never = threading.Event()  # a producer that never fires: the drain waits for its copy
    async with asyncio.timeout(BOUND_S):
        await service.start()
        held = service.allocate_host_pages(2)
        gated = service.evict(Pages([5]), after=never)
        waiting = service.evict(Pages([0, 1]))  # short of host pages: the hook runs
        await _settle(service)
        if close == "whole":
            await service.close()
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await service.close()
        assert service.state.value == "closed"
        assert cleaned_up.is_set()
        assert waiting.cancelled()
        assert gated.done()
        del held
        await asyncio.sleep(0.1)  # any late callback would run now


# --- producers and dependencies ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["future-cancel", "executor-shutdown"])
async def test_a_cancelled_concurrent_future_fails_its_request(tmp_path, how):
    """A concurrent.futures.Future in after= that is cancelled (by its owner, or by an executor
    shut down with cancel_futures) fails the request at once, as a failed one does."""
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        if how == "future-cancel":
            producer = concurrent.futures.Future()
            executor = None
        else:
            executor = concurrent.futures.ThreadPoolExecutor(1)
            busy = threading.Event()
            executor.submit(busy.wait)
            producer = executor.submit(time.sleep, 0)  # queued behind the busy task
        backup = service.evict(Pages([0]), after=producer)
        await _settle(service)  # its copy now waits for the producer
        if executor is None:
            assert producer.cancel()
        else:
            executor.shutdown(wait=False, cancel_futures=True)
            busy.set()
        with pytest.raises(TransferFailedError, match="was cancelled"):
            await backup
        later = await service.evict(Pages([1]))  # the direction is not held up behind it
        service.release(later.host_pages)
        await _settle(service)
        assert service.statistics() == start


@pytest.mark.parametrize("dependent_state", ["submitted", "queued"])
async def test_a_dependency_cancelled_while_copying_fails_its_dependents(tmp_path,
                                                                         dependent_state):
    """A backup that needs a Transfer named in after= fails when that Transfer is cancelled in
    the engine, whether the backup was in the engine too or still queued behind the in-flight
    bound when the cancel came."""
    layers = 3
    row_bytes = 64 * 132  # one page of one indexer layer
    bound = {"submitted": 1 << 30, "queued": layers * row_bytes}
    service, _ = make_service(tmp_path, layers=layers, max_inflight_bytes_d2h=bound[dependent_state])
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        gate = threading.Event()
        first = service.evict(Pages([0]), after=gate)
        second = service.evict(Pages([1]), after=first)
        await _settle(service)
        assert second._request.state.value == dependent_state
        first.cancel()  # its copy waits in the engine for the gate: it is dropped
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(TransferFailedError, match="cancelled"):
            await second
        await _settle(service)
        assert service.statistics() == start


async def test_a_backup_held_by_in_flight_bytes_is_not_failed_for_host_pages(tmp_path):
    """A backup that first waited for host pages and then only for in-flight bytes waits for
    the bytes as long as they take: the host-wait deadline covers waits for host pages only."""
    layers = 2
    one_page = layers * 64 * 132
    service, _ = make_service(tmp_path, layers=layers, host_pages=4, host_wait_timeout_s=0.2,
                              max_inflight_bytes_d2h=one_page)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        full = service.allocate_host_pages(4)
        waiting = service.evict(Pages([0]))  # no free host page: it waits for one
        await _settle(service)
        service.release(full)
        mine = service.allocate_host_pages(1)
        gate = threading.Event()
        ahead = service.evict(Pages([1]), host_tokens=Pages(mine.pages), after=gate,
                              priority=5)  # goes first and holds the in-flight bound
        await asyncio.sleep(0.5)  # more than the host-wait deadline
        assert not waiting.done()
        gate.set()
        await ahead
        service.release((await waiting).host_pages)
        service.release(mine)
        await _settle(service)
        assert service.statistics() == start


# --- close ----------------------------------------------------------------------------------


async def test_close_during_start_closes_what_start_made(tmp_path):
    """close() while start() runs waits for it and then closes: afterwards nothing runs (no
    engine thread, no reservation) and requests are refused."""
    service, _ = make_service(tmp_path)
    threads_before = set(threading.enumerate())
    async with asyncio.timeout(BOUND_S):
        starting = asyncio.ensure_future(service.start())
        await asyncio.sleep(0)  # start() is under way
        await service.close()
        assert service.state.value == "closed"
        await starting  # start() itself succeeded; close() came after it
        assert service.state.value == "closed"
        with pytest.raises(ServiceClosedError):
            service.evict(Pages([0]))
        await asyncio.sleep(0)
    left = [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("dsa")]
    assert left == []
    assert HostLedger(tmp_path / "ledger").entries() == ()


async def test_a_close_cut_short_while_start_runs_still_closes_what_start_made(tmp_path):
    """close() cancelled (a timeout around it) while it waits for start(): it still waits for
    the start, closes what it made, then raises; the service never runs on."""
    service, _ = make_service(tmp_path, host_pages=8192)
    threads_before = set(threading.enumerate())
    async with asyncio.timeout(BOUND_S):
        starting = asyncio.ensure_future(service.start())
        await asyncio.sleep(0)  # start() is under way
        assert service.state.value == "starting"
        closing = asyncio.ensure_future(service.close())
        await asyncio.sleep(0)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert service.state.value == "closed"
        await starting
        assert service.state.value == "closed"
        with pytest.raises(ServiceClosedError):
            service.evict(Pages([0]))
        await asyncio.sleep(0)
    left = [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("dsa")]
    assert left == []
    assert HostLedger(tmp_path / "ledger").entries() == ()


async def test_a_cancelled_close_still_closes(tmp_path):
    """close() cancelled by a timeout around it (here while a copy waits for a producer that
    never fires) still abandons that wait, stops the engine and returns the pool."""
    service, _ = make_service(tmp_path, drain_timeout_s=30)
    await service.start()
    never = threading.Event()
    backup = service.evict(Pages([0]), after=never)
    await _settle(service)
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(service.close(), 0.2)
        assert service.state.value == "closed"
        assert backup.done()
    assert HostLedger(tmp_path / "ledger").entries() == ()


def _cancel_points() -> list[tuple[int, float]]:
    """Where a cancel may land in close(): after 0..11 loop turns, then after growing delays."""
    return [(turns, 0.0) for turns in range(12)] + [(0, 1e-4 * 2**i) for i in range(10)]


async def test_close_cancelled_at_any_point_still_returns_everything(tmp_path, caplog):
    """Wherever the cancel of a timeout around close() lands (in the drain, stopping the lag
    monitor, closing the engine, returning the reservation), the cancel propagates and
    close() still returned everything: no ledger entry, no engine thread left, the pool gauges
    at 0, the arenas dropped; a second close() returns at once."""
    caplog.set_level(logging.WARNING)
    for point, (turns, delay_s) in enumerate(_cancel_points()):
        service, _ = make_service(tmp_path / str(point))
        await service.start()
        async with asyncio.timeout(BOUND_S):
            await service.evict(Pages([0, 1]))  # a little history: the gauges are not 0
            threads_before = set(threading.enumerate())
            closing = asyncio.ensure_future(service.close())
            for _ in range(turns):
                await asyncio.sleep(0)
            if delay_s:
                await asyncio.sleep(delay_s)
            ended_before_cancel = closing.done()
            closing.cancel()
            try:
                await closing
            except asyncio.CancelledError:
                assert not ended_before_cancel
            await service.close()
            while any(t.is_alive() and t.name.startswith("dsa-async")
                      for t in threads_before):  # an engine close cut short goes on alone
                await asyncio.sleep(0.001)
        label = f"cancel after {turns} turns, {delay_s} s"
        assert service.state.value == "closed", label
        assert HostLedger(tmp_path / str(point) / "ledger").entries() == (), label
        assert service._pool is None, label
        get = service.registry.get_sample_value
        assert {s: get("dsa_async_host_pool_bytes", {"state": s})
                for s in ("used", "free", "in_flight")} == dict.fromkeys(
                    ("used", "free", "in_flight"), 0.0), label
    # the sweep reached the hardest point: a cancel while the engine closed on its thread
    assert any("cancelled while the cpu engine closed" in r.getMessage() for r in caplog.records)


#: Copies queued in one direction behind a producer that never fires: with a check only after
#: each poll (0.1 s) of the CPU engine they would take 8 s to end, one after the other.
BLOCKED_COPIES = 80


@pytest.mark.parametrize("ended_by", ["close", "cancel"])
async def test_many_copies_blocked_on_a_producer_end_together(tmp_path, ended_by):
    """Many copies wait in the engine for thread producers that never fire. When close()
    abandons those waits, or every one of them is cancelled, they all end at once (not one
    engine poll each): close() takes about its drain timeouts, and an eviction submitted after
    the cancelled ones runs without waiting behind them."""
    service, _ = make_service(tmp_path, host_pages=2 * BLOCKED_COPIES, drain_timeout_s=0.05)
    await service.start()
    never = threading.Event()
    blocked = [service.evict(Pages([i % 24]), after=never) for i in range(BLOCKED_COPIES)]
    await _settle(service)
    async with asyncio.timeout(4):  # ~0.5 s now; 8 s when each copy cost a poll
        if ended_by == "close":
            await service.close()
            outcomes = await asyncio.gather(*blocked, return_exceptions=True)
            assert {type(o) for o in outcomes} == {TransferFailedError}
            return
        for transfer in blocked:
            transfer.cancel()
        assert (await service.evict(Pages([0]))).pages == 1
    await service.close()


# --- cancelling a copy that waits for its producer --------------------------------------------


def _errors_counted(service) -> float:
    return sum(service.registry.get_sample_value(
        "dsa_async_transfer_errors_total", {"direction": d}) or 0.0 for d in ("d2h", "h2d"))


@pytest.mark.parametrize("producer_kind", ["event", "future"])
async def test_cancel_drops_a_copy_still_waiting_for_its_producer(tmp_path, producer_kind):
    """A request whose copy waits in the engine for a producer that never fires is dropped
    when cancelled: it ends cancelled (without the producer), returns its host pages, fails
    the requests that needed its data (whose copies never run either), and counts as no copy
    error."""
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        errors = _errors_counted(service)
        producer = (threading.Event() if producer_kind == "event"
                    else concurrent.futures.Future())
        backup = service.evict(Pages([0, 1]), after=producer)  # host pages the service places
        host = service.allocate_host_pages(1)
        load = service.prefetch(host, Pages([2]), after=producer)
        await _settle(service)
        assert backup._request.state.value == "submitted"  # in the engine, waiting
        reader = service.prefetch(backup.host_pages, Pages([3, 4]))  # needs the backup's bytes
        layer = asyncio.ensure_future(load.layer_ready(0))
        reader_layer = asyncio.ensure_future(reader.layer_ready(0))
        parked = asyncio.wrap_future(on_plain_thread(
            lambda: load.wait_layer(0, timeout_s=BOUND_S)))
        await asyncio.sleep(0.05)  # the thread is parked in its wait
        assert backup.cancel() and load.cancel()
        for transfer in (backup, load, layer, parked):
            with pytest.raises(asyncio.CancelledError):
                await transfer
        for transfer in (reader, reader_layer):  # not cancelled: it fails, with its own error
            with pytest.raises(TransferFailedError):
                await transfer
        service.release(host)
        await _settle(service)
        assert service.statistics() == start
        assert _errors_counted(service) == errors  # no copy ran: none failed



async def test_the_hook_is_asked_again_when_the_pages_it_freed_went_elsewhere(tmp_path):
    """Pages the hook freed that another backup took leave the same shortage as before: the
    hook is asked again (host pages changed hands), and the waiting backup gets its pages."""
    held: list = []
    calls = []

    def hook(pages_needed: int) -> None:
        calls.append(pages_needed)
        if held:
            service.release(held.pop())

    service, _ = make_service(tmp_path, host_pages=4, host_wait_timeout_s=5)
    service.on_host_pressure = hook
    async with service, asyncio.timeout(BOUND_S):
        held += [service.allocate_host_pages(2), service.allocate_host_pages(2)]
        waiting = service.evict(Pages([0, 1]))  # short by 2: the hook frees 2 pages
        ahead = service.evict(Pages([2, 3]), priority=5)  # and this one takes them first
        first = await ahead
        second = await waiting
        assert len(calls) == 2
        service.release(first.host_pages)
        service.release(second.host_pages)


async def test_close_cancels_a_backup_that_lacked_host_pages_and_now_waits_for_bytes(tmp_path):
    """close() cancels at once every backup that lacked host pages, also one the last pass
    held back for in-flight bytes (it would lack pages again after them)."""
    layers = 2
    service, _ = make_service(tmp_path, layers=layers, host_pages=2, host_wait_timeout_s=60,
                              max_inflight_bytes_d2h=layers * 64 * 132)
    await service.start()
    full = service.allocate_host_pages(2)
    waiting = service.evict(Pages([0]))  # no free host page
    await _settle(service)
    service.release(full)
    mine = service.allocate_host_pages(1)
    gate = threading.Event()
    ahead = service.evict(Pages([1]), host_tokens=Pages(mine.pages), after=gate, priority=5)
    await _settle(service)  # `waiting` is held for in-flight bytes now
    async with asyncio.timeout(BOUND_S):
        closing = asyncio.ensure_future(service.close())
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        await closing
    assert ahead.done()


@pytest.mark.parametrize("held_by", ["event", "future", "after-transfer"])
async def test_a_backup_that_first_needs_host_pages_after_close_began_ends_at_once(
        tmp_path, held_by, caplog):
    """A backup held by a loop producer (or by an earlier backup that is) until close() has
    begun finds the pool full: it is cancelled at once, the hook is not asked (the closing
    service takes no releases) and close() does not wait its drain timeout for it."""
    asked: list[int] = []
    service, _ = make_service(tmp_path, host_pages=2, host_wait_timeout_s=60,
                              drain_timeout_s=60)
    service.on_host_pressure = asked.append
    await service.start()
    loop = asyncio.get_running_loop()
    gate = loop.create_future() if held_by == "future" else asyncio.Event()
    mine = service.allocate_host_pages(1)
    ahead = None
    if held_by == "after-transfer":  # its own host pages: only the one after it lacks pages
        ahead = service.evict(Pages([0]), host_tokens=Pages(mine.pages), after=gate)
        held = service.evict(Pages([1, 2]), after=ahead)
    else:
        held = service.evict(Pages([1, 2]), after=gate)
    await _settle(service)
    assert service.statistics().queued_requests == (2 if ahead else 1)
    async with asyncio.timeout(BOUND_S):
        closing = asyncio.ensure_future(service.close())
        await asyncio.sleep(0)  # close() has begun draining
        gate.set_result(None) if held_by == "future" else gate.set()
        with pytest.raises(asyncio.CancelledError):
            await held
        await closing
    assert asked == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    if ahead is not None:
        assert (await ahead).pages == 1


async def test_a_start_cancelled_while_it_reserves_returns_the_reservation(tmp_path):
    """start() cancelled while its worker thread waits for the ledger lock (another process
    holds it): the reservation made once the lock is free is returned before start() raises,
    so it does not count against the host budget for the rest of the process."""
    service, _ = make_service(tmp_path)
    with HostLedger(tmp_path / "ledger").transaction():  # as another process's transaction
        starting = asyncio.ensure_future(service.start())
        for _ in range(3):
            await asyncio.sleep(0)  # the reservation's thread is started and waits
        starting.cancel()
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(asyncio.CancelledError):
            await starting
    assert service.state.value == "closed"
    assert HostLedger(tmp_path / "ledger").entries() == ()


async def test_start_cancelled_at_any_step_leaves_nothing_behind(tmp_path):
    """start() cancelled after each number of loop turns, from before it reserves until it
    has started: whatever step it was at, nothing of it is left (no ledger reservation, no
    engine thread) and a close() after it is a no-op."""
    threads_before = set(threading.enumerate())
    for turns in range(40):
        service, _ = make_service(tmp_path / str(turns))
        starting = asyncio.ensure_future(service.start())
        for _ in range(turns):
            await asyncio.sleep(0)
        starting.cancel()
        async with asyncio.timeout(BOUND_S):
            outcome = (await asyncio.gather(starting, return_exceptions=True))[0]
            await service.close()
        assert isinstance(outcome, (asyncio.CancelledError, type(service))), outcome
        assert service.state.value == "closed"
        assert HostLedger(tmp_path / str(turns) / "ledger").entries() == (), turns
    left = [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("dsa")]
    assert left == []


async def test_a_start_cancelled_while_the_engine_is_made_closes_that_engine(tmp_path):
    """start() cancelled (a timeout around it) while the engine's constructor runs on its
    thread (page-locking on CUDA takes a while): start waits for the constructor and closes
    what it made, so no engine thread, page-locked arena or reservation outlives it."""
    made, closed = [], []
    constructing = threading.Event()

    class SlowEngine(CpuEngine):
        def __init__(self, *args, **kwargs):
            constructing.set()
            time.sleep(0.3)
            super().__init__(*args, **kwargs)
            made.append(self)

        def close(self):
            closed.append(self)
            super().close()

    service, _ = make_service(tmp_path)
    service._engine_factory = SlowEngine
    threads_before = set(threading.enumerate())
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await service.start()
    assert constructing.is_set() and made and closed == made
    assert service.state.value == "closed"
    left = [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("dsa")]
    assert left == []
    assert HostLedger(tmp_path / "ledger").entries() == ()


@pytest.mark.parametrize("cause", ["producer-failed", "producer-cancelled", "backup-failed",
                                   "closed-while-waiting"])
async def test_copies_that_never_ran_are_no_copy_errors(tmp_path, cause):
    """``transfer_errors_total`` counts copy batches that ran and failed. A batch that never ran
    (its producer failed or was cancelled, the backup it reads failed, the service closed while
    it waited) fails its requests with CopyNotRunError (a TransferFailedError) or
    ServiceClosedError as the cause, and counts nothing; a copy that did fail counts once."""
    service, _ = make_service(tmp_path, drain_timeout_s=0.05)
    await service.start()
    async with asyncio.timeout(BOUND_S):
        producer = concurrent.futures.Future()
        backup = service.evict(Pages([0, 1]), after=producer)
        await _settle(service)
        assert backup._request.state.value == "submitted"  # in the engine, waiting
        transfers = [backup]
        if cause == "backup-failed":
            transfers.append(service.prefetch(backup.host_pages, Pages([3, 4])))
            await _settle(service)
        if cause == "closed-while-waiting":
            await service.close()
        elif cause == "producer-cancelled":
            producer.cancel()
        else:
            producer.set_exception(RuntimeError("the producing kernel failed"))
        for transfer in transfers:
            with pytest.raises(TransferFailedError) as failed:
                await transfer
            assert isinstance(failed.value.__cause__, (CopyNotRunError, ServiceClosedError))
        assert _errors_counted(service) == 0
        if cause != "closed-while-waiting":
            def fail_the_copy(batch, layer):
                raise RuntimeError("injected copy fault")

            service._fault_hook = fail_the_copy
            service._engine.fault_hook = fail_the_copy
            with pytest.raises(TransferFailedError):
                await service.evict(Pages([5]))
            assert _errors_counted(service) == 1
            await service.close()
