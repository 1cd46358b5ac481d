"""Submitting from threads without an event loop (``*_threadsafe``, ``Transfer.wait``).

Bad input raises in the calling thread and hands nothing to the loop; requests from a thread
keep the page-state ordering with requests submitted on the loop; a thread waits, polls and
releases without a round trip through the loop; many submissions cost the loop one wake-up;
the default producer is captured on the submitting thread; close() loses nothing a thread
handed over.

Some tests block the loop thread on purpose (``while_the_loop_is_blocked``) so that nothing a
thread posts can be taken meanwhile: that makes batching and races with the loop deterministic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from service_fixtures import make_service, on_plain_thread, page_bytes, tokens

from dsa_async.bench import thread_scenarios
from dsa_async.bench.measure import MIN_PAIRS
from dsa_async.bench.runner import BenchConfig, run_bench
from dsa_async.errors import (ArgumentTypeError, ArgumentValueError, HostPoolExhausted,
                              IndexTypeError, IndexValueError, PageAlignmentError,
                              PagesInFlightError, QueueFullError,
                              ServiceClosedError, TransferFailedError, UnknownHostPagesError,
                              WrongThreadError)
from dsa_async.kinds import Backend

BOUND_S = 10
LAYERS = 3
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


async def in_thread(fn, bound_s: float = BOUND_S):
    """Run ``fn()`` on a new plain thread (no event loop there); the loop keeps running."""
    async with asyncio.timeout(bound_s):
        return await asyncio.wrap_future(on_plain_thread(fn))


def while_the_loop_is_blocked(fn):
    """Run ``fn()`` on a new thread while the calling (loop) thread blocks: nothing it posts
    is taken before this returns. Returns its result or raises its error."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target, name="no-loop-thread")
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


def same_bytes(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for name in a for x, y in zip(a[name], b[name], strict=True))


def _fill(buffers, pages, value: int) -> None:
    for layers in buffers.values():
        for layer in layers:
            layer[list(pages)] = value


# --- errors raise in the caller's thread ---------------------------------------------------


BAD_CALLS = {
    "device token out of range": (IndexValueError, lambda s, h, r: s.evict_threadsafe(
        torch.tensor([10 ** 6]))),
    "2-D tokens": (IndexValueError, lambda s, h, r: s.evict_threadsafe(
        torch.zeros((2, 2), dtype=torch.int64))),
    "float tokens": (IndexTypeError, lambda s, h, r: s.evict_threadsafe(torch.zeros(3))),
    "in-page offsets differ": (PageAlignmentError, lambda s, h, r: s.evict_threadsafe(
        torch.tensor([1]), host_tokens=h.token_indices()[:1])),
    "after= outside the grammar": (ArgumentTypeError, lambda s, h, r: s.evict_threadsafe(
        tokens([1]), after=object())),
    "nested after=": (ArgumentTypeError, lambda s, h, r: s.evict_threadsafe(
        tokens([1]), after=[[threading.Event()]])),
    "priority not an int": (ArgumentTypeError, lambda s, h, r: s.evict_threadsafe(
        tokens([1]), priority="high")),
    "larger than the pool": (HostPoolExhausted, lambda s, h, r: s.evict_threadsafe(
        tokens(range(20)))),
    "bare tensor as host": (IndexTypeError, lambda s, h, r: s.prefetch_threadsafe(
        h.token_indices(), tokens([1]))),
    "handle and host_tokens": (IndexValueError, lambda s, h, r: s.prefetch_threadsafe(
        h, tokens([1]), host_tokens=h.token_indices())),
    "page counts differ": (IndexValueError, lambda s, h, r: s.prefetch_threadsafe(
        h, tokens([1, 2]))),
    "deadline not finite": (ArgumentValueError, lambda s, h, r: s.prefetch_threadsafe(
        h, tokens([1]), deadline_s=float("nan"))),
    "deadline beyond a float": (ArgumentValueError, lambda s, h, r: s.prefetch_threadsafe(
        h, tokens([1]), deadline_s=10**400)),
    "released handle": (UnknownHostPagesError, lambda s, h, r: s.prefetch_threadsafe(
        r, tokens([1]))),
    "release of a released handle": (UnknownHostPagesError, lambda s, h, r: s.release_threadsafe(
        r)),
    "release of a non-handle": (ArgumentTypeError, lambda s, h, r: s.release_threadsafe(
        h.token_indices())),
    "wait_layer of an eviction": (ArgumentTypeError, lambda s, h, r: s.evict_threadsafe(
        tokens([1])).wait_layer(0)),
    "negative timeout": (ArgumentValueError, lambda s, h, r: s.evict_threadsafe(
        tokens([1])).wait(timeout_s=-1)),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
async def test_bad_input_raises_in_the_calling_thread_and_hands_nothing_over(tmp_path, case):
    error, call = BAD_CALLS[case]
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=24)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        released = service.allocate_host_pages(1)
        service.release(released)
        before = service.statistics()
        wakeups = service.thread_wakeups

        def submit() -> None:
            with pytest.raises(error):  # raised here, in the submitting thread
                call(service, held, released)

        await in_thread(submit)
        if case not in WAITS:  # those hand a valid request over; then the wait raises
            assert service.thread_wakeups == wakeups  # nothing reached the loop
            assert service.statistics() == before
        service.release(held)


