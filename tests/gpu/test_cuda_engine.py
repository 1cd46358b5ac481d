"""The CUDA engine on a real device: exact bytes, per-layer readiness, overlap, hazards, faults.

Plain sync tests that run their own event loop (no asyncio plugin needed), each driving the
engine the way the service does: batches submitted on the loop thread, completions handed back
through ``LoopHandoff``, waits through ``asyncio.to_thread`` under ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import numpy as np
import pytest
import torch

from dsa_async.errors import TransferFailedError
from dsa_async.geometry import HostLayout, KvDtype, PageGeometry, dsa_indexer, mla_kv
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Direction
from dsa_async.transfer.batch import CopyBatch, Dependency
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.cuda import CudaEngine
from dsa_async.transfer.handoff import LoopHandoff

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)
WAIT_S = 120.0


def run(main):
    """Run ``main()`` on a fresh loop (uvloop when installed, as the server does)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


class SmallStagingEngine(CudaEngine):
    staging_bytes = 300 * 1024  # forces tiling: several tiles per segment and layer group


class TimedLayersEngine(CudaEngine):
    layer_event_timing = True  # per-layer events carry timestamps for the overlap check


class Reports:
    """The engine's ``on_batch_done`` sink: records reports, lets the loop await one."""

    def __init__(self) -> None:
        self.handles: list = []
        self._waiters: dict[int, asyncio.Future] = {}

    def __call__(self, handle) -> None:  # runs on the loop, through the hand-off
        self.handles.append(handle)
        waiter = self._waiters.pop(id(handle), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def done(self, handle, timeout_s: float = WAIT_S):
        """Wait for ``handle`` to finish, then for its report (which follows its callbacks)."""
        async with asyncio.timeout(timeout_s):
            await asyncio.to_thread(handle.done.wait, timeout_s)
            if handle not in self.handles:
                waiter = self._waiters[id(handle)] = asyncio.get_running_loop().create_future()
                await waiter
        return handle


@contextlib.asynccontextmanager
async def engine_for(bindings, engine_cls=CudaEngine, fault_hook=None):
    loop = asyncio.get_running_loop()
    reports = Reports()
    engine = await asyncio.to_thread(engine_cls, bindings, LoopHandoff(loop), reports,
                                     fault_hook=fault_hook)
    try:
        yield engine, reports
    finally:
        await asyncio.to_thread(engine.close)


def d2h(engine, host, dev, deps=(), after=None):
    """A backup batch that waits for the work queued so far on the caller's stream."""
    producers = (engine.capture_producer(),) if after is None else after
    return engine.submit(CopyBatch(Direction.D2H, np.asarray(host, np.int64),
                                   np.asarray(dev, np.int64), deps=tuple(deps), after=producers))


def h2d(engine, host, dev, deps=()):
    """A load batch ordered after the caller's earlier readers/writers of the device pages."""
    return engine.submit(CopyBatch(Direction.H2D, np.asarray(host, np.int64),
                                   np.asarray(dev, np.int64), deps=tuple(deps),
                                   after=(engine.capture_producer(),)))


def make_pools(layers: int, layout: HostLayout, fused: bool, host_pages: int, device_pages: int,
               *, with_kv: bool = True, seed: int = 0):
    """A host pool plus random device buffers (per-layer tensors, or one 3-D allocation)."""
    geometries = [dsa_indexer(num_layers=layers, host_layout=layout)]
    if with_kv:
        geometries.append(mla_kv(KvDtype.FP8, num_layers=layers, host_layout=layout))
    pool = HostPool.create(geometries, host_pages)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    bindings = {}
    for g in geometries:
        row = g.bytes_per_page_per_layer
        if fused:
            device = torch.randint(0, 256, (layers, device_pages, row), dtype=torch.uint8,
                                   device=DEVICE, generator=gen)
        else:  # separately allocated layers, held as bf16 like a real cache (bytes are bytes)
            device = [torch.randint(0, 256, (device_pages, row), dtype=torch.uint8,
                                    device=DEVICE, generator=gen).view(torch.bfloat16)
                      for _ in range(layers)]
        bindings[g.name] = bind_pool(g, pool.arenas[g.name], device)
        assert (bindings[g.name].device_fused is not None) == (fused or layers == 1)
    torch.cuda.synchronize()
    return pool, bindings


def device_pages_of(binding, pages) -> torch.Tensor:
    """``[layers, n, row]`` copy of device pages (device side)."""
    index = torch.as_tensor(np.asarray(pages, np.int64), device=DEVICE)
    return torch.stack([layer.index_select(0, index) for layer in binding.device_layers])


def host_pages_of(binding, pages) -> torch.Tensor:
    """``[layers, n, row]`` copy of host pages, moved to the device for comparison."""
    index = torch.as_tensor(np.asarray(pages, np.int64))
    return binding.host.index_select(1, index).to(DEVICE)


def page_sets(kind: str, rng, n: int, host_pages: int, device_pages: int):
    if kind == "contiguous":
        return np.arange(2, 2 + n), np.arange(5, 5 + n)
    if kind == "extents":  # host in three extents (as the pool allocates), device scattered
        cuts = sorted(rng.choice(np.arange(1, n), 2, replace=False))
        sizes = [cuts[0], cuts[1] - cuts[0], n - cuts[1]]
        starts = [0, sizes[0] + 3, sizes[0] + sizes[1] + 6]  # gaps of 3 pages
        assert n + 6 <= host_pages
        host = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, sizes)])
        return host, rng.permutation(device_pages)[:n]
    return rng.permutation(host_pages)[:n], rng.permutation(device_pages)[:n]


