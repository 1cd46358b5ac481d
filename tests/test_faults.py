"""Faults on the CPU backend: failing copies, raising completion callbacks, broken or hanging
reclaim callbacks, cancellation at every await point, close with work in flight, an exhausted
budget, and reservations of dead or PID-reused processes. Each ends every request clearly,
leaves the service usable (or cleanly closed) and leaks no pages or reservations."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from fake_roots import GIB, MIB, make_root, write_meminfo
from service_fixtures import make_buffers, make_service, page_bytes, tokens

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import HostBudgetExceeded, HostPoolExhausted, TransferFailedError
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.ledger import LEDGER_SCHEMA, HostLedger, read_process_start_ticks
from dsa_async.kinds import Direction
from dsa_async.transfer.cpu import CpuEngine

BOUND_S = 10
REPO = Path(__file__).resolve().parents[1]
LAYERS = 4


def _ledger_entries(tmp_path) -> tuple:
    return HostLedger(tmp_path / "ledger").entries()


class Switch:
    """The fault hook the engine holds from start(); ``current`` is what it runs now."""

    def __init__(self, current=None) -> None:
        self.current = current

    def __call__(self, batch, first_layer):
        if self.current is not None:
            self.current(batch, first_layer)


# --- failing copies ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, LAYERS - 1])
async def test_h2d_failure_at_layer_k_reaches_every_waiter(tmp_path, k):
    left = {"n": 1}

    def fail_at_k(batch, first_layer):
        if batch.direction is Direction.H2D and first_layer == k and left["n"]:
            left["n"] -= 1
            raise RuntimeError(f"injected H2D failure at layer {k}")

    service, buffers = make_service(tmp_path, layers=LAYERS, with_kv=True)
    service._fault_hook = fail_at_k
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        expected = page_bytes(buffers, [3, 4])
        backup = await service.evict(tokens([3, 4]))
        gate = threading.Event()
        load = service.prefetch(backup.host_pages, tokens([9, 10]), after=gate)
        layers = [asyncio.ensure_future(load.layer_ready(j)) for j in range(LAYERS)]
        whole = [asyncio.ensure_future(load) for _ in range(2)]
        gate.set()
        outcomes = await asyncio.gather(*layers, *whole, return_exceptions=True)
        for j in range(LAYERS):
            if j < k:
                assert outcomes[j] is None, f"layer {j} < {k} should have landed"
            else:
                assert isinstance(outcomes[j], TransferFailedError), outcomes[j]
        for outcome in outcomes[LAYERS:]:
            assert isinstance(outcome, TransferFailedError)
            assert f"layer {k}" in str(outcome.__cause__)
        for name, per_layer in expected.items():  # layers before k carry the backed-up bytes
            for j in range(k):
                assert torch.equal(buffers[name][j][[9, 10]], per_layer[j])
        assert service.statistics().in_flight_pages == 0
        again = await service.prefetch(backup.host_pages, tokens([9, 10]))  # still usable
        assert again.pages == 2
        service.release(backup.host_pages)
        assert service.statistics() == start
    assert _ledger_entries(tmp_path) == ()


@pytest.mark.parametrize("explicit", [False, True], ids=["service-chosen", "explicit"])
async def test_d2h_failure_frees_the_pages_the_service_allocated(tmp_path, explicit):
    def fail_d2h(batch, first_layer):
        if batch.direction is Direction.D2H:
            raise RuntimeError("injected D2H failure")

    hook = Switch(fail_d2h)
    service, _ = make_service(tmp_path, layers=LAYERS)
    service._fault_hook = hook
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        host = service.allocate_host_pages(3) if explicit else None
        held = service.statistics()
        kwargs = {"host_tokens": host.token_indices()} if explicit else {}
        backup = service.evict(tokens([1, 2, 5]), **kwargs)
        load = service.prefetch(None, tokens([7, 8, 9]), host_tokens=host.token_indices()) \
            if explicit else None
        with pytest.raises(TransferFailedError, match="injected D2H failure"):
            await backup
        if explicit:  # the prefetch that needed those bytes fails too, and says why
            with pytest.raises(TransferFailedError):
                await load
            assert service.statistics() == held  # the caller's pages stay the caller's
            service.release(host)
        assert service.statistics() == start
        hook.current = None
        result = await service.evict(tokens([1]))
        service.release(result.host_pages)
        assert service.statistics() == start


class _RefusingEngine(CpuEngine):
    """A CPU engine whose ``submit`` raises while ``refuse`` is set (a device that was lost
    between two batches), before it takes the batch."""

    refuse = False

    def submit(self, batch):
        if self.refuse:
            raise RuntimeError("injected: the engine refused the batch")
        return super().submit(batch)


async def test_a_batch_the_engine_refuses_fails_its_requests_and_leaks_nothing(tmp_path):
    """Whatever raises while a batch is handed to the engine ends each of its requests failed,
    with the cause: none stays queued, the service's own host pages go back to the pool, the
    caller's stay the caller's, and later requests (also of the same pages) run."""
    service, buffers = make_service(tmp_path, layers=LAYERS)
    engines = []

    def factory(*args, **kwargs):
        engines.append(_RefusingEngine(*args, **kwargs))
        return engines[-1]

    service._engine_factory = factory
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        host = service.allocate_host_pages(2)
        held = service.statistics()
        engines[0].refuse = True
        placed = service.evict(tokens([1, 2, 5]))  # host pages the service places
        explicit = service.evict(tokens([3, 4]), host_tokens=host.token_indices())
        load = service.prefetch(host, tokens([7, 8]))  # needs the explicit backup's bytes
        for transfer in (placed, explicit):
            with pytest.raises(TransferFailedError, match="could not be handed") as failed:
                await transfer
            assert "injected: the engine refused" in str(failed.value.__cause__)
        with pytest.raises(TransferFailedError, match="failed; it did not run"):
            await load  # its backup never ran
        await asyncio.sleep(0)  # the pass after the failures publishes the gauges
        assert service.statistics() == held  # nothing queued or in flight; pages returned
        engines[0].refuse = False
        backup = await service.evict(tokens([1, 2]))
        await service.prefetch(backup.host_pages, tokens([7, 8]))
        for layer in buffers["indexer"]:
            assert torch.equal(layer[7:9], layer[1:3])
        service.release(backup.host_pages)
        service.release(host)
        assert service.statistics() == start
    assert _ledger_entries(tmp_path) == ()


async def test_a_raising_done_callback_is_reported_and_breaks_nothing(tmp_path):
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        service, _ = make_service(tmp_path)
        async with service, asyncio.timeout(BOUND_S):
            start = service.statistics()
            seen = []

            def broken(_t):
                raise RuntimeError("callback bug")

            backup = service.evict(tokens([2]))
            backup.add_done_callback(broken)
            backup.add_done_callback(seen.append)  # later callbacks still run
            result = await backup
            for _ in range(3):  # let the callbacks run
                await asyncio.sleep(0)
            assert seen == [backup]
            assert any(isinstance(c.get("exception"), RuntimeError) and
                       "callback bug" in str(c["exception"]) for c in reported), reported
            again = await service.prefetch(result.host_pages, tokens([3]))
            assert again.pages == 1
            service.release(result.host_pages)
            assert service.statistics() == start
    finally:
        loop.set_exception_handler(previous)


# --- host pressure ---------------------------------------------------------------------------


def _check_exhausted(error: BaseException, needed: int, capacity: int) -> None:
    message = str(error)
    assert isinstance(error, HostPoolExhausted)
    for fragment in (f"needed {needed}", "free 0", f"capacity {capacity}", "host_wait_timeout_s"):
        assert fragment in message, message


@pytest.mark.parametrize("kind", ["raises", "async-raises", "hangs"])
async def test_a_broken_reclaim_callback_fails_the_eviction_in_time(tmp_path, kind, caplog):
    never = asyncio.Event()
    calls: list[int] = []
    hung: list[asyncio.Task] = []

    def raises(n):
        calls.append(n)
        raise RuntimeError("reclaim bug")

    async def async_raises(n):
        calls.append(n)
        raise RuntimeError("reclaim bug")

    async def hangs(n):
        calls.append(n)
        hung.append(asyncio.current_task())
        await never.wait()

    callback = {"raises": raises, "async-raises": async_raises, "hangs": hangs}[kind]
    service, _ = make_service(tmp_path, host_pages=8, host_wait_timeout_s=0.2)
    service.on_host_pressure = callback
    await service.start()
    try:
        async with asyncio.timeout(BOUND_S):
            start = service.statistics()
            everything = service.allocate_host_pages(8)
            with caplog.at_level(logging.ERROR, logger="dsa_async.scheduler"):
                waiting = service.evict(tokens([0, 1]))
                with pytest.raises(HostPoolExhausted) as failed:
                    await waiting
            _check_exhausted(failed.value, 2, 8)
            assert calls and calls[0] == 2
            if kind != "hangs":
                assert "reclaim bug" in caplog.text or "on_host_pressure" in caplog.text
            service.release(everything)
            assert service.statistics() == start
            result = await service.evict(tokens([0, 1]))  # usable again
            service.release(result.host_pages)
    finally:
        async with asyncio.timeout(BOUND_S):
            await service.close()  # a hanging callback does not hold close() up
    assert all(t.cancelled() for t in hung)
    assert _ledger_entries(tmp_path) == ()


@pytest.mark.parametrize("timeout_s", [0.0001, 0.0004, 0.0015, 0.05])
async def test_evictions_waiting_for_host_pages_expire_for_any_timeout(tmp_path, timeout_s):
    """The host-wait timer for any timeout, down to ones uvloop runs as soon as it can (under
    about half a millisecond it returns a plain Handle, not a TimerHandle): several evictions
    that start waiting in one turn, and one more on each later turn, each fail with
    HostPoolExhausted and nothing reaches the loop's exception handler."""
    service, _ = make_service(tmp_path, host_pages=8, host_wait_timeout_s=timeout_s)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        everything = service.allocate_host_pages(8)
        waiting = [service.evict(tokens([i])) for i in range(3)]  # one turn
        for i in range(3, 6):  # later turns, while the earlier ones still wait or just ended
            await asyncio.sleep(0)
            waiting.append(service.evict(tokens([i])))
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        for outcome in outcomes:
            _check_exhausted(outcome, 1, 8)
        service.release(everything)
        assert service.statistics() == start


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_a_reclaim_callback_that_frees_pages_lets_the_eviction_go(tmp_path, is_async):
    service, buffers = make_service(tmp_path, host_pages=4, host_wait_timeout_s=5)
    held = []

    def reclaim(n):
        while held:
            service.release(held.pop())

    async def reclaim_async(n):
        await asyncio.sleep(0)
        reclaim(n)

    service.on_host_pressure = reclaim_async if is_async else reclaim
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        held.append(service.allocate_host_pages(4))
        expected = page_bytes(buffers, [5, 6])
        result = await service.evict(tokens([5, 6]))
        assert result.pages == 2 and not held
        await service.prefetch(result.host_pages, tokens([10, 11]))
        for name in expected:
            for j, layer in enumerate(buffers[name]):
                assert torch.equal(layer[[10, 11]], expected[name][j])
        service.release(result.host_pages)
        assert service.statistics() == start