#: Cases whose submission is valid: the wait on its transfer raises.
WAITS = ("wait_layer of an eviction", "negative timeout")


@pytest.mark.parametrize("method", ["evict", "prefetch", "release"])
async def test_a_service_that_is_not_running_refuses_in_the_calling_thread(tmp_path, method):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)

    def call():
        if method == "evict":
            service.evict_threadsafe(tokens([1]))
        elif method == "prefetch":
            service.prefetch_threadsafe(None, tokens([1]), host_tokens=tokens([1]))
        else:
            service.release_threadsafe(handle)

    handle = None
    with pytest.raises(ServiceClosedError):  # not started
        await in_thread(call)
    async with service:
        handle = service.allocate_host_pages(1)
    with pytest.raises(ServiceClosedError):  # closed
        await in_thread(call)


def test_every_thread_entry_point_refuses_once_the_services_loop_is_closed(tmp_path):
    """After the loop the service ran on has closed (a server shutting down), each thread
    entry point raises ServiceClosedError, call_threadsafe included, not the loop's own
    RuntimeError."""
    import uvloop

    service, _ = make_service(tmp_path, layers=LAYERS)

    async def run_and_close():
        async with service:
            return service.allocate_host_pages(1)

    handle = uvloop.run(run_and_close())
    calls = {
        "call_threadsafe": lambda: service.call_threadsafe(service.statistics),
        "evict_threadsafe": lambda: service.evict_threadsafe(tokens([1])),
        "prefetch_threadsafe": lambda: service.prefetch_threadsafe(handle, tokens([1])),
        "release_threadsafe": lambda: service.release_threadsafe(handle),
    }
    for name, call in calls.items():
        with pytest.raises(ServiceClosedError):
            call()
            pytest.fail(f"{name} did not refuse")


async def test_loop_only_calls_from_another_thread_are_refused(tmp_path):
    """Every call that changes the loop's state without a lock refuses, on any other thread,
    with WrongThreadError naming the call and the thread-safe way, and changes nothing."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        gate = asyncio.Event()
        queued = service.prefetch(held, tokens([0, 1]), after=gate)
        calls = {
            "evict()": (lambda: service.evict(tokens([2])), "evict_threadsafe"),
            "prefetch()": (lambda: service.prefetch(held, tokens([2, 3])), "prefetch_threadsafe"),
            "release()": (lambda: service.release(held), "release_threadsafe"),
            "allocate_host_pages()": (lambda: service.allocate_host_pages(1), "call_threadsafe"),
            "Transfer.cancel()": (queued.cancel, "call_threadsafe"),
            "Transfer.add_done_callback()": (lambda: queued.add_done_callback(print),
                                             "call_threadsafe"),
            "statistics()": (service.statistics, "call_threadsafe"),
        }
        before = service.statistics()

        def from_a_thread() -> list[str]:
            messages = []
            for name, (call, instead) in calls.items():
                with pytest.raises(WrongThreadError) as refused:
                    call()
                message = str(refused.value)
                assert name in message and instead in message, message
                messages.append(message)
            return messages

        assert len(await in_thread(from_a_thread)) == len(calls)
        assert service.statistics() == before and not queued.done()
        gate.set()
        await queued
        service.release(held)


async def test_the_queue_bound_counts_what_threads_handed_over(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=8,
                              max_queued_requests=3)
    async with service, asyncio.timeout(BOUND_S):
        def submit_four():
            transfers = [service.evict_threadsafe(tokens([i])) for i in range(3)]
            with pytest.raises(QueueFullError):
                service.evict_threadsafe(tokens([3]))
            return transfers

        transfers = while_the_loop_is_blocked(submit_four)
        for transfer in transfers:
            service.release((await transfer).host_pages)


async def test_the_queue_bound_does_not_count_releases_handed_over(tmp_path):
    """Host-page releases a thread posted are not requests: a thread that released pages
    while the loop was busy can still queue as many requests as the bound allows."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=8,
                              max_queued_requests=3)
    async with service, asyncio.timeout(BOUND_S):
        handles = [service.allocate_host_pages(1) for _ in range(4)]

        def release_then_submit():
            for handle in handles:
                service.release_threadsafe(handle)
            transfers = [service.evict_threadsafe(tokens([i])) for i in range(3)]
            with pytest.raises(QueueFullError):
                service.evict_threadsafe(tokens([3]))
            return transfers

        transfers = while_the_loop_is_blocked(release_then_submit)
        for transfer in transfers:
            service.release((await transfer).host_pages)
        assert service.statistics().free_pages == 16


