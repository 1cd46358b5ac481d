"""close() returns everything it can whatever the engine does: an engine whose close() raises
(as after a sticky device error) or that never reports a copy still leaves the service CLOSED,
the ledger reservation returned and every request ended; a second close() returns at once."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref

import pytest
from service_fixtures import make_buffers, make_service, tokens

from dsa_async import Pages
from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import ConfigError, ServiceClosedError
from dsa_async.front_door.service import OffloadService, ServiceState
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.host_memory.pool import HostPool
from dsa_async.transfer.batch import BatchHandle
from dsa_async.transfer.cpu import CpuEngine

BOUND_S = 10


class _BrokenClose(CpuEngine):
    def close(self) -> None:
        super().close()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _Silent(CpuEngine):
    """Accepts batches and never runs or reports them (a hung device)."""

    def submit(self, batch):
        return BatchHandle(batch, self.num_layers)


def _service(tmp_path, engine_cls) -> OffloadService:
    geometry = dsa_indexer(num_layers=2)
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"), drain_timeout_s=0.1)
    return OffloadService(config, make_buffers(geometry, 8), engine_factory=engine_cls)


async def test_close_after_the_engine_fails_to_close_returns_everything(tmp_path, caplog):
    service = _service(tmp_path, _BrokenClose)
    await service.start()
    done = await service.evict(tokens([1]))
    async with asyncio.timeout(BOUND_S):
        with caplog.at_level(logging.ERROR):
            await service.close()
        await service.close()  # a second close returns at once
    assert service.state is ServiceState.CLOSED and done.pages == 1
    assert HostLedger(tmp_path / "ledger").entries() == ()
    assert any("illegal memory access" in r.getMessage() or
               (r.exc_info and "illegal memory access" in str(r.exc_info[1]))
               for r in caplog.records)


async def test_close_ends_copies_the_engine_never_reported(tmp_path):
    service = _service(tmp_path, _Silent)
    await service.start()
    stuck = service.evict(tokens([1, 2]))
    await asyncio.sleep(0)  # submitted to the engine, which never reports it
    async with asyncio.timeout(BOUND_S):
        await service.close()
    assert service.state is ServiceState.CLOSED
    assert isinstance(stuck.exception(), ServiceClosedError)
    assert HostLedger(tmp_path / "ledger").entries() == ()


async def test_requests_after_a_failed_close_are_refused(tmp_path):
    service = _service(tmp_path, _BrokenClose)
    await service.start()
    async with asyncio.timeout(BOUND_S):
        await service.close()
    with pytest.raises(ServiceClosedError):
        service.evict(tokens([0]))


async def test_close_cancels_a_long_queue_in_one_pass(tmp_path):
    """close() past its drain timeout cancels what is still queued in time linear in the queue:
    32,768 evictions held by a loop producer all end cancelled well within the bound (ending
    each by copying the rest of its queue took 18 s here), and the loop is free again."""
    count = 32768
    service, _ = make_service(tmp_path, layers=2, host_pages=64, device_pages=32,
                              drain_timeout_s=0.1, max_queued_requests=count)
    await service.start()
    gate = asyncio.Event()  # never set: every request stays queued
    transfers = [service.evict(Pages([i % 32]), after=gate) for i in range(count)]
    assert service.statistics().queued_requests == count
    async with asyncio.timeout(8):
        await service.close()
    assert all(t.cancelled() for t in transfers)


def _watch_arenas(pool, freed: list[str]) -> None:
    """Record the thread on which each arena's memory is returned (its base allocation freed)."""
    for arena in pool.arenas.values():
        base = arena._base if arena._base is not None else arena
        weakref.finalize(base, lambda: freed.append(threading.current_thread().name))


async def test_close_returns_the_arenas_memory_off_the_loop(tmp_path):
    # Unmapping gigabytes takes a few hundred ms: on the loop it would stall every request.
    service, _ = make_service(tmp_path, with_kv=True)
    freed: list[str] = []
    async with asyncio.timeout(BOUND_S):
        await service.start()
        _watch_arenas(service.host_pool, freed)
        done = await service.evict(tokens([1, 2]))
        service.release(done.host_pages)
        await service.close()
        gc.collect()
    assert len(freed) == 2, freed
    assert threading.current_thread().name not in freed, freed


async def test_a_failed_start_returns_the_arenas_memory_off_the_loop(tmp_path, monkeypatch):
    # The error's traceback holds the failed steps' frames: their views of the arenas must not
    # keep the memory until whoever drops the error (here, the loop's thread).
    freed: list[str] = []
    create = HostPool.create

    def watched_create(*args, **kwargs):
        pool = create(*args, **kwargs)
        _watch_arenas(pool, freed)
        return pool

    monkeypatch.setattr(HostPool, "create", watched_create)
    geometry = dsa_indexer(num_layers=2)
    whole = make_buffers(geometry, 9)[0]
    overlapping = [whole[:8], whole[1:]]  # refused after the pool was allocated
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(ConfigError) as refused:
            await OffloadService(config, overlapping).start()
    assert freed and threading.current_thread().name not in freed, freed
    assert "share" in str(refused.value)