# --- byte-exact round trips ---------------------------------------------------------------------


def _round_trip(engine_cls, layers, layout, fused, kind, seed=0):
    host_pages, device_pages, n = 64, 96, 40
    rng = np.random.default_rng(seed)
    _pool, bindings = make_pools(layers, layout, fused, host_pages, device_pages, seed=seed)
    host, src = page_sets(kind, rng, n, host_pages, device_pages)
    targets = rng.permutation(np.setdiff1d(np.arange(device_pages), src))[:n]
    expected = {name: device_pages_of(b, src) for name, b in bindings.items()}

    async def main():
        async with engine_for(bindings, engine_cls) as (engine, reports):
            backup = await reports.done(d2h(engine, host, src))
            assert backup.error is None, backup.error
            for name, b in bindings.items():
                assert torch.equal(host_pages_of(b, host), expected[name]), name
                for layer in b.device_layers:  # overwrite the targets; the load must follow
                    layer.view(torch.uint8)[torch.as_tensor(targets, device=DEVICE)] = 0
            load = await reports.done(h2d(engine, host, targets))
            assert load.error is None, load.error
            assert load.layers_ready == layers and reports.handles == [backup, load]
            assert backup.duration_s > 0 and load.duration_s > 0

    run(main)
    for name, b in bindings.items():
        assert torch.equal(device_pages_of(b, targets), expected[name]), name
        assert torch.equal(device_pages_of(b, src), expected[name]), f"{name}: source changed"


@pytest.mark.parametrize("layers", [1, 61])
@pytest.mark.parametrize("fused", [False, True], ids=["per_layer", "fused"])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("kind", ["contiguous", "extents", "random"])
def test_round_trip_through_host_is_byte_exact(kind, layout, fused, layers):
    _round_trip(CudaEngine, layers, layout, fused, kind, seed=layers + len(kind))


@pytest.mark.parametrize("fused", [False, True], ids=["per_layer", "fused"])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("kind", ["extents", "random"])
def test_round_trip_is_byte_exact_when_staging_is_tiled(kind, layout, fused):
    _round_trip(SmallStagingEngine, 7, layout, fused, kind, seed=3)


@pytest.mark.parametrize("fused", [False, True], ids=["per_layer", "fused"])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("kind", ["extents", "random"])
def test_round_trip_is_byte_exact_in_deterministic_mode(kind, layout, fused):
    # torch reroutes a CUDA index_copy_ through a deterministic index_put_ there: the copy
    # code then writes rows of one contiguous layer at a time (tests/test_cuda_import.py)
    was_on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _round_trip(CudaEngine, 61, layout, fused, kind, seed=5)
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warn_only)