async def test_empty_requests_pass_a_full_queue_and_do_not_count_against_it(tmp_path):
    """An empty request ends at once, done, without queueing: a full queue does not refuse it,
    from the loop or from a thread, and empty ones handed over do not take the room of
    requests that do queue."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=8,
                              max_queued_requests=4)
    gate = asyncio.Event()
    empty = torch.empty(0, dtype=torch.int64)
    async with service, asyncio.timeout(BOUND_S):
        queued = [service.evict(tokens([i]), after=gate) for i in range(3)]

        def empties_then_the_last_room():
            empties = [service.evict_threadsafe(empty) for _ in range(4)]
            empties += [service.prefetch_threadsafe(None, empty, host_tokens=empty)
                        for _ in range(4)]
            last = service.evict_threadsafe(tokens([3]))  # the empties took no room
            with pytest.raises(QueueFullError):
                service.evict_threadsafe(tokens([4]))
            empties.append(service.evict_threadsafe(empty))  # the queue is full now
            return last, empties

        last, empties = while_the_loop_is_blocked(empties_then_the_last_room)
        assert service.statistics().queued_requests == 4  # nothing taken yet
        for transfer in empties:
            assert (await transfer).pages == 0
        with pytest.raises(QueueFullError):
            service.evict(tokens([5]))
        assert (await service.evict(empty)).pages == 0  # on the loop, with the queue full
        assert (await service.prefetch(None, empty, host_tokens=empty)).pages == 0
        assert service.statistics().queued_requests == 4
        gate.set()
        for transfer in [*queued, last]:
            service.release((await transfer).host_pages)
        assert service.statistics().free_pages == 16


async def test_the_queue_count_threads_read_never_drops_while_the_loop_reorders(
        tmp_path, monkeypatch):
    """What a thread counts against the queue bound is the queue's real length at every moment
    of a flush, also while the loop puts the queue in priority order (an in-place sort
    emptied the list meanwhile: a thread posting then read 0 and passed the bound)."""
    from dsa_async.scheduling.request import Request

    count = 40
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=8,
                              max_queued_requests=count)
    gate = asyncio.Event()
    async with service, asyncio.timeout(BOUND_S):
        queued = [service.evict(tokens([i % 8]), after=gate) for i in range(count - 1)]
        seen: list[int] = []
        key = Request.sort_key

        def watching_key(request):
            seen.append(service._inbox.requests_waiting())  # as a posting thread reads it
            return key(request)

        monkeypatch.setattr(Request, "sort_key", watching_key)
        queued.append(service.evict(tokens([0]), after=gate, priority=5))  # out of order
        await asyncio.sleep(0)
        monkeypatch.setattr(Request, "sort_key", key)
        assert seen and set(seen) == {count}, sorted(set(seen))
        gate.set()
        for transfer in queued:
            service.release((await transfer).host_pages)


async def test_statistics_count_requests_threads_handed_over_as_queued(tmp_path):
    """Requests a thread handed over count as queued from the moment the call returns, before
    the loop takes them, as they do against the queue bound."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=8)
    gate = asyncio.Event()
    async with service, asyncio.timeout(BOUND_S):
        posted = while_the_loop_is_blocked(
            lambda: [service.evict_threadsafe(tokens([i]), after=gate) for i in range(3)])
        assert service.statistics().queued_requests == 3  # not taken yet
        await asyncio.sleep(0)
        assert service.statistics().queued_requests == 3  # taken: queued behind the gate
        gate.set()
        for transfer in posted:
            service.release((await transfer).host_pages)
        assert service.statistics().queued_requests == 0


