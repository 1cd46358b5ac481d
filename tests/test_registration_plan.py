"""No memcpy the CUDA copy code issues spans two page-lock registrations of the host arena.

The arena is page-locked in chunks (``pinning.chunk_ranges``); one ``cudaMemcpyAsync`` whose
host range runs from one registration into the next is refused by the driver or treated as
pageable memory. These tests run the real chunking on a real arena's address and the real
device copy code (``cuda_copy.BatchCopy``, as the engine drives it) on CPU tensors, record
every copy that touches the arena through a dispatch mode, and check each host range against
the registration edges, for both host layouts, several chunk sizes and random batches. Index
kernels (the mapped path) reach the arena through unified addressing and have no such limit;
only ``copy_`` calls, the memcpys, are checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_async.geometry import HostLayout, dsa_indexer, mla_kv
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Direction
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.cuda_copy import BatchCopy, DeviceStaging, PoolTarget, issue_batch
from dsa_async.transfer.pinning import chunk_ranges
from dsa_async.transfer.registrations import RegistrationMap, tensor_span

CPU = torch.device("cpu")
HOST_PAGES = 96
DEVICE_PAGES = 128
LAYERS = 3
BATCHES = 6
#: Chunk sizes: a few pages of 4 KiB (edges inside most rows), and larger ones.
CHUNK_BYTES = (3 * 4096, 16 * 4096, 64 * 4096)


class ArenaCopies(TorchDispatchMode):
    """Records the host byte range of every ``copy_`` that reads or writes the arenas."""

    def __init__(self, arenas: list[tuple[int, int]]) -> None:
        super().__init__()
        self.arenas = arenas
        self.ranges: list[tuple[int, int]] = []
        self.noncontiguous = 0

    def _in_arena(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return any(lo <= ptr < hi for lo, hi in self.arenas)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            for side in (dst, src):
                if self._in_arena(side):
                    if not side.is_contiguous():
                        self.noncontiguous += 1  # would not be one memcpy
                    nbytes = side.numel() * side.element_size()
                    self.ranges.append((side.data_ptr(), side.data_ptr() + nbytes))
        return func(*args, **(kwargs or {}))


def _pools(layout: HostLayout, seed: int):
    geometries = [dsa_indexer(num_layers=LAYERS, host_layout=layout),
                  mla_kv(num_layers=LAYERS, host_layout=layout)]
    pool = HostPool.create(geometries, HOST_PAGES)
    gen = torch.Generator().manual_seed(seed)
    bindings = {}
    for g in geometries:
        device = [torch.randint(0, 256, (DEVICE_PAGES, g.bytes_per_page_per_layer),
                                dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
        bindings[g.name] = bind_pool(g, pool.arenas[g.name], device)
    return pool, bindings


def _registrations(pool: HostPool, chunk_bytes: int) -> tuple[RegistrationMap, list]:
    """The engine's chunking of every arena (``chunk_ranges`` on the arena's real bytes)."""
    ranges, arenas = [], []
    for arena in pool.arenas.values():
        start, nbytes = tensor_span(arena)
        ranges += chunk_ranges(start, nbytes, chunk_bytes)
        arenas.append((start, start + nbytes))
    return RegistrationMap(ranges), arenas


def _batch(rng: np.random.Generator, kind: str, n: int):
    if kind == "runs":  # long runs on both sides: one memcpy per run, across many edges
        h0, d0 = rng.integers(0, HOST_PAGES - n), rng.integers(0, DEVICE_PAGES - n)
        return np.arange(h0, h0 + n), np.arange(d0, d0 + n)
    if kind == "extents":  # host runs, device scattered: staged memcpys per host run
        h0 = rng.integers(0, HOST_PAGES - n)
        return np.arange(h0, h0 + n), rng.choice(DEVICE_PAGES, n, replace=False)
    return rng.choice(HOST_PAGES, n, replace=False), rng.choice(DEVICE_PAGES, n, replace=False)


def _issue(bindings, host, dev, direction, registrations, mapped, capacity_bytes):
    targets = [PoolTarget.of(b, b.host if mapped else None) for b in bindings.values()]
    staging = DeviceStaging(CPU, capacity_bytes, min(HOST_PAGES, DEVICE_PAGES))
    copy = BatchCopy(host.astype(np.int64), dev.astype(np.int64), targets, direction, staging,
                     registrations)
    copy.upload_index()
    issue_batch(copy, LAYERS)


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("chunk_bytes", CHUNK_BYTES)
def test_no_memcpy_crosses_a_registration_edge(layout, chunk_bytes):
    rng = np.random.default_rng(chunk_bytes + len(layout.value))
    pool, bindings = _pools(layout, seed=chunk_bytes)
    registrations, arenas = _registrations(pool, chunk_bytes)
    assert len(registrations.ranges) > 2 * len(arenas)  # several chunks per arena
    recorder = ArenaCopies(arenas)
    edges = set(registrations.edges)
    met_at_edge = 0
    for b in range(BATCHES):
        for kind in ("runs", "extents", "random"):
            n = int(rng.integers(8, 40))
            host, dev = _batch(rng, kind, n)
            for mapped in (True, False):
                for direction in Direction:
                    start = len(recorder.ranges)
                    with recorder:
                        _issue(bindings, host, dev, direction, registrations, mapped,
                               capacity_bytes=(1 << 20) if b % 2 else (64 << 20))
                    issued = recorder.ranges[start:]
                    for lo, hi in issued:
                        crossing = registrations.crossing(lo, hi - lo)
                        assert crossing is None, (
                            f"{kind} {direction.value} (mapped={mapped}): memcpy of host "
                            f"[{lo:#x}, {hi:#x}) crosses the registration edge {crossing:#x}")
                    met_at_edge += sum(1 for (_, a), (c, _) in zip(issued, issued[1:])
                                       if a == c and a in edges)
    assert recorder.noncontiguous == 0
    # The batches did reach edges: some copies were cut exactly there (else nothing was tested).
    assert met_at_edge > 0


@pytest.mark.parametrize("layout", list(HostLayout))
def test_copies_cut_at_edges_still_move_every_byte(layout):
    rng = np.random.default_rng(7)
    pool, bindings = _pools(layout, seed=1)
    registrations, _ = _registrations(pool, 3 * 4096)
    before = {name: [t.clone() for t in b.device_layers] for name, b in bindings.items()}
    for kind in ("runs", "extents", "random"):
        host, dev = _batch(rng, kind, 24)
        free = np.setdiff1d(np.arange(DEVICE_PAGES), dev)
        back = rng.choice(free, host.size, replace=False)
        for mapped in (True, False):
            _issue(bindings, host, dev, Direction.D2H, registrations, mapped, 64 << 20)
            _issue(bindings, host, back, Direction.H2D, registrations, mapped, 64 << 20)
            for name, b in bindings.items():
                for layer in range(LAYERS):
                    assert torch.equal(b.device_layers[layer][torch.as_tensor(back)],
                                       before[name][layer][torch.as_tensor(dev)]), (kind, mapped)
            for name, b in bindings.items():  # restore for the next round
                for layer in range(LAYERS):
                    b.device_layers[layer].copy_(before[name][layer])


def test_registration_map_splits_at_every_edge_inside_a_range():
    regs = RegistrationMap([(0x1000, 0x5000), (0x5000, 0x9000), (0x9000, 0x9100)])
    assert regs.split(0x4800, 0xC00) == [(0, 0x800), (0x800, 0x400)]
    assert regs.split(0x1000, 0x4000) == [(0, 0x4000)]  # ends exactly on an edge: one piece
    assert regs.split(0x4000, 0x5080) == [(0, 0x1000), (0x1000, 0x4000), (0x5000, 0x80)]
    assert regs.crossing(0x4FFF, 2) == 0x5000 and regs.crossing(0x5000, 0x4000) is None
    assert regs.covers(0x1000, 0x8100) and not regs.covers(0x9100, 0x1000)
    assert regs.covers(0x90FF, 0x800)  # same 4 KiB page as the last registration