# --- cancellation at every await point -------------------------------------------------------


class Blocker:
    """A fault hook that parks the worker at ``layer`` until released (a copy mid-run)."""

    def __init__(self, direction: Direction, layer: int = 0) -> None:
        self.direction, self.layer = direction, layer
        self.running, self.proceed = threading.Event(), threading.Event()

    def __call__(self, batch, first_layer):
        if batch.direction is self.direction and first_layer == self.layer:
            self.running.set()
            assert self.proceed.wait(BOUND_S)


@pytest.mark.parametrize("point", ["before-submit", "queued", "copy-running", "layer-ready"])
@pytest.mark.parametrize("cancel_request", [False, True], ids=["task-only", "and-request"])
async def test_cancelling_at_every_await_point_leaks_nothing(tmp_path, point, cancel_request):
    hook = Switch()
    service, _ = make_service(tmp_path, layers=LAYERS)
    service._fault_hook = hook
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        backup = await service.evict(tokens([1, 2]))
        host = backup.host_pages
        blocker = hook.current = Blocker(Direction.H2D, layer=1)
        gate = threading.Event()
        made: list = []

        async def consumer():
            load = service.prefetch(host, tokens([8, 9]), after=gate)
            made.append(load)
            if point == "layer-ready":
                await load.layer_ready(LAYERS - 1)
            return await load

        task = asyncio.ensure_future(consumer())
        if point != "before-submit":
            await asyncio.sleep(0)  # the task submits and starts awaiting
            if point in ("copy-running", "layer-ready"):
                gate.set()
                assert await asyncio.to_thread(blocker.running.wait, BOUND_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if made:
            load = made[0]
            if cancel_request:
                load.cancel()
            gate.set()
            blocker.proceed.set()
            outcome = await asyncio.gather(load, return_exceptions=True)
            assert load.done()
            if not cancel_request:
                assert outcome[0].pages == 2  # the task's cancellation left the copy alone
        else:
            assert point == "before-submit"
        blocker.proceed.set()
        hook.current = None
        assert service.statistics().in_flight_pages == 0
        service.release(host)
        assert service.statistics() == start


async def test_close_with_work_in_flight_ends_every_request(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, drain_timeout_s=0.3,
                              host_wait_timeout_s=30, max_inflight_bytes_d2h=4 * 8448 * LAYERS)
    hook = Switch()
    service._fault_hook = hook
    await service.start()
    backup = await service.evict(tokens([0, 1]))
    blocker = hook.current = Blocker(Direction.H2D, layer=1)
    gate = threading.Event()
    transfers = [service.prefetch(backup.host_pages, tokens([2, 3]))]  # runs, parked mid-copy
    transfers += [service.evict(tokens([i]), after=gate) for i in range(4, 12)]  # some queued
    transfers.append(service.evict(tokens(list(range(12, 24)))))  # waits for host pages
    assert await asyncio.to_thread(blocker.running.wait, BOUND_S)
    closing = asyncio.ensure_future(service.close())
    await asyncio.sleep(0.4)  # past drain_timeout_s: queued work is cancelled, copies continue
    assert not closing.done()  # a started copy is never torn
    gate.set()
    blocker.proceed.set()
    async with asyncio.timeout(BOUND_S):
        await closing
    outcomes = []
    for t in transfers:
        assert t.done()
        outcomes.append("cancelled" if t.cancelled() else
                        "failed" if t.exception() else "done")
    assert outcomes[0] == "done" and outcomes[-1] == "cancelled", outcomes
    assert "cancelled" in outcomes[1:-1], outcomes
    assert _ledger_entries(tmp_path) == ()


# --- budget and ledger ----------------------------------------------------------------------

BUDGET = 64 * MIB


def _budget_service(tmp_path, root, nbytes, *, name="svc"):
    config = ServiceConfig(geometries=(dsa_indexer(num_layers=3),), backend="cpu",
                           host_pool=PoolSize(bytes=nbytes), budget_root=str(root),
                           ledger_directory=str(tmp_path / "ledger"), reserve_bytes=0)
    return OffloadService(config, make_buffers(config.geometries[0], 8))


@pytest.fixture
def root(tmp_path):
    return make_root(tmp_path, mem_total_bytes=GIB, mem_available_bytes=BUDGET)


async def test_second_service_is_refused_naming_the_first_reservation(tmp_path, root):
    first = _budget_service(tmp_path, root, 48 * MIB)
    async with first:
        taken = first.host_pool.capacity_bytes  # the first allocated it: MemAvailable drops
        write_meminfo(root, mem_total_bytes=GIB, mem_available_bytes=(BUDGET - taken) // 1024 * 1024)
        second = _budget_service(tmp_path, root, 32 * MIB)
        with pytest.raises(HostBudgetExceeded) as refused:
            await second.start()
        message = str(refused.value)
        for fragment in ("requested:", "available:", f"pid {os.getpid()} 'indexer'",
                         str(tmp_path / "ledger" / "ledger.json")):
            assert fragment in message, message
        fits = refused.value.max_pages_that_fit  # the figure the message gives, as a number
        assert fits is not None and f"largest that fits: {fits:,} pages" in message, message
        assert [e.pid for e in _ledger_entries(tmp_path)] == [os.getpid()]  # only the first
        assert first.statistics().used_pages == 0  # the first is untouched and still works
        result = await first.evict(tokens([1]))
        first.release(result.host_pages)
    assert _ledger_entries(tmp_path) == ()
    write_meminfo(root, mem_total_bytes=GIB, mem_available_bytes=BUDGET)
    async with _budget_service(tmp_path, root, 32 * MIB):
        pass


def _spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


HOLDER = """
import sys, time
from dsa_async.geometry import dsa_indexer
from dsa_async.ledger import HostLedger
from dsa_async.plan import reserve_host_pools
plan, reservation = reserve_host_pools([dsa_indexer(num_layers=3)], requested_bytes=int(sys.argv[1]),
                                       root=sys.argv[2], ledger=HostLedger(sys.argv[3]), reserve_bytes=0)
print("HELD", flush=True)
time.sleep(120)
"""


async def test_reservation_of_a_killed_process_is_reclaimed(tmp_path, root):
    child = _spawn(HOLDER, str(48 * MIB), str(root), str(tmp_path / "ledger"))
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        assert line.strip() == "HELD"
        with pytest.raises(HostBudgetExceeded, match=f"pid {child.pid} 'indexer'"):
            await _budget_service(tmp_path, root, 48 * MIB).start()
        child.kill()  # SIGKILL: it never releases
        await asyncio.to_thread(child.wait, 30)
        async with _budget_service(tmp_path, root, 48 * MIB) as service:
            assert [e.pid for e in _ledger_entries(tmp_path)] == [os.getpid()]
            result = await service.evict(tokens([0]))
            service.release(result.host_pages)
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()
    assert _ledger_entries(tmp_path) == ()


def _write_ledger(directory: Path, pid: int, start_ticks: int) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / "ledger.json"
    path.write_text(json.dumps({"schema": LEDGER_SCHEMA, "entries": [{
        "id": "other", "pid": pid, "start_time_ticks": start_ticks, "label": "indexer",
        "reserved_bytes": 48 * MIB, "allocated_bytes": 0}]}))
    path.chmod(0o600)


@pytest.mark.parametrize("same_start", [True, False], ids=["live-owner", "reused-pid"])
async def test_a_live_pid_counts_only_with_its_own_start_time(tmp_path, root, same_start):
    sleeper = _spawn("import time; time.sleep(120)")
    try:
        ticks = read_process_start_ticks(sleeper.pid)
        assert ticks is not None
        _write_ledger(tmp_path / "ledger", sleeper.pid, ticks if same_start else ticks - 1)
        service = _budget_service(tmp_path, root, 32 * MIB)
        if same_start:  # a live owner keeps its reservation
            with pytest.raises(HostBudgetExceeded, match=f"pid {sleeper.pid} 'indexer'"):
                await service.start()
            assert [e.entry_id for e in _ledger_entries(tmp_path)] == ["other"]
        else:  # the PID now belongs to another process: the old entry is gone
            async with service:
                assert [e.pid for e in _ledger_entries(tmp_path)] == [os.getpid()]
            assert _ledger_entries(tmp_path) == ()
    finally:
        sleeper.kill()
        sleeper.wait(30)
        sleeper.stdout.close()


async def test_close_does_not_hang_on_a_producer_that_never_finishes(tmp_path):
    service, _ = make_service(tmp_path, drain_timeout_s=0.2)
    await service.start()
    never = threading.Event()
    stuck = service.evict(tokens([0]), after=never)
    async with asyncio.timeout(BOUND_S):
        await service.close()
    assert stuck.done() and isinstance(stuck.exception(), TransferFailedError)
    assert "never ran" in str(stuck.exception())
    assert HostLedger(tmp_path / "ledger").entries() == ()