@pytest.mark.parametrize("threads", [2, 8])
async def test_threads_posting_at_once_never_pass_the_queue_bound_together(tmp_path, threads):
    """The bound is checked as a request is posted, under the posters' lock: of many threads
    released at once, exactly as many requests get in as the bound leaves room for, and the
    rest raise QueueFullError in their own threads. (An asyncio.Event producer keeps each
    request in the queue until it is set.)"""
    bound, per_thread = 4, 3
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=64, device_pages=32,
                              max_queued_requests=bound)
    gate = asyncio.Event()
    async with service, asyncio.timeout(BOUND_S):
        def race():
            start = threading.Barrier(threads)
            results: list = []

            def poster(index: int) -> None:
                start.wait()
                for i in range(per_thread):
                    try:
                        results.append(service.evict_threadsafe(
                            tokens([index * per_thread + i]), after=gate))
                    except QueueFullError:
                        results.append(None)

            workers = [threading.Thread(target=poster, args=(i,)) for i in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(BOUND_S)
            return results

        results = while_the_loop_is_blocked(race)
        accepted = [t for t in results if t is not None]
        assert len(results) == threads * per_thread
        assert len(accepted) == min(bound, threads * per_thread)
        await asyncio.sleep(0)  # the loop takes what was posted
        assert service.statistics().queued_requests == len(accepted)
        gate.set()
        for transfer in accepted:
            service.release((await transfer).host_pages)


async def test_loop_and_thread_submissions_share_one_queue_bound(tmp_path):
    """Requests from the loop and from threads, submitted at the same time until refused,
    never hold more than the bound in the queue, and every refusal is QueueFullError. (An
    asyncio.Event producer keeps each request in the queue until it is set.)"""
    bound = 16
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=256, device_pages=128,
                              max_queued_requests=bound)
    gate = asyncio.Event()
    async with service, asyncio.timeout(BOUND_S):
        accepted, peak = [], 0
        stop = threading.Event()

        def thread_poster(first_page: int) -> None:
            while not stop.is_set():
                try:
                    accepted.append(service.evict_threadsafe(tokens([first_page]), after=gate))
                except QueueFullError:
                    pass

        posters = [on_plain_thread(lambda p=p: thread_poster(64 + p)) for p in range(2)]
        for round_ in range(200):
            try:
                accepted.append(service.evict(tokens([round_ % 64]), after=gate))
            except QueueFullError:
                pass
            peak = max(peak, service.statistics().queued_requests)
            await asyncio.sleep(0)
        stop.set()
        for poster in posters:
            await asyncio.wrap_future(poster)
        await asyncio.sleep(0)
        peak = max(peak, service.statistics().queued_requests)
        assert peak == bound and len(accepted) == bound
        gate.set()
        for transfer in accepted:
            service.release((await transfer).host_pages)


