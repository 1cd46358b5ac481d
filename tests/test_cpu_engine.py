"""The CPU engine: byte-exact round trips for every layout and buffer shape, both directions at
once, and per-layer readiness in layer order."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
import torch

from dsa_async.geometry import HostLayout, dsa_indexer, mla_kv
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Direction
from dsa_async.transfer.batch import CopyBatch, Dependency
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.copyplan import measure_fused_for_short_runs
from dsa_async.transfer.cpu import CpuEngine
from dsa_async.transfer.handoff import LoopHandoff

DEVICE_PAGES, HOST_PAGES = 40, 64


def _device(geometry, fused: bool, gen: torch.Generator):
    shape = (geometry.num_layers, DEVICE_PAGES, geometry.bytes_per_page_per_layer)
    whole = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if fused:
        return [whole[i] for i in range(geometry.num_layers)]  # views of one allocation
    return [whole[i].clone() for i in range(geometry.num_layers)]  # separate allocations


def _engine(layout, fused, layers, with_kv, done):
    geometries = [dsa_indexer(num_layers=layers, host_layout=layout)]
    if with_kv:
        geometries.append(mla_kv(num_layers=layers, host_layout=layout))
    pool = HostPool.create(geometries, HOST_PAGES)
    gen = torch.Generator().manual_seed(layers)
    device = {g.name: _device(g, fused, gen) for g in geometries}
    bindings = {g.name: bind_pool(g, pool.arenas[g.name], device[g.name]) for g in geometries}
    if fused:
        assert all(b.device_fused is not None for b in bindings.values())
    engine = CpuEngine(bindings, LoopHandoff(asyncio.get_running_loop()), done.append)
    return engine, device


def _page_sets(rng, n):
    """Host extents with device runs of 4, single pages scattered on both sides, and one run
    on both sides (the plan's one-segment shortcut)."""
    start = int(rng.integers(0, HOST_PAGES - n))
    runs = rng.choice(DEVICE_PAGES // 4, -(-n // 4), replace=False) * 4
    extent_device = (runs[:, None] + np.arange(4)).reshape(-1)[:n]
    yield np.arange(start, start + n), extent_device
    yield rng.choice(HOST_PAGES, n, replace=False), rng.choice(DEVICE_PAGES, n, replace=False)
    device_start = int(rng.integers(0, DEVICE_PAGES - n))
    yield np.arange(start, start + n), np.arange(device_start, device_start + n)


async def _round_trip_is_exact(engine, device, host_pages, device_pages, rng,
                               load_waits: bool | None = None) -> None:
    """Back ``device_pages`` up into ``host_pages``, load them into other device pages, and
    check every pool's layers carry the original bytes there. ``load_waits``: the load is
    submitted while its producer is unfinished (the engine binds its layers during the wait)
    or after the backup ended (it binds them layer by layer); ``None``: as it happens."""
    n = host_pages.size
    targets = rng.permutation(np.setdiff1d(np.arange(DEVICE_PAGES), device_pages))
    targets = targets[:n].astype(np.int64)
    index = torch.from_numpy(device_pages)
    expected = {k: [t[index].clone() for t in v] for k, v in device.items()}
    backup = engine.submit(CopyBatch(Direction.D2H, host_pages, device_pages))
    producer = threading.Event()
    if load_waits is False:
        await asyncio.to_thread(backup.done.wait)
        producer.set()
    load = engine.submit(CopyBatch(Direction.H2D, host_pages, targets,
                                   deps=(Dependency(backup, True),), after=(producer,)))
    if load_waits:
        while not engine._queues[Direction.H2D].empty():  # the worker took it: it waits now
            await asyncio.sleep(0)
        assert not load.done.is_set()
    producer.set()
    await asyncio.to_thread(load.done.wait)
    assert backup.error is None and load.error is None
    for name, layers_ in device.items():
        for layer, tensor in enumerate(layers_):
            got = tensor[torch.from_numpy(targets)]
            assert torch.equal(got, expected[name][layer]), (name, layer)


@pytest.mark.parametrize("layers", [1, 61])
@pytest.mark.parametrize("fused", [False, True], ids=["per-layer", "fused"])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("with_kv", [False, True], ids=["indexer", "indexer+kv"])
async def test_round_trips_are_byte_exact(layout, fused, layers, with_kv):
    done = []
    engine, device = _engine(layout, fused, layers, with_kv, done)
    rng = np.random.default_rng(layers + 7 * fused)
    try:
        async with asyncio.timeout(60):
            for n in (1, 5, 12):
                for host_pages, device_pages in _page_sets(rng, n):
                    host_pages = host_pages.astype(np.int64)
                    device_pages = device_pages.astype(np.int64)
                    for load_waits in (True, False):
                        await _round_trip_is_exact(engine, device, host_pages, device_pages,
                                                   rng, load_waits)
    finally:
        await asyncio.to_thread(engine.close)


async def test_both_directions_run_at_once_and_stay_exact():
    done = []
    engine, device = _engine(HostLayout.LAYER_FIRST, False, 8, True, done)
    try:
        async with asyncio.timeout(60):
            first = engine.submit(CopyBatch(Direction.D2H, np.arange(0, 20), np.arange(0, 20)))
            await asyncio.to_thread(first.done.wait)
            expected = {k: [t[0:20].clone() for t in v] for k, v in device.items()}
            # Load pages 0..19 back into 20..39 while backing up 20..39 elsewhere first:
            # the load must wait for that backup (it overwrites what the backup reads).
            backup = engine.submit(CopyBatch(Direction.D2H, np.arange(20, 40), np.arange(20, 40)))
            old = {k: [t[20:40].clone() for t in v] for k, v in device.items()}
            load = engine.submit(CopyBatch(Direction.H2D, np.arange(0, 20), np.arange(20, 40),
                                           deps=(Dependency(backup, False),)))
            await asyncio.to_thread(load.done.wait)
            for name, layers in device.items():
                arena = engine.bindings[name].host
                for layer, tensor in enumerate(layers):
                    assert torch.equal(tensor[20:40], expected[name][layer])
                    assert torch.equal(arena[layer, 20:40], old[name][layer])
    finally:
        await asyncio.to_thread(engine.close)


@pytest.mark.parametrize("fused", [False, True], ids=["per-layer", "fused"])
async def test_layers_become_ready_in_order_seen_by_callbacks(fused):
    done = []
    engine, _ = _engine(HostLayout.LAYER_FIRST, fused, 61, False, done)
    try:
        async with asyncio.timeout(60):
            producer = threading.Event()  # the copy starts once every callback is registered
            handle = engine.submit(CopyBatch(Direction.H2D, np.arange(0, 30), np.arange(5, 35),
                                             after=(producer,)))
            order: list[int] = []
            loop = asyncio.get_running_loop()
            ended = loop.create_future()
            for layer in reversed(range(61)):
                def seen(layer=layer):
                    order.append(layer)
                    if len(order) == 61 and not ended.done():
                        ended.set_result(None)
                if not handle.on_layer_ready(layer, seen):
                    seen()
            producer.set()
            await ended
            assert order == sorted(order)
            await asyncio.to_thread(handle.done.wait)
            assert handle.error is None and handle.layers_ready == 61
    finally:
        await asyncio.to_thread(engine.close)


def test_the_one_run_plan_is_the_general_plan(monkeypatch):
    from dsa_async.transfer import copyplan

    host, device = np.arange(5, 45), np.arange(100, 140)
    fast = copyplan.PagePlan.build(host, device)
    monkeypatch.setattr(copyplan, "is_run", lambda pages: False)
    general = copyplan.PagePlan.build(host, device)
    assert fast.runs.tolist() == general.runs.tolist() and fast.mode is general.mode
    assert [(s.host_start, s.num_pages, s.device_start, s.device_index) for s in fast.segments] \
        == [(s.host_start, s.num_pages, s.device_start, s.device_index) for s in general.segments]


@pytest.mark.parametrize("fused_for_short_runs", [True, False])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
async def test_both_copy_paths_of_a_fused_view_are_byte_exact(layout, fused_for_short_runs):
    """Whichever path the start-up measurement picks for scattered pages moves the same bytes."""
    done = []
    engine, device = _engine(layout, True, 7, True, done)
    engine.bindings = {n: dataclasses.replace(b, fused_for_short_runs=fused_for_short_runs)
                       for n, b in engine.bindings.items()}
    rng = np.random.default_rng(5)
    try:
        async with asyncio.timeout(60):
            for n in (1, 9, 20):
                host_pages = rng.choice(HOST_PAGES, n, replace=False).astype(np.int64)
                device_pages = rng.choice(DEVICE_PAGES, n, replace=False).astype(np.int64)
                await _round_trip_is_exact(engine, device, host_pages, device_pages, rng)
    finally:
        await asyncio.to_thread(engine.close)


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_measuring_the_fused_copy_path_changes_no_device_or_host_byte(layout):
    geometry = dsa_indexer(num_layers=5, host_layout=layout)
    pool = HostPool.create([geometry], HOST_PAGES)
    pool.arenas[geometry.name].view(-1).random_(0, 256)
    gen = torch.Generator().manual_seed(3)
    layers = _device(geometry, True, gen)
    binding = bind_pool(geometry, pool.arenas[geometry.name], layers)
    device_before = torch.stack(layers).clone()
    arena_before = pool.arenas[geometry.name].clone()
    assert measure_fused_for_short_runs(binding) in (True, False)
    assert torch.equal(torch.stack(layers), device_before)
    assert torch.equal(pool.arenas[geometry.name], arena_before)
    separate = bind_pool(geometry, pool.arenas[geometry.name], [t.clone() for t in layers])
    assert separate.device_fused is None and measure_fused_for_short_runs(separate) is False


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("fail_at", [None, 0, 1, 7, 30])
async def test_a_load_of_scattered_pages_is_ready_up_to_the_layer_that_failed(
        monkeypatch, threads, fail_at):
    """A load scattered on both sides is copied by the crew a layer per thread without
    lockstep (one thread: layer by layer, without a crew): its layers still become ready in
    order, the bytes land, and a copy that fails at a layer leaves exactly the layers before it
    ready, as a layer-by-layer loop would."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    done = []
    engine, device = _engine(HostLayout.LAYER_FIRST, False, 61, True, done)
    rng = np.random.default_rng(threads)
    host = rng.choice(HOST_PAGES, 12, replace=False).astype(np.int64)
    dev = rng.choice(DEVICE_PAGES, 12, replace=False).astype(np.int64)
    arena = {name: b.host for name, b in engine.bindings.items()}

    def hook(batch, layer):
        if batch.direction is Direction.H2D and layer == fail_at:
            raise RuntimeError(f"injected failure at layer {layer}")

    try:
        async with asyncio.timeout(60):
            assert engine._crews[Direction.H2D].size == threads
            engine.fault_hook = hook
            producer = threading.Event()  # the copy starts once every callback is registered
            handle = engine.submit(CopyBatch(Direction.H2D, host, dev, after=(producer,)))
            seen: list[tuple[int, int]] = []  # (layer, layers ready when its callback ran)
            for layer in range(61):
                def record(layer=layer):
                    seen.append((layer, handle.layers_ready))
                assert handle.on_layer_ready(layer, record)
            producer.set()
            await asyncio.to_thread(handle.done.wait)
            while len(seen) < 61:  # the callbacks the worker posted to the loop
                await asyncio.sleep(0)
            ready = 61 if fail_at is None else fail_at
            assert handle.layers_ready == ready
            # the ready layers in order, then (any order) the failed ones
            assert [layer for layer, _ in seen[:ready]] == list(range(ready))
            assert sorted(layer for layer, _ in seen[ready:]) == list(range(ready, 61))
            assert all(ready_then > layer for layer, ready_then in seen if layer < ready)
            assert (handle.error is None) == (fail_at is None)
            if fail_at is not None:
                assert f"layer {fail_at}" in str(handle.error)
            index = torch.from_numpy(dev)
            for name, layers in device.items():
                for layer in range(ready):
                    assert torch.equal(layers[layer][index], arena[name][layer][host])
    finally:
        await asyncio.to_thread(engine.close)
