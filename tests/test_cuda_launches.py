"""The CUDA issue code makes a small constant number of calls per layer (counted on the CPU)."""

from __future__ import annotations

import numpy as np
import torch

from dsa_async.bench.copy_rig import PagePattern
from dsa_async.bench.cuda_calls import CudaCallCounter
from dsa_async.bench.cuda_launch_scenarios import EXTENTS, RANDOM, calls_per_layer, cuda_launches
from dsa_async.bench.device import BenchDevice
from dsa_async.bench.registry import TARGETS, BenchContext
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Backend, Direction
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.cuda_copy import BatchCopy, DeviceStaging, PoolTarget, issue_batch
from dsa_async.transfer.registrations import RegistrationMap


def _context(figure_bytes: int) -> BenchContext:
    return BenchContext(device=BenchDevice(Backend.CPU), engine_class=object, loop=None,
                        geometry=dsa_indexer(), pairs=3, figure_bytes=figure_bytes)


def test_counter_counts_copies_and_index_ops_but_not_views_or_allocations():
    a = torch.zeros(10, 8, dtype=torch.uint8)
    b = torch.zeros(10, 8, dtype=torch.uint8)
    index = torch.arange(3)
    with CudaCallCounter() as counter:
        a[2:5].view(torch.int64).transpose(0, 1)
        torch.empty(4)
        for page in range(3):  # per-page copies: one call each
            b[page].copy_(a[page])
        torch.index_select(a, 0, index, out=b[:3])
        b.index_copy_(0, index, a[:3])
    assert counter.calls == 5
    assert counter.by_op == {"copy_": 3, "index_select": 1, "index_copy_": 1}


def test_scattered_and_extent_batches_stay_within_four_calls_per_layer():
    figures = cuda_launches(_context(32 << 20))
    assert set(figures) == {RANDOM.name, EXTENTS.name}
    for name, value in figures.items():
        assert TARGETS[name].met(value), (name, value)
        assert value >= 1.0  # at least one call per layer: the count is real


def test_without_the_mapped_view_scattered_pages_cost_a_memcpy_each():
    # The contrast the figure guards: the same random batch through memcpy per host run.
    g = dsa_indexer(num_layers=4)
    pool = HostPool.create([g], 64)
    device = [torch.zeros(64, g.bytes_per_page_per_layer, dtype=torch.uint8) for _ in range(4)]
    binding = bind_pool(g, pool.arenas[g.name], device)
    rng = np.random.default_rng(0)
    host, dev = rng.choice(64, 32, replace=False), rng.choice(64, 32, replace=False)
    per_layer = {}
    for mapped in (binding.host, None):
        counter = CudaCallCounter()
        staging = DeviceStaging(torch.device("cpu"), 64 << 20, 64)
        with counter:
            copy = BatchCopy(host.astype(np.int64), dev.astype(np.int64),
                             [PoolTarget.of(binding, mapped)], Direction.H2D, staging,
                             RegistrationMap([]))
            copy.upload_index()
            issue_batch(copy, g.num_layers)
        per_layer[mapped is not None] = counter.calls / g.num_layers
    assert per_layer[True] <= 2.5
    assert per_layer[False] >= 30  # ~one memcpy per page and layer, plus the scatter


def test_extent_figure_counts_one_gather_and_one_memcpy_per_layer():
    # Host pages in one extent, device runs of 16: staged, 2 calls a layer + 1 upload and a
    # start and an end event a batch; a load also records one readiness event per layer
    # (half a call per layer over the two directions).
    value = calls_per_layer(_context(32 << 20), PagePattern.EXTENTS)
    assert abs(value - (2 + 3 / 61 + 0.5)) < 1e-9