@pytest.mark.parametrize("held_by", ["loop-producer", "thread-producer"])
@pytest.mark.parametrize("call", ["wait", "wait_layer"])
@pytest.mark.parametrize("caller", ["this-loop", "another-loop"])
async def test_blocking_waits_refuse_on_a_thread_that_runs_an_event_loop(
        tmp_path, held_by, call, caller):
    """wait() and wait_layer() of a prefetch that is not over (not started: its producer is a
    loop event; started: a thread producer holds its copy) refuse at once on a thread that
    runs an event loop, this service's or another: they would block that loop (here the one
    that has to start the copy). Once the layer is ready they return there at once."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        gate = asyncio.Event() if held_by == "loop-producer" else threading.Event()
        load = service.prefetch(held, tokens([1]), after=gate)
        blocking = (lambda: load.wait(timeout_s=1)) if call == "wait" else (
            lambda: load.wait_layer(LAYERS - 1, timeout_s=1))

        def refused() -> None:
            with pytest.raises(WrongThreadError, match="await transfer|await the transfer"):
                blocking()

        if caller == "this-loop":
            refused()
        else:
            async def on_its_own_loop() -> None:
                refused()
            await asyncio.to_thread(asyncio.run, on_its_own_loop())
        gate.set()
        await load
        blocking()  # over: nothing to wait for, on the loop too
        service.release(held)


# --- round trips and ordering ---------------------------------------------------------------


async def test_a_round_trip_from_a_plain_thread_is_byte_exact_in_every_pool(tmp_path):
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=16, device_pages=24,
                                    with_kv=True)
    async with service:
        original = page_bytes(buffers, [1, 2, 3])

        def round_trip():
            backup = service.evict_threadsafe(torch.arange(70, 200))  # padded to pages 1..3
            result = backup.wait(timeout_s=BOUND_S)
            assert backup.done() and backup.exception() is None
            load = service.prefetch_threadsafe(result.host_pages, torch.arange(640, 832))
            for layer in range(LAYERS):
                load.wait_layer(layer, timeout_s=BOUND_S)
            loaded = load.wait(timeout_s=BOUND_S)
            service.release_threadsafe(result.host_pages)
            return result, loaded

        backed_up, loaded = await in_thread(round_trip)
        assert (backed_up.pages, backed_up.padded_tokens, loaded.pages) == (3, 3 * 64 - 130, 3)
        assert same_bytes(page_bytes(buffers, [10, 11, 12]), original)
        # The release went through the same hand-off, taken before the thread's result came.
        assert service.statistics().used_pages == 0


async def test_a_load_from_a_thread_after_a_backup_on_the_loop_reads_the_backed_up_bytes(tmp_path):
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        expected = page_bytes(buffers, [1, 2])
        gate = threading.Event()  # holds the backup's copy back until the load was submitted
        backup = service.evict(tokens([1, 2]), host_tokens=held.token_indices(), after=gate)
        load = await in_thread(lambda: service.prefetch_threadsafe(held, tokens([5, 6])))
        gate.set()
        await backup
        await load
        assert same_bytes(page_bytes(buffers, [5, 6]), expected)
        service.release(held)


async def test_a_load_on_the_loop_after_a_backup_from_a_thread_reads_the_backed_up_bytes(tmp_path):
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        expected = page_bytes(buffers, [1, 2])
        gate = threading.Event()
        backup = await in_thread(lambda: service.evict_threadsafe(
            tokens([1, 2]), host_tokens=held.token_indices(), after=gate))
        load = service.prefetch(held, tokens([5, 6]))  # the loop heard of the backup: after it
        gate.set()
        await backup
        await load
        assert same_bytes(page_bytes(buffers, [5, 6]), expected)
        service.release(held)


async def test_one_threads_requests_are_accepted_in_the_order_it_submitted_them(tmp_path):
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        first, second = page_bytes(buffers, [1, 2]), page_bytes(buffers, [3, 4])
        gate = threading.Event()

        def submit():
            return [service.evict_threadsafe(tokens([1, 2]), host_tokens=held.token_indices(),
                                             after=gate),
                    service.prefetch_threadsafe(held, tokens([5, 6])),  # reads the 1st backup
                    service.evict_threadsafe(tokens([3, 4]), host_tokens=held.token_indices()),
                    service.prefetch_threadsafe(held, tokens([6, 7]))]  # the 2nd backup

        transfers = while_the_loop_is_blocked(submit)  # all four taken in one batch
        gate.set()
        for transfer in transfers:
            await transfer
        loaded = page_bytes(buffers, [5, 6, 7])
        assert same_bytes({n: [t[:1] for t in v] for n, v in loaded.items()},
                          {n: [t[:1] for t in v] for n, v in first.items()})
        assert same_bytes({n: [t[1:] for t in v] for n, v in loaded.items()}, second)
        service.release(held)


async def test_a_deadline_given_on_a_thread_counts_from_the_submit_on_the_loops_clock(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        loop = asyncio.get_running_loop()
        submitted_at = loop.time()
        load = while_the_loop_is_blocked(
            lambda: service.prefetch_threadsafe(held, tokens([1]), deadline_s=100.0))
        await in_thread(lambda: None)  # the loop took the load
        deadline = load._request.deadline  # the queue orders prefetches by it
        assert submitted_at + 100.0 - 1.0 <= deadline <= loop.time() + 100.0
        await load
        service.release(held)


# --- waits, polls and timeouts ----------------------------------------------------------------


async def test_a_thread_waits_with_a_timeout_then_succeeds(tmp_path):
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        gate = threading.Event()

        def wait_for_a_held_back_eviction():
            backup = service.evict_threadsafe(tokens([1]), after=gate)
            with pytest.raises(TimeoutError, match="keeps running"):
                backup.wait(timeout_s=0.05)
            assert not backup.done()
            gate.set()
            return backup.wait(timeout_s=BOUND_S)

        result = await in_thread(wait_for_a_held_back_eviction)
        assert result.pages == 1
        gate.clear()

        def wait_for_a_held_back_layer():
            load = service.prefetch_threadsafe(result.host_pages, tokens([4]), after=gate)
            with pytest.raises(TimeoutError):
                load.wait_layer(0, timeout_s=0.05)
            with pytest.raises(TimeoutError):
                load.wait(timeout_s=0.01)
            gate.set()
            load.wait_layer(LAYERS - 1, timeout_s=BOUND_S)
            return load.wait(timeout_s=BOUND_S)

        assert (await in_thread(wait_for_a_held_back_layer)).pages == 1
        assert same_bytes(page_bytes(buffers, [4]), page_bytes(buffers, [1]))
        service.release(result.host_pages)


async def test_a_failed_request_raises_its_error_in_the_waiting_thread(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        service.release(held)  # host_tokens now name pages no live allocation holds

        def submit_and_wait():
            transfer = service.evict_threadsafe(tokens([1]), host_tokens=held.token_indices())
            with pytest.raises(UnknownHostPagesError, match="host_tokens names host page"):
                transfer.wait(timeout_s=BOUND_S)  # checked on the loop: the transfer fails
            return transfer

        transfer = await in_thread(submit_and_wait)
        assert isinstance(transfer.exception(), UnknownHostPagesError)
        statistics = service.statistics()
        assert (statistics.used_pages, statistics.in_flight_pages,
                statistics.queued_requests) == (0, 0, 0)


async def test_a_release_on_the_loop_after_a_thread_handed_over_a_load_of_it_is_refused(tmp_path):
    """The loop heard of the load before it released: the load is taken first, so the release
    is refused while it runs, as for a load submitted on the loop."""
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        backup = await service.evict(tokens([1]))
        expected = page_bytes(buffers, [1])
        load = while_the_loop_is_blocked(
            lambda: service.prefetch_threadsafe(backup.host_pages, tokens([2])))
        with pytest.raises(PagesInFlightError):
            service.release(backup.host_pages)  # before the loop took the load
        await load
        assert same_bytes(page_bytes(buffers, [2]), expected)
        service.release(backup.host_pages)
        assert service.statistics().used_pages == 0


@pytest.mark.parametrize("direction", ["evict", "prefetch"])
async def test_host_pages_a_thread_named_are_not_given_to_anyone_else_before_its_copy(
        tmp_path, direction):
    """A thread hands over a copy into (or out of) held host pages; the loop, having heard of
    it, releases them and allocates anew: the release is refused, so the new allocation never
    gets pages that copy still uses, and no one's bytes are overwritten."""
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=2, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        if direction == "prefetch":
            await service.evict(tokens([0, 1]), host_tokens=held.token_indices())
            submit = lambda: service.prefetch_threadsafe(  # noqa: E731
                None, tokens([6, 7]), host_tokens=held.token_indices())
        else:
            submit = lambda: service.evict_threadsafe(  # noqa: E731
                tokens([0, 1]), host_tokens=held.token_indices())
        transfer = while_the_loop_is_blocked(submit)
        with pytest.raises(PagesInFlightError):
            service.release(held)
        with pytest.raises(HostPoolExhausted):
            service.allocate_host_pages(2)  # nothing was freed
        await transfer
        service.release(held)
        other = service.allocate_host_pages(2)
        await service.evict(tokens([4, 5]), host_tokens=other.token_indices())
        await service.prefetch(other, tokens([2, 3]))
        assert same_bytes(page_bytes(buffers, [2, 3]), page_bytes(buffers, [4, 5]))
        service.release(other)


