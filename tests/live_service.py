"""A real OffloadService under a small CPU workload, serving /metrics from a background thread.

Used by tests that need live data flowing through every metric: evictions with partial pages
(padding), prefetches consumed layer by layer (on time and late), prefetches dropped unconsumed
(wasted), and an injected copy failure now and then (failed batches).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvloop
from service_fixtures import make_buffers

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import TransferFailedError
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer, mla_kv
from dsa_async.kinds import Direction
from dsa_async.observability.exposition import start_metrics_server

LAYERS = 4
DEVICE_PAGES = 48
PAGE = 64


class _FailEvery:
    """Fault seam: every ``n``-th eviction batch raises inside the copy."""

    def __init__(self, n: int) -> None:
        self.n, self.count = n, 0

    def __call__(self, batch, first_layer: int) -> None:
        if batch.direction is Direction.D2H and first_layer == 0:
            self.count += 1
            if self.count % self.n == 0:
                raise RuntimeError("injected copy failure")


async def _workload(service: OffloadService, stop: threading.Event) -> None:
    rng = random.Random(7)
    while not stop.is_set():
        first = rng.randrange(0, DEVICE_PAGES // 2 - 4)
        start = first * PAGE + rng.randrange(PAGE)
        length = rng.randrange(1, 4 * PAGE)
        try:
            backup = await service.evict(range(start, start + length))
        except TransferFailedError:
            continue
        pages = backup.host_pages.num_pages
        target = rng.randrange(DEVICE_PAGES // 2, DEVICE_PAGES - pages)
        load = service.prefetch(backup.host_pages, range(target * PAGE, (target + pages) * PAGE),
                                deadline_s=0.05)
        mode = rng.randrange(3)
        if mode == 0:  # consumer asks before the copy is done: late layers
            for layer in range(LAYERS):
                await load.layer_ready(layer)
            await load  # the request ends (and unpins its host pages) after its last layer
        else:
            ended = asyncio.Event()
            load.add_done_callback(lambda _t: ended.set())
            await ended.wait()  # completion observed without consuming any layer
            if mode == 1:
                await load  # asked after it was ready: on time
            # mode 2: never consumed; dropping it counts its layers as wasted
        del load
        service.release(backup.host_pages)


@contextmanager
def live_service(tmp_path: Path) -> Iterator[str]:
    """Yield ``host:port`` of the service's /metrics while the workload runs."""
    ready = threading.Event()
    stop = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        geometries = (dsa_indexer(num_layers=LAYERS), mla_kv(num_layers=LAYERS))
        config = ServiceConfig(geometries=geometries, host_pool=PoolSize(pages=64), backend="cpu",
                               ledger_directory=str(tmp_path / "ledger"))
        buffers = {g.name: make_buffers(g, DEVICE_PAGES) for g in geometries}
        async with OffloadService(config, buffers, fault_hook=_FailEvery(40)) as service:
            server = start_metrics_server(service.registry, host="127.0.0.1", port=0)
            box["target"] = f"127.0.0.1:{server.port}"
            ready.set()
            try:
                await _workload(service, stop)
            finally:
                server.close()

    def run() -> None:
        try:
            uvloop.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="live-service", daemon=True)
    thread.start()
    try:
        if not ready.wait(60) or "error" in box:
            raise RuntimeError(f"live service did not start: {box.get('error')!r}")
        yield str(box["target"])
    finally:
        stop.set()
        thread.join(30)
        if "error" in box:
            raise box["error"]