def test_load_waits_for_the_backup_it_reads_on_the_gpu():
    """RAW on host pages: the load is queued right behind a slow backup, no CPU sync between."""
    _pool, bindings = make_pools(8, HostLayout.LAYER_FIRST, False, 64, 96, with_kv=False)
    (binding,) = bindings.values()
    src, host, targets = np.arange(0, 32), np.arange(10, 42), np.arange(50, 82)

    async def main():
        async with engine_for(bindings) as (engine, reports):
            torch.cuda._sleep(100_000_000)  # the producer runs long on the caller's stream
            for layer in binding.device_layers:
                layer.view(torch.uint8)[:32] = 7
            backup = d2h(engine, host, src)
            load = h2d(engine, host, targets, deps=[Dependency(backup, needs_data=True)])
            await reports.done(load)
            assert backup.error is None and load.error is None

    run(main)
    assert bool((device_pages_of(binding, targets) == 7).all())
    assert bool((host_pages_of(binding, host) == 7).all())


def test_backup_waits_for_the_producer_event():
    _pool, bindings = make_pools(4, HostLayout.LAYER_FIRST, True, 16, 32, with_kv=False)
    (binding,) = bindings.values()

    async def main():
        async with engine_for(bindings) as (engine, reports):
            producer = torch.cuda.Stream(DEVICE)
            with torch.cuda.stream(producer):
                torch.cuda._sleep(100_000_000)
                binding.device_fused[:, :8].fill_(42)
                event = torch.cuda.Event()
                event.record(producer)
            backup = await reports.done(d2h(engine, np.arange(8), np.arange(8), after=(event,)))
            assert backup.error is None

    run(main)
    assert bool((host_pages_of(binding, np.arange(8)) == 42).all())


# --- per-layer readiness and overlap ----------------------------------------------------------


def _consumer_reps(seconds_per_layer: float, a: torch.Tensor, out: torch.Tensor) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.matmul(a, a, out=out)
    start.record()
    for _ in range(5):
        torch.matmul(a, a, out=out)
    end.record()
    end.synchronize()
    per_matmul_s = start.elapsed_time(end) / 5e3
    return max(1, math.ceil(1.5 * seconds_per_layer / per_matmul_s))


def test_layers_become_ready_in_order_and_copies_overlap_the_consumer():
    layers, pages = 12, 4096  # 4096 pages x 8,448 B = 34.6 MB per layer
    geometry = PageGeometry("indexer", 132, num_layers=layers)
    pool = HostPool.create([geometry], pages)
    arena = pool.arenas["indexer"]
    arena.copy_(torch.randint(0, 256, arena.shape, dtype=torch.uint8))
    device = [torch.zeros(pages, geometry.bytes_per_page_per_layer, dtype=torch.uint8,
                          device=DEVICE) for _ in range(layers)]
    bindings = {"indexer": bind_pool(geometry, arena, device)}
    a = torch.randn(4096, 4096, dtype=torch.float16, device=DEVICE)
    out = torch.empty_like(a)
    snapshot = torch.empty(layers, 64, geometry.bytes_per_page_per_layer, dtype=torch.uint8,
                           device=DEVICE)
    compute = torch.cuda.Stream(DEVICE)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(layers)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(layers)]
    every = np.arange(pages)
    result = {}

    def forward(engine, handle, reps):
        torch.cuda.set_device(DEVICE)
        with torch.cuda.stream(compute):
            for i in range(layers):
                engine.wait_layer(handle, i)  # GPU-side wait: this thread does not block on it
                starts[i].record(compute)
                snapshot[i].copy_(device[i][-64:])  # reads layer i's freshly loaded pages
                for _ in range(reps):
                    torch.matmul(a, a, out=out)
                ends[i].record(compute)
        compute.synchronize()

    async def main():
        async with engine_for(bindings, TimedLayersEngine) as (engine, reports):
            # Warm-up, and the copy time per layer.
            warm = await reports.done(h2d(engine, every, every))
            assert warm.error is None, warm.error
            reps = _consumer_reps(warm.duration_s / layers, a, out)
            for layer in device:
                layer.zero_()
            order: list[int] = []
            handle = h2d(engine, every, every)
            for i in range(layers):
                if not handle.on_layer_ready(i, lambda i=i: order.append(i)):
                    order.append(i)
            await asyncio.to_thread(forward, engine, handle, reps)
            await reports.done(handle)
            assert handle.error is None, handle.error
            events = handle.layer_events  # read before any later batch reuses them
            result["order"] = list(order)
            result["start_after_ready_ms"] = [events[i].elapsed_time(starts[i])
                                              for i in range(layers)]
            result["next_ready_before_end_ms"] = [events[i + 1].elapsed_time(ends[i])
                                                  for i in range(layers - 1)]
            result["last_ready_after_first_start_ms"] = starts[0].elapsed_time(events[-1])
            result["copy_ms_per_layer"] = handle.duration_s * 1e3 / layers

    run(main)
    assert result["order"] == list(range(layers))
    assert torch.equal(snapshot, arena[:, -64:].to(DEVICE)), "a consumer read a stale layer"
    assert result["copy_ms_per_layer"] > 0.1, "copies too small to show overlap"
    # Every consumer kernel started after its layer's event (GPU-side wait honoured).
    assert min(result["start_after_ready_ms"]) >= -0.01, result["start_after_ready_ms"]
    # Overlap: layer i+1 had landed before the consumer of layer i ended (copy ran meanwhile).
    overlapped = sum(gap > 0 for gap in result["next_ready_before_end_ms"])
    assert overlapped >= layers - 2, result
    # ...and the copy was still running when the first consumer started (not all landed first)
    assert result["last_ready_after_first_start_ms"] > 0, result


