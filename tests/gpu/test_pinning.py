"""Page-locking the host arena in place: exactly its bytes, undone on close, errors isolated."""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest
import torch

from dsa_async.errors import HostBudgetExceeded
from dsa_async.geometry import dsa_indexer, mla_kv
from dsa_async.host_memory.pool import HostPool
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.cuda import CudaEngine
from dsa_async.transfer.handoff import LoopHandoff
from dsa_async.transfer.pinning import (
    CUDA_SUCCESS,
    HOST_PAGE_BYTES,
    HostPinning,
    _unregister,
    run_isolated,
)

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)


def at_address(ptr: int, nbytes: int = 1) -> torch.Tensor:
    """A CPU tensor whose storage starts at ``ptr`` (``is_pinned`` looks at the storage start)."""
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return torch.from_numpy(array)


def locked(ptr: int) -> bool:
    return at_address(ptr).is_pinned()


def kernel_runs_cleanly() -> bool:
    """A launch on this thread succeeds: no stale CUDA error was left behind."""
    x = torch.arange(1024, device=DEVICE)
    total = int((x * 2).sum())
    torch.cuda.synchronize()
    return total == 1023 * 1024


def make_engine(pool, engine_cls=CudaEngine):
    bindings = {
        g.name: bind_pool(g, pool.arenas[g.name],
                          torch.zeros(g.num_layers, 4, g.bytes_per_page_per_layer,
                                      dtype=torch.uint8, device=DEVICE))
        for g in pool.geometries
    }
    loop = asyncio.new_event_loop()
    try:
        return engine_cls(bindings, LoopHandoff(loop), lambda handle: None)
    finally:
        loop.close()


def test_engine_page_locks_exactly_the_arena_bytes_and_unlocks_on_close():
    pool = HostPool.create([dsa_indexer(num_layers=61)], 3 * 7)
    arena = pool.arenas["indexer"]
    nbytes = arena.nbytes  # its own bytes: a page-aligned view into a slightly larger block
    assert nbytes == 3 * 8448 * 61 * 7 and nbytes & (nbytes - 1)  # not a power of two
    ptr = arena.data_ptr()
    engine = make_engine(pool)
    try:
        assert engine.pinned_bytes == nbytes
        assert locked(ptr) and locked(ptr + nbytes // 2) and locked(ptr + nbytes - 1)
        assert arena.is_pinned()
    finally:
        engine.close()
    assert engine.pinned_bytes == 0
    assert not locked(ptr) and not locked(ptr + nbytes - 1)
    assert kernel_runs_cleanly()


def test_every_pool_arena_is_locked_once():
    pool = HostPool.create([dsa_indexer(num_layers=3), mla_kv(num_layers=3)], 11)
    engine = make_engine(pool)
    try:
        # (a partial end page another arena's registration already holds stays pageable)
        edges = engine._pinning.pageable_edge_bytes
        assert engine.pinned_bytes + edges == sum(a.nbytes for a in pool.arenas.values())
    finally:
        engine.close()


class ChunkedEngine(CudaEngine):
    pin_chunk_bytes = 1 << 20


def test_chunked_registration_covers_the_arena_with_page_aligned_inner_boundaries():
    pool = HostPool.create([dsa_indexer(num_layers=61)], 21)
    arena = pool.arenas["indexer"]
    engine = make_engine(pool, ChunkedEngine)
    try:
        regs = engine._pinning.registrations
        assert len(regs) > 1 and sum(r.nbytes for r in regs) == arena.nbytes
        end = arena.data_ptr() + arena.nbytes
        assert regs[0].start == arena.data_ptr() and regs[-1].stop == end
        assert all(r.start % HOST_PAGE_BYTES == 0 for r in regs[1:])
    finally:
        engine.close()
    assert not locked(arena.data_ptr())


def test_unaligned_range_is_registered_exactly_and_unregistering_twice_is_refused():
    buffer = torch.empty(3 << 20, dtype=torch.uint8)
    ptr, nbytes = buffer.data_ptr() + 100, (3 << 20) - 300
    pinning = HostPinning(DEVICE, chunk_bytes=1 << 20)
    pinning.register(ptr, nbytes, "test range")
    assert pinning.pinned_bytes + pinning.pageable_edge_bytes == nbytes
    assert locked(ptr + HOST_PAGE_BYTES) and locked(ptr + nbytes - HOST_PAGE_BYTES - 1)
    starts = [r.start for r in pinning.registrations]
    assert pinning.unregister_all() == []
    assert pinning.pinned_bytes == 0 and not locked(ptr + HOST_PAGE_BYTES)
    again = run_isolated(DEVICE, lambda: _unregister(starts[0]))
    assert again != CUDA_SUCCESS  # no longer registered
    assert kernel_runs_cleanly()  # the refusal did not leak into this thread's error state


def test_memory_locked_by_its_owner_is_left_alone():
    owned = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    pinning = HostPinning(DEVICE)
    pinning.register_tensor_bytes(owned, "caller buffer")
    assert pinning.pinned_bytes == 0
    assert pinning.foreign_bytes == owned.untyped_storage().nbytes()
    assert pinning.unregister_all() == []
    assert owned.is_pinned()
    assert kernel_runs_cleanly()


def test_neighbours_sharing_a_page_are_both_locked_or_trimmed_not_refused():
    buffer = torch.empty(8 * HOST_PAGE_BYTES, dtype=torch.uint8)
    base = -(-buffer.data_ptr() // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    first = (base + 100, base + HOST_PAGE_BYTES + 100)
    second = (first[1], base + 4 * HOST_PAGE_BYTES)  # shares page 1 with ``first``
    pinning = HostPinning(DEVICE)
    try:
        for start, stop in (first, second):
            pinning.register(start, stop - start, "neighbour")
        requested = (first[1] - first[0]) + (second[1] - second[0])
        accounted = pinning.pinned_bytes + pinning.pageable_edge_bytes + pinning.foreign_bytes
        assert accounted == requested
        assert pinning.pinned_bytes >= requested - HOST_PAGE_BYTES
        print(f"shared page: pinned {pinning.pinned_bytes} B, "
              f"left pageable {pinning.pageable_edge_bytes} B")
    finally:
        assert pinning.unregister_all() == []
    assert kernel_runs_cleanly()


def test_refused_registration_names_the_bytes_and_leaves_no_error_behind():
    pinning = HostPinning(DEVICE)
    with pytest.raises(HostBudgetExceeded, match="cudaHostRegister refused") as info:
        pinning.register(HOST_PAGE_BYTES, 2 * HOST_PAGE_BYTES, "unmapped range")  # never mapped
    assert "8,192 B" in str(info.value) and "unmapped range" in str(info.value)
    assert pinning.pinned_bytes == 0
    assert kernel_runs_cleanly()
