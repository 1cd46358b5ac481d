"""The CUDA backend through ``OffloadService(backend="cuda")``: ordering against the caller's
streams, registration edges, stream ownership, sticky faults and device-true timeliness.

Plain sync tests that run their own event loop, so they need no asyncio plugin (without one
installed, run them as ``tests/gpu/device_check.sh`` does: ``-o addopts=""`` and the plugin's
ini options ignored, since ``--strict-config`` refuses options of a plugin that is missing). Each case is a property the service must keep on a real device; the
comment on each says which defect it would have caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_async import OffloadService, Pages, PoolSize, ServiceConfig
from dsa_async.geometry import dsa_indexer
from dsa_async.kinds import Direction
from dsa_async.transfer.cuda import CudaEngine

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)
WAIT_S = 120.0
REPO = Path(__file__).resolve().parents[2]


def run(main):
    """Run ``main()`` on a fresh loop (uvloop when installed, as the server does)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


@functools.cache
def cycles_per_second() -> float:
    """``torch.cuda._sleep`` cycles per second on this device (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # warm-up, long enough for the clocks to ramp up
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1e3)


def gpu_sleep(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for about ``seconds``."""
    torch.cuda._sleep(int(seconds * cycles_per_second()))


def page_tokens(pages, page_size: int = 64) -> torch.Tensor:
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def make_config(tmp_path, *, layers: int = 4, host_pages: int = 64) -> ServiceConfig:
    return ServiceConfig(geometries=(dsa_indexer(num_layers=layers),),
                         host_pool=PoolSize(pages=host_pages), backend="cuda",
                         ledger_directory=str(tmp_path / "ledger"))


def device_buffers(layers: int, pages: int) -> torch.Tensor:
    """``[layers, pages, 8448]`` bytes, every page of every layer different."""
    row = dsa_indexer().bytes_per_page_per_layer
    return torch.randint(0, 256, (layers, pages, row), dtype=torch.uint8, device=DEVICE)


@contextlib.asynccontextmanager
async def cuda_service(config, buffers, **kwargs):
    service = OffloadService(config, buffers, **kwargs)
    await service.start()
    try:
        yield service
    finally:
        await asyncio.wait_for(service.close(), WAIT_S)


async def finished(transfer):
    return await asyncio.wait_for(transfer, WAIT_S)


def layer_samples(service, timeliness: str) -> float:
    value = service.registry.get_sample_value("dsa_async_prefetch_layers_total",
                                              {"timeliness": timeliness})
    return value or 0.0


# --- ordering against the caller's streams ----------------------------------------------------


def test_prefetch_waits_for_the_readers_queued_on_the_callers_stream(tmp_path):
    # A load into device pages that attention kernels still read (queued on the forward
    # stream) must not land before those kernels ran.
    buffers = device_buffers(4, 32)

    async def main():
        async with cuda_service(make_config(tmp_path), buffers) as service:
            backup = await finished(service.evict(page_tokens([0, 1, 2, 3])))
            targets = [10, 11, 12, 13]
            before = buffers[:, targets].clone()
            snapshot = torch.empty_like(before)
            # Made before the sleep: an index list becomes a host-to-device copy from pageable
            # memory, which would block this thread until the sleep ended.
            target_index = torch.tensor(targets, device=DEVICE)
            gpu_sleep(0.5)  # the "attention kernel" is still running...
            snapshot.copy_(buffers.index_select(1, target_index))  # ...reads the pages after it
            load = service.prefetch(backup.host_pages, page_tokens(targets))
            await finished(load)
            torch.cuda.synchronize()
            assert torch.equal(snapshot, before), "the load overwrote pages still being read"
            assert torch.equal(buffers[:, targets], buffers[:, [0, 1, 2, 3]])

    run(main)


def test_eviction_from_a_thread_on_its_own_stream_backs_up_what_that_stream_wrote(tmp_path):
    # The default producer is the submitting thread's current stream, captured on that thread
    # (not the loop thread's stream).
    buffers = device_buffers(4, 32)
    written = torch.full_like(buffers[:, :4], 7)

    async def main():
        async with cuda_service(make_config(tmp_path), buffers) as service:
            done = threading.Event()
            box = {}

            def forward_thread():
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    gpu_sleep(0.5)
                    buffers[:, 4:8].copy_(written)  # the kernel that writes the pages
                    box["future"] = service.call_threadsafe(service.evict, page_tokens(range(4, 8)))
                done.set()

            thread = threading.Thread(target=forward_thread)
            thread.start()
            await asyncio.to_thread(done.wait, WAIT_S)
            thread.join()
            transfer = await asyncio.wait_for(asyncio.wrap_future(box["future"]), WAIT_S)
            backup = await finished(transfer)
            load = service.prefetch(backup.host_pages, page_tokens(range(20, 24)))
            await finished(load)
            torch.cuda.synchronize()
            assert torch.equal(buffers[:, 20:24], written), "the backup read the pages too early"

    run(main)


