"""Liveness: a request never waits on something that cannot end by itself, and what the
service holds at rest is only what callers hold.

Each test builds, through the public API, a situation in which a request used to be left
queued with nothing in flight, or host pages were left allocated (or freed twice) after every
request ended. ``asyncio.timeout`` bounds every wait: a hang fails the test instead of the run.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from service_fixtures import make_service, tokens

from dsa_async.errors import (HostPoolExhausted, LivenessViolation, TransferFailedError,
                              UnknownHostPagesError)
from dsa_async.transfer.handoff import LoopHandoff

BOUND_S = 10


async def test_a_request_held_by_one_that_fails_in_the_same_flush_still_goes(tmp_path):
    # X: an eviction waiting for host pages (the pool is full), so it stays queued.
    # Y: a backup into host slot s; B: a prefetch of slot s that also waits for X (after=X).
    # A: a prefetch (deadline 0) into B's device page, so it queues behind B.
    # Y is cancelled; then X gives up waiting for host pages. The flush after that ends B as
    # failed (the backup it reads was cancelled): A must then go, with no other traffic.
    service, _ = make_service(tmp_path, host_pages=4, host_wait_timeout_s=0.2)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(4)  # the whole pool
        slots = held.pages.tolist()
        x = service.evict(tokens([9]))  # no free host page: waits, queued
        y = service.evict(tokens([0]), host_tokens=tokens([slots[0]]))
        b = service.prefetch(None, tokens([5]), host_tokens=tokens([slots[0]]), after=x)
        a = service.prefetch(None, tokens([5]), host_tokens=tokens([slots[1]]), deadline_s=0)
        assert y.cancel()
        with pytest.raises(HostPoolExhausted):
            await x
        with pytest.raises(TransferFailedError, match="did not run"):
            await b
        result = await a  # hung here: A stayed queued with nothing in flight
        assert result.pages == 1
        service.release(held)
        assert service.statistics().used_pages == 0


async def test_host_pages_of_a_cancelled_backup_are_freed_once_nothing_reads_them(tmp_path):
    # A backup Y (service-chosen host pages) is cancelled while its copy runs; a queued
    # prefetch P of Y's host pages keeps them busy. P is cancelled too: the pages must go back
    # to the pool then, not at some later completion.
    service, _ = make_service(tmp_path, host_pages=8, host_wait_timeout_s=30)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        gate = threading.Event()
        y = service.evict(tokens([0, 1]), after=gate)  # submitted, blocked on its producer
        await asyncio.sleep(0)  # let the flush allocate and submit it
        assert y.host_pages is not None
        rest = service.allocate_host_pages(6)  # the pool is full now
        x = service.evict(tokens([7]))  # waits for a host page: queued, and holds P queued
        p = service.prefetch(y.host_pages, tokens([3, 4]), after=x)
        assert y.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await y
        assert p.cancel()
        assert service.statistics().used_pages == 6  # y's two pages went back at once
        service.release(rest)
        await x
        service.release(x.result().host_pages)
        assert service.statistics() == start


async def test_the_handle_of_a_cancelled_backup_is_not_the_callers_to_release(tmp_path):
    # The caller saw Transfer.host_pages of a backup that was then cancelled mid-copy. The
    # service frees those pages itself; a release() by the caller is refused, changes nothing,
    # and later completions keep working (they used to raise on the double free, forever).
    service, _ = make_service(tmp_path, host_pages=8, host_wait_timeout_s=30)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        gate = threading.Event()
        y = service.evict(tokens([0, 1]), after=gate)
        await asyncio.sleep(0)
        handle = y.host_pages
        rest = service.allocate_host_pages(6)
        x = service.evict(tokens([7]))  # waits for a host page, holds P queued
        p = service.prefetch(handle, tokens([3, 4]), after=x)  # keeps the pages busy
        y.cancel()
        gate.set()
        await asyncio.gather(y, return_exceptions=True)
        with pytest.raises(UnknownHostPagesError, match="cancelled or failed"):
            service.release(handle)  # while P still reads them
        p.cancel()
        used = service.statistics().used_pages
        with pytest.raises(UnknownHostPagesError):
            service.release(handle)  # after the service freed them
        assert service.statistics().used_pages == used
        service.release(rest)
        await x
        later = await service.evict(tokens([2]))  # a completion after the refused release
        service.release(later.host_pages)
        service.release(x.result().host_pages)
        assert service.statistics() == start


async def test_a_raising_completion_callback_does_not_strand_the_ones_after_it():
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    try:
        handoff = LoopHandoff(loop)
        ran = asyncio.Event()

        def broken() -> None:
            raise RuntimeError("broken callback")

        threading.Thread(target=lambda: (handoff.post(broken), handoff.post(ran.set))).start()
        async with asyncio.timeout(BOUND_S):
            await ran.wait()
        assert [str(e) for e in reported] == ["broken callback"]
    finally:
        loop.set_exception_handler(None)


async def test_an_eviction_larger_than_the_pool_is_refused_at_submit_without_pressure(tmp_path):
    asked = []
    service, _ = make_service(tmp_path, host_pages=4, device_pages=8)
    service.on_host_pressure = asked.append
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        with pytest.raises(HostPoolExhausted) as refused:
            service.evict(tokens([0, 1, 2, 3, 4]))
        for fragment in ("5 pages", "holds 4 pages", "split it", "ServiceConfig.host_pool"):
            assert fragment in str(refused.value)
        assert asked == [] and service.statistics() == start
        whole = await service.evict(tokens([0, 1, 2, 3]))  # exactly the capacity still goes
        service.release(whole.host_pages)


async def test_the_liveness_check_names_a_queued_request_that_nothing_holds(tmp_path):
    service, _ = make_service(tmp_path, host_pages=4)
    async with service, asyncio.timeout(BOUND_S):
        producer = asyncio.get_running_loop().create_future()
        waiting = service.evict(tokens([1]), after=producer)
        await asyncio.sleep(0)
        scheduler = service._scheduler
        scheduler.check_liveness()  # held by its unfinished producer
        request = waiting._request
        request.loop_waits = 0  # as if the producer's wake-up were lost
        with pytest.raises(LivenessViolation, match=f"request {request.seq} "):
            scheduler.check_liveness()
        request.loop_waits = 1
        producer.set_result(None)
        await waiting
        service.release(waiting.result().host_pages)
