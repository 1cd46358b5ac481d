"""Device rows at any byte alignment move byte-exact through the service, in both directions.

The copy code widens rows to larger element types for speed; the widened views of the two
sides of one index operation must agree. Device tensors that start a few bytes into their own
allocation, and per-layer views of one allocation with gaps between layers, are accepted at
start, so every copy path must serve them: host extents to scattered device pages, scattered
on both sides, and runs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from service_fixtures import PAGE, offset_layers

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import HostLayout, dsa_indexer, mla_kv

LAYERS, DEVICE_PAGES, HOST_PAGES = 3, 24, 32


def _tokens(pages) -> torch.Tensor:
    pages = np.asarray(pages, dtype=np.int64)
    return torch.from_numpy((pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1))


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("gap_bytes", [None, 0, 8, 24], ids=["separate", "gap0", "gap8", "gap24"])
@pytest.mark.parametrize("offset_bytes", [0, 1, 2, 4, 8, 12])
async def test_any_device_row_alignment_round_trips_byte_exact(tmp_path, offset_bytes, gap_bytes,
                                                               layout):
    geometries = (dsa_indexer(num_layers=LAYERS, host_layout=layout),
                  mla_kv(num_layers=LAYERS, host_layout=layout))
    gen = torch.Generator().manual_seed(offset_bytes * 31 + (gap_bytes or 0))
    buffers = {g.name: offset_layers(g, DEVICE_PAGES, offset_bytes, gap_bytes, gen) for g in geometries}
    config = ServiceConfig(geometries=geometries, host_pool=PoolSize(pages=HOST_PAGES),
                           backend="cpu", ledger_directory=str(tmp_path / "ledger"))
    rng = np.random.default_rng(offset_bytes)
    async with OffloadService(config, buffers) as service, asyncio.timeout(60):
        for n in (1, 6, 12):
            scattered = rng.choice(DEVICE_PAGES, n, replace=False)
            index = torch.from_numpy(scattered)
            want = {k: [t[index].clone() for t in v] for k, v in buffers.items()}
            # scattered device pages -> one host extent chosen by the service
            backup = await service.evict(_tokens(scattered))
            targets = rng.permutation(np.setdiff1d(np.arange(DEVICE_PAGES), scattered))[:n]
            # host extent -> scattered device pages
            await service.prefetch(backup.host_pages, _tokens(targets))
            got = {k: [t[torch.from_numpy(targets)] for t in v] for k, v in buffers.items()}
            for name in buffers:
                for layer in range(LAYERS):
                    assert torch.equal(got[name][layer], want[name][layer]), (name, layer, n)
            # scattered host pages <-> scattered device pages (explicit host slots)
            held = service.allocate_host_pages(n + 3)
            slots = rng.choice(held.pages, n, replace=False)
            source = rng.choice(DEVICE_PAGES, n, replace=False)
            want = {k: [t[torch.from_numpy(source)].clone() for t in v] for k, v in buffers.items()}
            await service.evict(_tokens(source), host_tokens=_tokens(slots))
            back = rng.choice(DEVICE_PAGES, n, replace=False)
            await service.prefetch(None, _tokens(back), host_tokens=_tokens(slots))
            for name, layers in buffers.items():
                for layer in range(LAYERS):
                    assert torch.equal(layers[layer][torch.from_numpy(back)],
                                       want[name][layer]), (name, layer, n, "scattered")
            service.release(held)
            service.release(backup.host_pages)


@pytest.mark.parametrize("block_misalignment", [1, 4, 8, 15])
async def test_rows_aligned_in_a_block_that_starts_unaligned_round_trip(tmp_path,
                                                                        block_misalignment):
    """Layers whose rows sit at 16-byte aligned addresses inside a memory block that itself
    starts unaligned (numpy buffers, memmaps, DLPack imports): accepted, and moved byte-exact
    (the wide element views follow the storage offset, not the address alone)."""
    geometry = dsa_indexer(num_layers=LAYERS)
    row = geometry.bytes_per_page_per_layer
    raw = np.zeros(LAYERS * DEVICE_PAGES * row + 64, dtype=np.uint8)
    start = (block_misalignment - raw.ctypes.data) % 16  # the block starts at this misalignment
    block = torch.from_numpy(raw[start:])
    skip = (16 - block_misalignment) % 16  # the layers start 16-byte aligned inside it
    layers = [block[skip + i * DEVICE_PAGES * row:skip + (i + 1) * DEVICE_PAGES * row]
              .view(DEVICE_PAGES, row) for i in range(LAYERS)]
    assert all(t.data_ptr() % 16 == 0 for t in layers)
    gen = torch.Generator().manual_seed(block_misalignment)
    for t in layers:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=HOST_PAGES),
                           backend="cpu", ledger_directory=str(tmp_path / "ledger"))
    async with OffloadService(config, layers) as service, asyncio.timeout(60):
        source, target = [3, 9, 4], [20, 1, 15]
        want = [t[source].clone() for t in layers]
        backup = await service.evict(_tokens(source))
        await service.prefetch(backup.host_pages, _tokens(target))
        for layer, expected in zip(layers, want, strict=True):
            assert torch.equal(layer[target], expected)
        service.release(backup.host_pages)


@pytest.mark.parametrize("narrow_layer", [0, 1, 2])
async def test_layers_whose_storages_share_a_start_but_not_a_size_round_trip(tmp_path,
                                                                           narrow_layer):
    """Per-layer tensors over one buffer through storages made separately (numpy slices of a
    shared or mapped buffer): one layer's storage covers only that layer, the others' the whole
    buffer, all starting at one address. Accepted at start and copied exactly, whichever layer
    has the narrow storage."""
    g = dsa_indexer(num_layers=LAYERS)
    row = g.bytes_per_page_per_layer
    buf = np.random.default_rng(narrow_layer).integers(0, 256, LAYERS * DEVICE_PAGES * row,
                                                       dtype=np.uint8)
    whole = torch.from_numpy(buf)
    layer_bytes = DEVICE_PAGES * row
    layers = [whole[i * layer_bytes:(i + 1) * layer_bytes].view(DEVICE_PAGES, row)
              for i in range(LAYERS)]
    if narrow_layer == 0:  # a storage of its own, as long as the layer, at the buffer's start
        layers[0] = torch.from_numpy(buf[:layer_bytes]).view(DEVICE_PAGES, row)
    else:  # a storage from the buffer's start up to the end of this layer only
        end = (narrow_layer + 1) * layer_bytes
        layers[narrow_layer] = torch.from_numpy(buf[:end])[end - layer_bytes:].view(
            DEVICE_PAGES, row)
    want = [t.clone() for t in layers]
    config = ServiceConfig(geometries=(g,), host_pool=PoolSize(pages=HOST_PAGES), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    async with OffloadService(config, layers) as service, asyncio.timeout(60):
        pages = np.random.default_rng(1).choice(DEVICE_PAGES, 12, replace=False)
        backup = await service.evict(_tokens(pages))
        for t in layers:
            t[torch.from_numpy(pages)] = 0
        await service.prefetch(backup.host_pages, _tokens(pages))
        for layer in range(LAYERS):
            assert torch.equal(layers[layer], want[layer]), layer
        service.release(backup.host_pages)