class _PausingTokens(list):
    """Device tokens as a list that holds the submitting thread inside its call, the first
    time their length is asked, until ``go`` is set: the loop acts in the middle of a
    submission, deterministically."""

    def __init__(self, values, inside: threading.Event, go: threading.Event) -> None:
        super().__init__(values)
        self.inside, self.go = inside, go

    def __len__(self) -> int:
        if not self.inside.is_set():
            self.inside.set()
            assert self.go.wait(BOUND_S)
        return super().__len__()


@pytest.mark.parametrize("direction", ["evict", "prefetch"])
async def test_host_pages_released_and_allocated_anew_during_a_threads_submit_fail_it(
        tmp_path, direction):
    """The loop releases held host pages and allocates them anew while a thread is inside a
    submission that names them: the request fails when the loop takes it, and the new owner's
    bytes are not overwritten (nor read as the thread's)."""
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=2, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        inside, go = threading.Event(), threading.Event()
        device = _PausingTokens(tokens([6, 7] if direction == "prefetch" else [0, 1]).tolist(),
                                inside, go)
        if direction == "prefetch":
            submit = lambda: service.prefetch_threadsafe(  # noqa: E731
                None, device, host_tokens=held.token_indices())
        else:
            submit = lambda: service.evict_threadsafe(  # noqa: E731
                device, host_tokens=held.token_indices())
        submitted = on_plain_thread(submit)
        assert await asyncio.to_thread(inside.wait, BOUND_S)
        service.release(held)
        other = service.allocate_host_pages(2)  # the same pages: the pool has no others
        await service.evict(tokens([4, 5]), host_tokens=other.token_indices())
        expected_on_6_7 = page_bytes(buffers, [6, 7])
        go.set()
        transfer = await asyncio.wrap_future(submitted)
        with pytest.raises(UnknownHostPagesError, match="released while this request"):
            await transfer
        assert same_bytes(page_bytes(buffers, [6, 7]), expected_on_6_7)  # nothing loaded
        await service.prefetch(other, tokens([2, 3]))
        assert same_bytes(page_bytes(buffers, [2, 3]), page_bytes(buffers, [4, 5]))
        service.release(other)


