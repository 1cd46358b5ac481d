"""OffloadService on the CPU backend: byte-exact moves, ordering, backpressure, cancellation,
failures and a draining close. Waits are bounded with asyncio.timeout; nothing sleeps to wait."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch
from service_fixtures import PAGE, make_service, page_bytes, tokens

from dsa_async.errors import (
    PageAlignmentError,
    PagesInFlightError,
    ServiceClosedError,
    TransferFailedError,
    UnknownHostPagesError,
)
from dsa_async.front_door.service import OffloadService
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.kinds import Direction

BOUND_S = 10  # generous: only proves nothing hangs


def _assert_pages_equal(expected: dict, buffers: dict, pages) -> None:
    got = page_bytes(buffers, pages)
    for name in expected:
        for layer, (a, b) in enumerate(zip(expected[name], got[name])):
            assert torch.equal(a, b), f"pool {name} layer {layer} differs"


async def test_round_trip_is_byte_exact_across_pools_with_padding(tmp_path):
    service, buffers = make_service(tmp_path, with_kv=True)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        expected = page_bytes(buffers, [3, 4, 9])
        device = torch.cat([tokens([3, 4])[5:], tokens([9])[:7]])  # partial first and last pages
        backup = await service.evict(device)
        assert backup.pages == 3 and backup.padded_tokens == 5 + 57
        for layers in buffers.values():
            for layer in layers:
                layer[[3, 4, 9]] = 0  # the device pages get reused
        loaded = await service.prefetch(backup.host_pages, tokens([10, 11, 12]))
        assert loaded.bytes == 3 * service.host_pool.bytes_per_page
        _assert_pages_equal(expected, buffers, [10, 11, 12])
        service.release(backup.host_pages)
        assert service.statistics() == start


async def test_layers_become_ready_in_layer_order(tmp_path):
    service, buffers = make_service(tmp_path, layers=8)
    async with service, asyncio.timeout(BOUND_S):
        backup = await service.evict(tokens([1, 2]))
        gate = threading.Event()  # the copy starts only once every waiter is registered
        load = service.prefetch(backup.host_pages, tokens([5, 6]), after=gate)
        order: list[int] = []
        waits = [asyncio.ensure_future(load.layer_ready(i)) for i in reversed(range(8))]
        for layer, waiter in zip(reversed(range(8)), waits):
            waiter.add_done_callback(lambda _f, layer=layer: order.append(layer))
        await asyncio.sleep(0)  # let the waiters register (in reverse layer order)
        gate.set()
        await asyncio.gather(*waits)
        await load
        assert order == sorted(order) and len(order) == 8
        service.release(backup.host_pages)


async def test_forward_pass_thread_waits_layer_by_layer(tmp_path):
    service, buffers = make_service(tmp_path, layers=6)
    async with service, asyncio.timeout(BOUND_S):
        expected = page_bytes(buffers, [0])
        backup = await service.evict(tokens([0]))
        load = service.prefetch(backup.host_pages, tokens([7]))

        def forward_pass() -> list[bool]:
            seen = []
            for layer in range(6):
                load.wait_layer(layer)
                seen.append(torch.equal(buffers["indexer"][layer][7], expected["indexer"][layer][0]))
            return seen

        assert await asyncio.to_thread(forward_pass) == [True] * 6
        await load
        service.release(backup.host_pages)


async def test_misaligned_pairs_are_refused_at_the_door_and_change_nothing(tmp_path):
    service, _ = make_service(tmp_path)
    async with service:
        host = service.allocate_host_pages(2)
        before = service.statistics()
        host_tokens = host.token_indices()[:3]
        with pytest.raises(PageAlignmentError, match="pair 0"):
            service.evict(torch.tensor([65, 66, 67]), host_tokens=host_tokens)
        assert service.statistics() == before
        service.release(host)


async def test_prefetch_of_a_backup_in_flight_returns_the_backed_up_bytes(tmp_path):
    service, buffers = make_service(tmp_path, with_kv=True)
    async with service, asyncio.timeout(BOUND_S):
        host = service.allocate_host_pages(2)
        expected = page_bytes(buffers, [4, 5])
        producer = threading.Event()  # the backup cannot start until "the kernel" finished
        backup = service.evict(tokens([4, 5]), host_tokens=host.token_indices(), after=producer)
        load = service.prefetch(host, tokens([14, 15]))  # reads pages whose backup is queued
        await asyncio.sleep(0)
        assert not load.done()
        producer.set()
        await backup
        await load
        _assert_pages_equal(expected, buffers, [14, 15])
        service.release(host)


async def test_reeviction_waits_for_the_prefetch_reading_the_host_pages(tmp_path):
    service, buffers = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        host = service.allocate_host_pages(1)
        first = page_bytes(buffers, [1])
        await service.evict(tokens([1]), host_tokens=host.token_indices())
        gate = threading.Event()
        load = service.prefetch(host, tokens([8]), after=gate)  # holds the old host bytes
        again = service.evict(tokens([2]), host_tokens=host.token_indices())  # overwrites them
        gate.set()
        await load
        await again
        _assert_pages_equal(first, buffers, [8])  # the load saw the first backup, not the second
        service.release(host)


async def test_backpressure_holds_inflight_bytes_under_the_bound(tmp_path):
    page_bytes_all = 3 * (8448)
    service, _ = make_service(tmp_path, max_inflight_bytes_d2h=4 * page_bytes_all)
    async with service, asyncio.timeout(BOUND_S):
        gate = threading.Event()
        transfers = [service.evict(tokens([i]), after=gate) for i in range(10)]
        await asyncio.sleep(0)  # one loop tick: the flush runs
        stats = service.statistics()
        assert stats.inflight_requests == 4 and stats.queued_requests == 6
        gate.set()
        results = await asyncio.gather(*transfers)
        for r in results:
            service.release(r.host_pages)


async def test_cancelling_before_the_copy_returns_everything_at_once(tmp_path):
    service, _ = make_service(tmp_path, max_inflight_bytes_d2h=3 * 8448)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        gate = threading.Event()
        running = service.evict(tokens([0]), after=gate)
        queued = service.evict(tokens([1]))  # behind the bound: not started
        await asyncio.sleep(0)
        assert queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert running.cancel()  # started: completes first, then returns its pages
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert service.statistics() == start


async def test_cancelling_an_awaiting_task_never_cancels_the_copy(tmp_path):
    service, buffers = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        gate = threading.Event()
        backup = service.evict(tokens([2]), after=gate)
        waiter = asyncio.ensure_future(backup)
        other = asyncio.ensure_future(backup)
        await asyncio.sleep(0)
        waiter.cancel()
        gate.set()
        result = await other
        assert result.pages == 1 and not backup.cancelled()
        service.release(result.host_pages)


async def test_a_failed_batch_reaches_every_waiter_and_the_service_keeps_going(tmp_path):
    failures = {"left": 1}

    def fail_once(batch, first_layer):
        if batch.direction is Direction.H2D and first_layer == 1 and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected copy failure at layer 1")

    service, buffers = make_service(tmp_path)
    service._fault_hook = fail_once
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        backup = await service.evict(tokens([3]))
        load = service.prefetch(backup.host_pages, tokens([9]))
        await load.layer_ready(0)  # layer 0 landed before the failure
        with pytest.raises(TransferFailedError, match="layer 1"):
            await load.layer_ready(1)
        with pytest.raises(TransferFailedError):
            await load
        again = await service.prefetch(backup.host_pages, tokens([9]))
        assert again.pages == 1
        service.release(backup.host_pages)
        assert service.statistics() == start


async def test_release_of_pages_in_flight_is_refused_and_changes_nothing(tmp_path):
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        host = service.allocate_host_pages(1)
        gate = threading.Event()
        backup = service.evict(tokens([0]), host_tokens=host.token_indices(), after=gate)
        before = service.statistics()
        with pytest.raises(PagesInFlightError):
            service.release(host)
        assert service.statistics() == before
        gate.set()
        await backup
        service.release(host)
        with pytest.raises(UnknownHostPagesError):
            service.release(host)


async def test_in_flight_pages_count_each_host_page_once_while_any_copy_uses_it(tmp_path):
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        slots = service.allocate_host_pages(3)
        host = slots.token_indices()
        gate = threading.Event()
        backup = service.evict(tokens([0, 1]), host_tokens=host[:2 * PAGE], after=gate)
        load = service.prefetch(None, tokens([5]), host_tokens=host[:PAGE])  # reads page 0
        again = service.evict(tokens([2]), host_tokens=host[PAGE:2 * PAGE])  # rewrites page 1
        assert service.statistics().in_flight_pages == 2
        with pytest.raises(PagesInFlightError, match="2 of its 3 pages are in flight"):
            service.release(slots)
        gate.set()
        await asyncio.gather(backup, load, again)
        assert service.statistics().in_flight_pages == 0
        service.release(slots)


async def test_close_during_heavy_traffic_ends_every_request_and_leaks_nothing(tmp_path):
    service, _ = make_service(tmp_path, host_pages=64, drain_timeout_s=0.5)
    await service.start()
    gate = threading.Event()
    transfers = [service.evict(tokens([i % 20]), after=gate if i < 5 else None)
                 for i in range(200)]
    closing = asyncio.ensure_future(service.close())
    await asyncio.sleep(0)
    with pytest.raises(ServiceClosedError):
        service.evict(tokens([1]))
    gate.set()
    async with asyncio.timeout(BOUND_S):
        await closing
    outcomes = {"done": 0, "cancelled": 0, "failed": 0}
    for t in transfers:
        assert t.done()
        if t.cancelled():
            outcomes["cancelled"] += 1
        elif t.exception() is not None:
            outcomes["failed"] += 1
        else:
            outcomes["done"] += 1
    assert sum(outcomes.values()) == 200 and outcomes["done"] > 0
    assert HostLedger(tmp_path / "ledger").entries() == ()  # reservation returned
    await service.close()  # idempotent


async def test_the_loop_never_stalls_while_a_large_copy_runs(tmp_path):
    service, _ = make_service(tmp_path, layers=61, host_pages=400, device_pages=400)
    async with service, asyncio.timeout(60):
        loop = asyncio.get_running_loop()
        worst = 0.0
        gc.collect()  # earlier tests' garbage is not this service's to collect mid-measurement
        backup = service.evict(range(0, 400 * PAGE))  # ~206 MB through the worker thread
        while not backup.done():
            before = loop.time()
            await asyncio.sleep(0.002)  # the probe: how late does the loop wake up?
            worst = max(worst, loop.time() - before - 0.002)
        result = await backup
        assert result.pages == 400
        assert worst < 0.050, f"the loop stalled {worst * 1e3:.1f} ms during the copy"
        service.release(result.host_pages)


async def test_requests_from_another_thread_go_through_call_threadsafe(tmp_path):
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        future = await asyncio.to_thread(
            lambda: service.call_threadsafe(service.evict, tokens([5])).result(BOUND_S))
        result = await future
        service.release(result.host_pages)


async def test_sglang_shaped_buffers_move_with_kv_sharing_page_ids(tmp_path):
    from dsa_async.config import PoolSize, ServiceConfig
    from dsa_async.geometry import KvDtype, dsa_indexer, mla_kv

    size, page, layers = 1024, 64, 3
    indexer = [torch.randint(0, 256, ((size + page + 1) // page, page * 132), dtype=torch.uint8)
               for _ in range(layers)]
    kv = [torch.randint(0, 256, (size + page, 1, 656), dtype=torch.uint8) for _ in range(layers)]
    config = ServiceConfig(geometries=(dsa_indexer(num_layers=layers),
                                       mla_kv(KvDtype.FP8, num_layers=layers)),
                           host_pool=PoolSize(pages=16), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    async with OffloadService(config, {"indexer": indexer, "kv": kv}) as service, \
            asyncio.timeout(BOUND_S):
        kv_before = [layer[2 * page:3 * page].clone() for layer in kv]
        idx_before = [layer[2].clone() for layer in indexer]
        backup = await service.evict(torch.arange(2 * page + 3, 2 * page + 40))
        await service.prefetch(backup.host_pages, torch.arange(5 * page, 6 * page))
        for layer in range(layers):
            assert torch.equal(indexer[layer][5], idx_before[layer])
            assert torch.equal(kv[layer][5 * page:6 * page], kv_before[layer])
        service.release(backup.host_pages)


async def test_requests_before_start_and_after_close_are_refused(tmp_path):
    service, _ = make_service(tmp_path)
    with pytest.raises(ServiceClosedError, match="start"):
        service.evict(tokens([0]))
    async with service:
        pass
    with pytest.raises(ServiceClosedError):
        service.statistics()


async def test_empty_request_is_a_no_op(tmp_path):
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        result = await service.evict(torch.empty(0, dtype=torch.int64))
        assert result.pages == 0 and service.statistics() == start


async def test_prefetches_go_by_deadline_then_priority(tmp_path):
    one_page = 3 * 8448
    service, _ = make_service(tmp_path, max_inflight_bytes_h2d=one_page)
    async with service, asyncio.timeout(BOUND_S):
        backup = await service.evict(tokens([0]))
        order: list[str] = []
        # Deadlines are seconds from each submit, so only requests without one tie exactly;
        # those go by priority.
        plan = [("late-low", None, 0), ("late-high", None, 5), ("soon", 0.5, 0),
                ("sooner", 0.2, 9), ("soonest", 0.1, 0)]
        loads = []
        for target, (name, deadline, priority) in enumerate(plan, start=10):
            load = service.prefetch(backup.host_pages, tokens([target]), deadline_s=deadline,
                                    priority=priority)
            load.add_done_callback(lambda _t, name=name: order.append(name))
            loads.append(load)
        await asyncio.gather(*loads)
        assert order == ["soonest", "sooner", "soon", "late-high", "late-low"]
        service.release(backup.host_pages)


async def test_evictions_go_by_priority(tmp_path):
    service, _ = make_service(tmp_path, max_inflight_bytes_d2h=3 * 8448)
    async with service, asyncio.timeout(BOUND_S):
        order: list[int] = []
        backups = []
        for page, priority in enumerate([0, 3, 1, 7]):
            backup = service.evict(tokens([page]), priority=priority)
            backup.add_done_callback(lambda _t, priority=priority: order.append(priority))
            backups.append(backup)
        results = await asyncio.gather(*backups)
        assert order == [7, 3, 1, 0]
        for result in results:
            service.release(result.host_pages)


async def test_close_frees_the_arenas_even_while_transfers_are_kept(tmp_path):
    import weakref

    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        kept = service.evict(tokens([1]))  # the caller keeps its Transfer after close
        await kept
        arena = weakref.ref(service.host_pool.arenas["indexer"])
    gc.collect()
    assert arena() is None and kept.done()


async def test_cancelling_a_queued_rewrite_keeps_later_loads_behind_the_running_backup(tmp_path):
    # Two backups into the same host slot: the second waits (backpressure) behind the first,
    # which waits on its producer. Cancelling the second must not hide the first from a load.
    service, buffers = make_service(tmp_path, max_inflight_bytes_d2h=3 * 8448)
    async with service, asyncio.timeout(BOUND_S):
        expected = page_bytes(buffers, [2])
        slot = service.allocate_host_pages(1)
        gate = threading.Event()
        first = service.evict(tokens([2]), host_tokens=slot.token_indices(), after=gate)
        second = service.evict(tokens([3]), host_tokens=slot.token_indices())
        await asyncio.sleep(0)  # one tick: the first is submitted, the second stays queued
        assert second.cancel() and second.cancelled()
        load = service.prefetch(None, tokens([5]), host_tokens=slot.token_indices())
        assert first._request in [dep for dep, needs_data in load._request.deps if needs_data], \
            "the load must follow the backup still writing its host page"
        gate.set()
        await first
        await load
        _assert_pages_equal(expected, buffers, [5])
        service.release(slot)


async def test_finished_requests_are_freed_without_the_garbage_collector(tmp_path):
    # Reference cycles would keep every request's objects alive until a collection, and
    # collections of a server-sized heap pause the loop: requests must not make any.
    service, _ = make_service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        async def round_trip() -> None:
            backup = await service.evict(tokens([1, 2]))
            load = service.prefetch(backup.host_pages, tokens([5, 6]))
            await load.layer_ready(0)
            await load
            service.release(backup.host_pages)

        await round_trip()  # warm-up: lazily made objects of the service itself
        gc.collect()
        gc.disable()
        try:
            for _ in range(50):
                await round_trip()
            unreachable = gc.collect()
        finally:
            gc.enable()
        assert unreachable == 0, f"{unreachable} objects were only freed by the collector"