# --- both directions at once --------------------------------------------------------------------


def test_backup_and_load_at_once_take_less_than_one_after_the_other():
    layers, pages = 16, 4096  # 277 MB per direction per batch
    geometry = PageGeometry("indexer", 132, num_layers=layers)
    pool = HostPool.create([geometry], 2 * pages)
    device = torch.zeros(layers, 2 * pages, geometry.bytes_per_page_per_layer, dtype=torch.uint8,
                         device=DEVICE)
    bindings = {"indexer": bind_pool(geometry, pool.arenas["indexer"], device)}
    first, second = np.arange(pages), np.arange(pages, 2 * pages)
    timings: dict[str, list[float]] = {"d2h": [], "h2d": [], "both": []}

    async def main():
        async with engine_for(bindings) as (engine, reports):
            async def timed(*submits):
                started = time.perf_counter()
                handles = [submit() for submit in submits]
                for handle in handles:
                    await reports.done(handle)
                    assert handle.error is None, handle.error
                return time.perf_counter() - started

            def backup():
                return d2h(engine, first, first)

            def load():
                return h2d(engine, second, second)

            await timed(backup, load)  # warm-up
            for _ in range(3):  # interleaved, best of three
                timings["d2h"].append(await timed(backup))
                timings["h2d"].append(await timed(load))
                timings["both"].append(await timed(backup, load))

    run(main)
    d2h_s, h2d_s, both_s = (min(timings[k]) for k in ("d2h", "h2d", "both"))
    assert both_s < 0.9 * (d2h_s + h2d_s), timings


# --- failures ----------------------------------------------------------------------------------


class InjectedFault(RuntimeError):
    pass