# --- registration edges -----------------------------------------------------------------------


class SmallChunkEngine(CudaEngine):
    pin_chunk_bytes = 1 << 20  # a 61-layer, 48-page arena spans 24 chunks


class IssueTimedEngine(SmallChunkEngine):
    """Records how long the issuing thread spent handing each batch to the stream."""

    def __init__(self, *args, **kwargs) -> None:
        self.issue_s: list[float] = []
        super().__init__(*args, **kwargs)

    def _issue(self, lane, handle) -> None:
        started = time.perf_counter()
        super()._issue(lane, handle)
        self.issue_s.append(time.perf_counter() - started)


def test_pool_spanning_many_registrations_round_trips_byte_exact(tmp_path):
    layers, host_pages = 61, 48
    buffers = device_buffers(layers, 96)
    original = buffers.clone()
    rng = np.random.default_rng(0)

    async def main():
        config = make_config(tmp_path, layers=layers, host_pages=host_pages)
        async with cuda_service(config, buffers, engine_factory=SmallChunkEngine) as service:
            engine = service._engine  # white box: the registrations the copies must respect
            assert len(engine._pinning.registrations) > 4
            for round_ in range(6):
                n = int(rng.integers(8, host_pages // 2))
                pages = np.sort(rng.choice(48, n, replace=False)) if round_ % 2 else (
                    np.arange(n) + int(rng.integers(0, 48 - n)))
                backup = await finished(service.evict(page_tokens(pages)))
                targets = rng.choice(np.arange(48, 96), n, replace=False)
                await finished(service.prefetch(backup.host_pages, page_tokens(targets)))
                torch.cuda.synchronize()
                assert torch.equal(buffers[:, targets], original[:, pages]), round_
                service.release(backup.host_pages)
                buffers[:, 48:] = original[:, 48:]

    run(main)


def test_backup_behind_a_long_producer_is_handed_to_the_stream_at_once(tmp_path):
    # A copy across two registrations counts as pageable; a pageable D2H copy blocks the
    # issuing thread until the stream reaches it, here behind a 1 s kernel.
    layers = 61
    buffers = device_buffers(layers, 96)

    async def main():
        config = make_config(tmp_path, layers=layers, host_pages=48)
        async with cuda_service(config, buffers, engine_factory=IssueTimedEngine) as service:
            engine = service._engine
            warm = await finished(service.evict(page_tokens(range(40, 48))))  # first launches
            service.release(warm.host_pages)
            engine.issue_s.clear()
            gpu_sleep(1.0)  # the producer: the backup waits for it on the GPU
            backup = service.evict(page_tokens(range(0, 40)))  # contiguous: memcpy paths
            await finished(backup)
            assert engine.issue_s and max(engine.issue_s) < 0.1, engine.issue_s

    run(main)


# --- stream ownership ------------------------------------------------------------------------


def test_copy_streams_are_distinct_from_every_stream_the_process_created(tmp_path):
    created = [torch.cuda.Stream() for _ in range(40)]
    created += [torch.cuda.Stream(priority=-1) for _ in range(40)]
    buffers = device_buffers(4, 32)

    async def main():
        async with cuda_service(make_config(tmp_path), buffers) as service:
            more = [torch.cuda.Stream() for _ in range(40)]
            streams = service._engine.copy_streams  # white box: the two lanes' streams
            index = service._engine._index_stream  # and the one for device index copies
            handles = [int(s.cuda_stream) for s in streams.values()] + [int(index.cuda_stream)]
            assert len(set(handles)) == 3
            others = created + more + [torch.cuda.current_stream(), torch.cuda.default_stream()]
            assert not set(handles) & {int(s.cuda_stream) for s in others}
            # Lower is more urgent: loads gate the forward pass.
            assert streams[Direction.H2D].priority <= streams[Direction.D2H].priority
            # Both lanes really copy on them: a round trip still works.
            backup = await finished(service.evict(page_tokens([0, 1])))
            await finished(service.prefetch(backup.host_pages, page_tokens([5, 6])))
            torch.cuda.synchronize()
            assert torch.equal(buffers[:, [5, 6]], buffers[:, [0, 1]])

    run(main)


#: What each script run in a process of its own starts with: a 4-layer CUDA service's config
#: and device buffers, its ledger in ``sys.argv[1]``.
_PRELUDE = textwrap.dedent("""
    import asyncio, gc, json, sys
    import torch
    from dsa_async import OffloadService, Pages, PoolSize, ServiceConfig
    from dsa_async.geometry import dsa_indexer
    from dsa_async.host_memory.ledger import HostLedger

    g = dsa_indexer(num_layers=4)
    buffers = torch.zeros(4, 32, g.bytes_per_page_per_layer, dtype=torch.uint8, device="cuda")
    config = ServiceConfig(geometries=(g,), host_pool=PoolSize(pages=64), backend="cuda",
                           ledger_directory=sys.argv[1])
""")


def _run_script(body: str, ledger: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run ``_PRELUDE`` + ``body`` in a fresh process; its exit and the last JSON line it
    printed (``None`` if none)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body), str(ledger)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done, json.loads(lines[-1]) if lines else None


_FREED_AFTER_CLOSE = """
    async def main():
        kept, streams = [], []
        for _ in range(3):
            service = OffloadService(config, buffers)
            await service.start()
            engine = service._engine
            streams.append(sorted([int(s.cuda_stream) for s in engine.copy_streams.values()]
                                  + [int(engine._index_stream.cuda_stream)]))
            indices = torch.arange(0, 128, device="cuda")  # read on the engine's index stream
            backup = service.evict(indices)
            result = await backup
            load = service.prefetch(result.host_pages, Pages(torch.tensor([5, 6], device="cuda")))
            await load
            service.release(result.host_pages)
            await service.close()
            kept += [indices, backup, load]  # their staged index copies go after the close
            del indices, backup, load, result
        del kept
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        print(json.dumps({"streams": streams}))

    asyncio.run(main())
"""


def test_tensors_the_engines_streams_read_may_be_freed_after_close(tmp_path):
    # torch records an event on every stream that read a tensor when that tensor (or a pinned
    # buffer a copy read) is freed; freed after close(), that must find the streams alive.
    done, result = _run_script(_FREED_AFTER_CLOSE, tmp_path / "ledger")
    assert done.returncode == 0 and result, f"rc {done.returncode}:\n{done.stderr[-3000:]}"
    streams = result["streams"]
    assert len(set(streams[0])) == 3
    assert streams[1] == streams[0] and streams[2] == streams[0], "streams were not reused"


# --- a sticky device fault --------------------------------------------------------------------

_STICKY = """
    async def main():
        service = OffloadService(config, buffers)
        await service.start()
        first = await service.evict(torch.arange(0, 128))
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([1 << 30], device="cuda")] = 1  # out of bounds: a device-side assert
        failed = None
        try:
            await asyncio.wait_for(service.evict(torch.arange(128, 256)), 60)
        except Exception as exc:
            failed = type(exc).__name__
        close_error = None
        try:
            await asyncio.wait_for(service.close(), 60)
        except Exception as exc:
            close_error = type(exc).__name__
        entries = len(HostLedger(sys.argv[1]).peek())  # while this process is alive
        print(json.dumps({"first_pages": first.pages, "failed": failed,
                          "close_error": close_error, "ledger_entries": entries}))

    asyncio.run(main())
"""


def test_sticky_fault_fails_the_transfer_and_close_returns_the_reservation(tmp_path):
    done, result = _run_script(_STICKY, tmp_path / "ledger")
    assert result, f"no result (rc {done.returncode}):\n{done.stderr[-3000:]}"
    assert result["first_pages"] == 2
    assert result["failed"] is not None, "a transfer after the fault reported success"
    assert result["ledger_entries"] == 0, f"the reservation outlived close(): {result}"


# --- device-true timeliness -------------------------------------------------------------------


def test_layer_counts_late_only_when_the_consumers_stream_waited(tmp_path):
    layers = 8
    buffers = device_buffers(layers, 64)

    async def main():
        async with cuda_service(make_config(tmp_path, layers=layers), buffers) as service:
            backup = await finished(service.evict(page_tokens(range(0, 8))))

            # On time: the consumer's stream is busy for 0.5 s, far longer than the load; it
            # asks for every layer at once (before the copies ran) but never waits on the GPU.
            def consume(transfer, busy_s):
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    if busy_s:
                        gpu_sleep(busy_s)
                    for layer in range(layers):
                        transfer.wait_layer(layer, timeout_s=WAIT_S)
                stream.synchronize()

            load = service.prefetch(backup.host_pages, page_tokens(range(16, 24)))
            await asyncio.to_thread(consume, load, 0.5)
            await finished(load)
            assert layer_samples(service, "late") == 0
            assert layer_samples(service, "on_time") == layers

            # Late: the load waits 0.5 s for its producer; the idle consumer stream waits for it.
            producer_stream = torch.cuda.Stream()
            with torch.cuda.stream(producer_stream):
                gpu_sleep(0.5)
                producer = torch.cuda.Event()
                producer.record(producer_stream)
            load = service.prefetch(backup.host_pages, page_tokens(range(32, 40)),
                                    after=producer)
            await asyncio.to_thread(consume, load, 0.0)
            await finished(load)
            assert layer_samples(service, "late") >= 1
            waited = service.registry.get_sample_value("dsa_async_prefetch_wait_seconds_sum")
            assert waited is not None and waited > 0.2

    run(main)


# --- device indices on the GPU ------------------------------------------------------------------


@pytest.mark.parametrize("indices_after", [None, ()], ids=["default", "this_stream_only"])
def test_device_indices_written_by_a_kernel_still_queued_are_read_after_it(tmp_path,
                                                                          indices_after):
    # The indices are produced on the caller's stream behind a long kernel; submit returns at
    # once and the copy reads the indices (and the pages) only after that kernel, also when
    # indices_after= names nothing (the submitting thread's current stream always counts).
    buffers = device_buffers(4, 32)

    async def main():
        async with cuda_service(make_config(tmp_path), buffers) as service:
            indices = torch.full((2 * 64,), -1, dtype=torch.int64, device=DEVICE)
            # On the device before the sleep: a copy from pageable host memory now would block
            # this thread until the sleep ended, and the kernel would be over at submit.
            source = page_tokens([7, 3]).to(DEVICE)
            gpu_sleep(0.5)
            indices.copy_(source)  # a device-to-device copy queued behind the sleep
            submitted_from = time.perf_counter()
            backup = service.evict(indices, indices_after=indices_after)
            assert time.perf_counter() - submitted_from < 0.25, "submit waited for the kernel"
            result = await finished(backup)
            host = torch.as_tensor(result.host_pages.pages)
            arena = service.host_pool.arenas[dsa_indexer().name]
            torch.cuda.synchronize()
            for layer in range(4):
                assert torch.equal(arena[layer][host], buffers[layer, [7, 3]].cpu())
            load = service.prefetch(result.host_pages, Pages(torch.tensor([20, 21],
                                                                           device=DEVICE)))
            await finished(load)
            torch.cuda.synchronize()
            assert torch.equal(buffers[:, [20, 21]], buffers[:, [7, 3]])

    run(main)


def test_a_load_whose_indices_wait_for_less_than_its_fence_is_issued_before_the_fence_ends(
        tmp_path):
    # As the SGLang plug-in submits: the indices come from this thread's stream, the fence (a
    # forward pass still using the target pages) is another stream. With indices_after=() the
    # engine plans and issues the load at once; the copy still waits for the fence on the GPU.
    buffers = device_buffers(4, 32)

    async def main():
        async with cuda_service(make_config(tmp_path), buffers) as service:
            backup = await finished(service.evict(page_tokens([7, 3])))
            torch.cuda.synchronize()
            expected = buffers[:, [7, 3]].clone()
            forward = torch.cuda.Stream()
            targets = torch.tensor([20, 21], device=DEVICE)
            with torch.cuda.stream(forward):
                gpu_sleep(1.0)
                # the fence's last writes to the pages loaded into (an index tensor already on
                # the device: a list index would copy from pageable memory and block this
                # thread until the sleep ended, so the fence would be over at submit)
                buffers.index_fill_(1, targets, 0)
            load = service.prefetch(backup.host_pages, Pages(targets), after=forward,
                                    indices_after=())
            started = time.perf_counter()
            await asyncio.to_thread(load.wait_layer, 0)  # CUDA: returns once layer 0 is issued
            assert time.perf_counter() - started < 0.5, "the issue waited for the fence"
            await finished(load)
            torch.cuda.synchronize()
            assert torch.equal(buffers[:, [20, 21]], expected)  # written after the fence

    run(main)


def test_bad_device_indices_on_the_gpu_fail_that_transfer(tmp_path):
    from dsa_async.errors import IndexValueError, TransferFailedError

    buffers = device_buffers(4, 32)

    async def main():
        async with cuda_service(make_config(tmp_path), buffers) as service:
            before = service.statistics()
            bad = service.evict((page_tokens([5]) + 1).to(DEVICE))  # shifted: not whole pages
            good = service.evict(page_tokens([6]).to(DEVICE))
            with pytest.raises(TransferFailedError) as caught:
                await finished(bad)
            error = caught.value
            while error is not None and not isinstance(error, IndexValueError):
                error = error.__cause__
            assert isinstance(error, IndexValueError)
            result = await finished(good)
            service.release(result.host_pages)
            assert service.statistics() == before

    run(main)
