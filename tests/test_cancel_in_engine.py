"""Cancelling requests the engine already holds: one queued behind a blocked copy ends at once
and returns its pages; one whose copy ran still fails what needed its bytes, in whatever order
the engine hands the two endings to the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
from service_fixtures import make_service, tokens

from dsa_async.errors import TransferFailedError
from dsa_async.kinds import Direction
from dsa_async.transfer.cpu import CpuEngine

BOUND_S = 30  # generous: only proves nothing waits for the blocked copy


async def _until(condition) -> None:
    """Loop turns (and the engine's threads) until ``condition()``; the caller's timeout
    bounds it."""
    while not condition():
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
async def test_a_cancel_behind_a_blocked_copy_returns_its_pages_before_that_copy_ends(
        tmp_path, direction):
    service, _ = make_service(tmp_path, layers=2, host_pages=8, device_pages=16)
    gate = threading.Event()  # the copy ahead waits for it: a producer that has not finished
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        if direction is Direction.D2H:
            blocked = service.evict(tokens([1]), after=gate)
            behind = service.evict(tokens([2, 3, 4]))  # the service picks its host pages
        else:
            source = (await service.evict(tokens([1]))).host_pages
            other = (await service.evict(tokens([2, 3]))).host_pages
            blocked = service.prefetch(source, tokens([9]), after=gate)
            behind = service.prefetch(other, tokens([10, 11]))
        await _until(lambda: service.statistics().inflight_requests == 2)  # both in the engine
        before = service.statistics()
        assert behind.cancel()
        with pytest.raises(asyncio.CancelledError):
            await behind
        assert not gate.is_set() and not blocked.done()
        now = service.statistics()
        assert now.inflight_requests == 1
        if direction is Direction.D2H:  # its three host pages are free again
            assert now.used_pages == before.used_pages - 3
        else:  # nothing reads those host pages any more: they can be released
            service.release(other)
            assert service.statistics().used_pages == before.used_pages - 2
        gate.set()
        result = await blocked
        service.release(result.host_pages if direction is Direction.D2H else source)
        assert service.statistics() == start


async def test_a_load_fails_when_its_backup_was_cancelled_mid_copy_whichever_ending_comes_first(
        tmp_path, monkeypatch):
    """The backup's copy ran but it was cancelled meanwhile, so what it wrote counts as
    unknown and the load that read it fails: also when the engine hands the load's ending to
    the loop before the backup's (two copy threads race to do so)."""
    entered, go = threading.Event(), threading.Event()

    def hold_the_backup(batch, first_layer):
        if batch.direction is Direction.D2H and not go.is_set():
            entered.set()
            go.wait(BOUND_S)

    report = CpuEngine._report
    held_back = []

    def load_ending_first(engine, handle, due):
        if handle.batch.direction is Direction.D2H:
            held_back.append((engine, handle, due))
            return
        report(engine, handle, due)
        for args in held_back:
            report(*args)
        held_back.clear()

    monkeypatch.setattr(CpuEngine, "_report", load_ending_first)
    service, _ = make_service(tmp_path, layers=2, host_pages=8, device_pages=16)
    service._fault_hook = hold_the_backup
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        host = service.allocate_host_pages(2)
        backup = service.evict(tokens([1, 2]), host_tokens=host.token_indices())
        load = service.prefetch(None, tokens([7, 8]), host_tokens=host.token_indices())
        await asyncio.to_thread(entered.wait, BOUND_S)  # the backup is copying
        assert backup.cancel()
        go.set()
        with pytest.raises(TransferFailedError, match="was cancelled; its copy ran"):
            await load
        with pytest.raises(asyncio.CancelledError):
            await backup
        service.release(host)
        assert service.statistics() == start