async def test_cancelling_a_transfer_the_loop_has_not_taken_yet_cancels_it(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        transfer = while_the_loop_is_blocked(lambda: service.evict_threadsafe(tokens([1])))
        assert transfer.cancel()

        def wait() -> type:
            try:
                transfer.wait(timeout_s=BOUND_S)
            except BaseException as exc:  # noqa: BLE001 - the test looks at its type
                return type(exc)
            return type(None)

        assert await in_thread(wait) is asyncio.CancelledError
        assert transfer.cancelled()
        statistics = service.statistics()
        assert (statistics.used_pages, statistics.queued_requests) == (0, 0)


# --- batching -----------------------------------------------------------------------------


async def test_a_burst_of_submissions_from_a_thread_costs_the_loop_one_wake_up(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=128, device_pages=24)
    async with service, asyncio.timeout(BOUND_S):
        before = service.thread_wakeups
        transfers = while_the_loop_is_blocked(
            lambda: [service.evict_threadsafe(tokens([i % 24])) for i in range(100)])
        assert service.thread_wakeups - before == 1
        results = [await transfer for transfer in transfers]
        before = service.thread_wakeups
        while_the_loop_is_blocked(
            lambda: [service.release_threadsafe(r.host_pages) for r in results])
        assert service.thread_wakeups - before == 1
        await in_thread(lambda: None)  # the releases were taken before this came back
        assert service.statistics().used_pages == 0


# --- release from a thread ------------------------------------------------------------------


async def test_a_release_from_a_thread_while_a_copy_reads_the_pages_returns_them_after_it(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        backup = await service.evict(tokens([1, 2]))
        handle = backup.host_pages
        gate = threading.Event()
        load = service.prefetch(handle, tokens([5, 6]), after=gate)  # reads them, held back
        await in_thread(lambda: service.release_threadsafe(handle))  # never refused
        assert service.statistics().used_pages == 2  # the load still reads them
        with pytest.raises(UnknownHostPagesError, match="frees itself"):
            service.release(handle)  # no longer the caller's
        with pytest.raises(UnknownHostPagesError, match="frees itself"):
            await in_thread(lambda: service.release_threadsafe(handle))
        gate.set()
        await load
        assert service.statistics().used_pages == 0


async def test_handles_released_while_in_use_each_return_when_their_last_copy_ends(tmp_path):
    """Many handles released from a thread while loads still read them: each comes back
    exactly when the last load reading it ends, whatever order the loads end in; and a load's
    end looks only at the released handles that share its pages, not at every one of them.
    (The loads wait for asyncio futures, which hold them on the loop, so they can be let go in
    any order: held back in the engine, they would run in submission order.)"""
    handles_n, loads_per_handle = 10, 2
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=64, device_pages=64)
    loop = asyncio.get_running_loop()
    async with service, asyncio.timeout(3 * BOUND_S):
        handles = [(await service.evict(tokens([2 * i, 2 * i + 1]))).host_pages
                   for i in range(handles_n)]
        gates, loads, target = {}, {}, 2 * handles_n
        for i, handle in enumerate(handles):
            for j in range(loads_per_handle):
                gates[i, j] = loop.create_future()
                loads[i, j] = service.prefetch(handle, tokens([target, target + 1]),
                                               after=gates[i, j])
                target += 2

        def release_all():
            for handle in handles:
                service.release_threadsafe(handle)

        await in_thread(release_all)
        await in_thread(lambda: None)  # the loop has taken every release
        assert service.statistics().used_pages == 2 * handles_n  # all still read
        busy = service._scheduler.hazards.host_pages_busy
        checked: list[int] = []

        def counting(pages):
            checked.append(len(pages))
            return busy(pages)

        service._scheduler.hazards.host_pages_busy = counting
        order = list(gates)
        random.Random(3).shuffle(order)
        pending = dict.fromkeys(range(handles_n), loads_per_handle)
        for i, j in order:
            checked.clear()
            gates[i, j].set_result(None)
            await loads[i, j]
            pending[i] -= 1
            held = sum(2 for left in pending.values() if left)
            assert service.statistics().used_pages == held, (i, j)
            assert len(checked) <= 1, f"the end of one load checked {len(checked)} handles"


# A cancel of a backup already in the engine ends it on the copy thread's report, which cannot
# be ordered before a release a thread posted; a failed producer ends it on the loop in order.
@pytest.mark.parametrize(("ending", "order"), [("cancelled", "release-taken-first"),
                                               ("failed", "release-taken-first"),
                                               ("failed", "ended-first")])
async def test_a_backup_released_from_a_thread_and_ended_undone_frees_its_pages_once(
        tmp_path, ending, order, caplog):
    """The caller releases an eviction's host pages from a thread while the backup still
    writes them, and the backup ends cancelled or failed, the loop taking the release before
    it ends or after (the service has then freed the pages itself, so the posted release is
    moot). Either way the pages come back once, nothing on the loop raises or logs an error,
    the transfer ends, and the service closes cleanly."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        producer: concurrent.futures.Future = concurrent.futures.Future()
        backup = service.evict(tokens([0, 1]), after=producer)  # held back by its producer
        await in_thread(lambda: None)  # accepted, host pages chosen
        handle = backup.host_pages
        assert handle is not None
        if order == "release-taken-first":
            await in_thread(lambda: service.release_threadsafe(handle))
            await in_thread(lambda: None)  # the loop took the release
            assert service.statistics().used_pages == 2  # the backup still writes them
        if ending == "cancelled":
            backup.cancel()
            producer.set_result(None)
            with pytest.raises(asyncio.CancelledError):
                await backup
        else:
            # The producer's failure reaches the loop before a release posted after it.
            producer.set_exception(RuntimeError("the producer's kernel failed"))
            if order == "ended-first":  # posted, not taken: the loop is blocked meanwhile
                while_the_loop_is_blocked(lambda: service.release_threadsafe(handle))
            with pytest.raises(TransferFailedError, match="kernel failed"):
                await backup
        await in_thread(lambda: None)  # the loop took every posted release
        assert service.statistics().used_pages == 0
        # the pool is whole: its every page can be taken again
        again = await service.evict(tokens(range(8)))
        service.release(again.host_pages)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_handle_can_be_released_from_threads_once(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        handle = service.allocate_host_pages(2)

        def release_twice_then_load():
            service.release_threadsafe(handle)
            with pytest.raises(UnknownHostPagesError, match="already released"):
                service.release_threadsafe(handle)
            with pytest.raises(UnknownHostPagesError, match="released"):
                service.prefetch_threadsafe(handle, tokens([1, 2]))

        while_the_loop_is_blocked(release_twice_then_load)
        await in_thread(lambda: None)
        assert service.statistics().used_pages == 0
        with pytest.raises(UnknownHostPagesError):
            await in_thread(lambda: service.release_threadsafe(handle))


async def test_a_release_on_the_loop_after_one_from_a_thread_is_refused(tmp_path, caplog):
    """A handle released from a thread, then loaded or released on the loop: both are
    refused at the call (a load before the loop took that release; a release takes the
    threads' hand-offs first), the pages come back once, nothing is logged."""
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=8)
    async with service, asyncio.timeout(BOUND_S):
        handle = service.allocate_host_pages(2)
        while_the_loop_is_blocked(lambda: service.release_threadsafe(handle))
        with pytest.raises(UnknownHostPagesError, match="released .from a thread"):
            service.prefetch(handle, tokens([1, 2]))  # a load may not read it any more
        with pytest.raises(UnknownHostPagesError, match="already released"):
            service.release(handle)
        await in_thread(lambda: None)
        assert service.statistics().used_pages == 0
        with pytest.raises(UnknownHostPagesError):
            service.release(handle)
        again = service.allocate_host_pages(8)  # the pool is whole
        service.release(again)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- close ----------------------------------------------------------------------------------


async def test_requests_a_thread_submits_while_the_service_closes_all_end(tmp_path):
    service, _ = make_service(tmp_path, layers=LAYERS, host_pages=8, device_pages=24,
                              drain_timeout_s=0.2)
    await service.start()
    held = service.allocate_host_pages(1)
    submitted = threading.Event()
    transfers: list = []
    refused: list[BaseException] = []

    def submit_until_closed() -> None:
        for i in range(10 ** 6):
            try:
                transfers.append(service.evict_threadsafe(
                    tokens([i % 24]), host_tokens=held.token_indices()))
            except QueueFullError:
                pass
            except ServiceClosedError as exc:
                refused.append(exc)
                return
            if len(transfers) == 20:
                submitted.set()

    thread = threading.Thread(target=submit_until_closed, name="no-loop-thread")
    thread.start()
    async with asyncio.timeout(BOUND_S):
        assert await asyncio.to_thread(submitted.wait, BOUND_S)
        await service.close()
        await asyncio.to_thread(thread.join, BOUND_S)
    assert not thread.is_alive() and refused  # submissions after close() began raised
    assert all(t.done() for t in transfers)  # none lost
    outcomes = {"done" if not t.cancelled() and t.exception() is None else
                "cancelled" if t.cancelled() else repr(t.exception()) for t in transfers}
    assert outcomes <= {"done", "cancelled"} and "done" in outcomes


# --- the README example and the bench figure ------------------------------------------------


def test_the_readme_thread_example_runs_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    block = next(b for b in blocks if "evict_threadsafe" in b)
    code = block.replace("/tmp/dsa-async-thread-example-ledger", str(tmp_path / "ledger"))
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "loaded 3 pages from a thread" in done.stdout


async def test_the_threadsafe_bench_figure_is_measured_as_defined():
    run = await run_bench(BenchConfig(backend=Backend.CPU, pairs=MIN_PAIRS),
                          [thread_scenarios.threadsafe], progress=lambda line: None)
    assert run.errors == {}  # the scenario raises if host pages stay held after its rounds
    assert set(run.results) == {thread_scenarios.THREADSAFE_RATIO.name,
                                thread_scenarios.THREADSAFE_US.name}
    assert run.results[thread_scenarios.THREADSAFE_RATIO.name] > 0
    assert run.results[thread_scenarios.THREADSAFE_US.name] > 0