def test_fault_at_layer_k_reaches_every_waiter_and_the_next_batch_succeeds():
    layers, k = 61, 5
    _pool, bindings = make_pools(layers, HostLayout.LAYER_FIRST, False, 32, 48, seed=5)
    host, targets = np.arange(8, 24), np.arange(20, 36)
    faulty: set[int] = set()

    def hook(batch, first_layer):
        if batch.batch_id in faulty and first_layer == k:
            raise InjectedFault(f"copy of layer {first_layer} failed")

    outcome = {}

    async def main():
        async with engine_for(bindings, fault_hook=hook) as (engine, reports):
            backup = await reports.done(d2h(engine, host, np.arange(16)))
            assert backup.error is None
            expected = {n: host_pages_of(b, host) for n, b in bindings.items()}
            batch = CopyBatch(Direction.H2D, host.astype(np.int64), targets.astype(np.int64),
                              after=(engine.capture_producer(),))
            faulty.add(batch.batch_id)
            handle = engine.submit(batch)
            woken: list[tuple[int, BaseException | None]] = []
            for i in (0, k - 1, k, layers - 1):
                def wake(i=i):
                    woken.append((i, handle.error))
                if not handle.on_layer_ready(i, wake):
                    wake()
            await reports.done(handle)

            def consumer(layer):
                try:
                    engine.wait_layer(handle, layer)
                    return None
                except TransferFailedError as exc:
                    return exc

            outcome["before"] = await asyncio.to_thread(consumer, k - 1)
            outcome["at"] = await asyncio.to_thread(consumer, k)
            outcome["woken"] = sorted(woken, key=lambda w: w[0])
            outcome["error"] = handle.error
            outcome["ready"] = handle.layers_ready
            outcome["reported"] = handle in reports.handles
            again = await reports.done(h2d(engine, host, targets))
            outcome["again"] = again.error
            outcome["expected"] = expected

    run(main)
    assert isinstance(outcome["error"], InjectedFault)
    assert outcome["ready"] == k and outcome["reported"]
    assert outcome["before"] is None
    assert isinstance(outcome["at"], TransferFailedError)
    assert isinstance(outcome["at"].__cause__, InjectedFault)
    assert [i for i, _ in outcome["woken"]] == [0, k - 1, k, layers - 1]
    assert all(isinstance(err, InjectedFault) for i, err in outcome["woken"] if i >= k)
    assert outcome["again"] is None
    for name, b in bindings.items():
        assert torch.equal(device_pages_of(b, targets), outcome["expected"][name]), name


def test_failed_backup_fails_the_load_that_reads_it_and_the_engine_keeps_serving():
    _pool, bindings = make_pools(3, HostLayout.PAGE_FIRST, True, 16, 24, with_kv=False)
    faulty: set[int] = set()

    def hook(batch, first_layer):
        if batch.batch_id in faulty:
            raise InjectedFault("backup failed")

    async def main():
        async with engine_for(bindings, fault_hook=hook) as (engine, reports):
            batch = CopyBatch(Direction.D2H, np.arange(4, dtype=np.int64),
                              np.arange(4, dtype=np.int64), after=(engine.capture_producer(),))
            faulty.add(batch.batch_id)
            backup = engine.submit(batch)
            load = h2d(engine, np.arange(4), np.arange(10, 14),
                       deps=[Dependency(backup, needs_data=True)])
            ordered = h2d(engine, np.arange(8, 12), np.arange(16, 20),
                          deps=[Dependency(backup, needs_data=False)])
            for handle in (backup, load, ordered):
                await reports.done(handle)
            assert isinstance(backup.error, InjectedFault)
            assert isinstance(load.error, TransferFailedError)
            assert ordered.error is None
            later = await reports.done(d2h(engine, np.arange(4), np.arange(4)))
            assert later.error is None
            assert {id(h) for h in reports.handles} >= {id(backup), id(load), id(ordered)}

    run(main)
    (binding,) = bindings.values()
    assert torch.equal(host_pages_of(binding, np.arange(4)), device_pages_of(binding, np.arange(4)))


def test_close_drains_everything_submitted_before_it():
    _pool, bindings = make_pools(8, HostLayout.LAYER_FIRST, True, 64, 64, with_kv=False)
    handles = []

    async def main():
        loop = asyncio.get_running_loop()
        engine = CudaEngine(bindings, LoopHandoff(loop), lambda handle: None)
        for i in range(8):
            pages = np.arange(i * 8, i * 8 + 8)
            handles.append(d2h(engine, pages, pages))
            handles.append(h2d(engine, pages, pages, deps=[Dependency(handles[-1], True)]))
        await asyncio.to_thread(engine.close)
        assert engine.pinned_bytes == 0

    run(main)
    assert all(h.done.is_set() and h.error is None for h in handles)
