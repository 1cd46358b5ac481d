"""What the service keeps per live allocation or page never comes back as young objects.

CPython's full collection untracks a dict that holds only ints, strings and tuples of them, and
the next insert of a fresh tuple tracks it again, as young: every young collection after that
walks the whole dict until it ages out (milliseconds on the loop with tens of thousands of
entries, after every full collection). So a full collection, then a round of ordinary work,
must leave no large container among the young objects.
"""

from __future__ import annotations

import asyncio
import gc

import torch
from service_fixtures import make_buffers

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import PageGeometry

HELD = 20_000
LARGE = 1_000


def _large_young() -> list[tuple[str, int]]:
    return [(type(o).__name__, len(o)) for o in gc.get_objects(generation=0)
            if isinstance(o, (dict, list, set)) and len(o) > LARGE]


async def test_a_full_collection_leaves_no_large_container_young(tmp_path):
    tiny = PageGeometry("tiny", bytes_per_token_per_layer=1, num_layers=2)
    config = ServiceConfig(geometries=(tiny,), host_pool=PoolSize(pages=2 * HELD + 64),
                           backend="cpu", ledger_directory=str(tmp_path / "ledger"))
    service = OffloadService(config, {"tiny": make_buffers(tiny, 64)})
    async with asyncio.timeout(60):
        async with service:
            # Held handles with holes between them, as a long-running server's pool is.
            held = [service.allocate_host_pages(2) for _ in range(HELD)]
            for handle in held[::2]:
                service.release(handle)
            held = held[1::2]
            for _ in range(3):  # some of it may be untracked only by a later full collection
                gc.collect()
            assert _large_young() == []
            for pages in (1, 3, 2):
                result = await service.evict(torch.arange(0, pages * 64))
                loaded = await service.prefetch(result.host_pages,
                                                torch.arange(64, 64 + pages * 64))
                assert loaded.pages == pages
                service.release(result.host_pages)
            handle = service.allocate_host_pages(1)
            service.release(handle)
            assert _large_young() == []
            for handle in held:
                service.release(handle)
