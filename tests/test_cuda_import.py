"""The CUDA backend without a device: it imports, refuses cleanly, and its copy plan is exact.

The copy code of the CUDA backend only issues torch ops on the current stream, so it runs on CPU
tensors too; these tests check its segmenting, tiling, staging and index ops byte for byte.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import ConfigError
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import HostLayout, dsa_indexer, mla_kv
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Backend, Direction
from dsa_async.transfer.base import resolve_backend
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.cuda_copy import (
    BatchCopy,
    CopyPath,
    DeviceStaging,
    PoolTarget,
    issue_batch,
)
from dsa_async.transfer.handoff import LoopHandoff
from dsa_async.transfer.pinning import chunk_ranges, memlock_limit_text
from dsa_async.transfer.registrations import RegistrationMap

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device path")


def test_cuda_module_imports_without_a_device():
    module = importlib.import_module("dsa_async.transfer.cuda")
    assert module.CudaEngine.backend is Backend.CUDA


@no_cuda
def test_cuda_engine_without_a_device_raises_config_error_pointing_to_cpu():
    from dsa_async.transfer.cuda import CudaEngine

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ConfigError, match="no|none") as info:
            CudaEngine({}, LoopHandoff(loop), lambda handle: None)
    finally:
        loop.close()
    message = str(info.value)
    assert "CUDA device" in message and "backend 'cpu'" in message


@no_cuda
def test_auto_backend_resolves_to_cpu_without_a_device():
    assert resolve_backend(Backend.AUTO) is Backend.CPU


@no_cuda
def test_service_with_cuda_backend_refuses_at_start_and_returns_everything(tmp_path):
    geometry = dsa_indexer(num_layers=2)
    buffers = [torch.zeros(4, geometry.bytes_per_page_per_layer, dtype=torch.uint8)
               for _ in range(2)]
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cuda",
                           ledger_directory=str(tmp_path / "ledger"))
    service = OffloadService(config, buffers)

    async def start():
        await service.start()

    with pytest.raises(ConfigError, match="backend 'cpu'"):
        asyncio.run(start())


# --- page-locking arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize("ptr", [0x10000, 0x10040, 0x10FFF])
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3 * 8448 * 61 * 7, 5 << 20])
def test_chunk_ranges_cover_exactly_with_page_aligned_inner_boundaries(ptr, nbytes):
    chunk = 1 << 20
    pieces = chunk_ranges(ptr, nbytes, chunk)
    assert pieces[0][0] == ptr and pieces[-1][1] == ptr + nbytes
    assert sum(stop - start for start, stop in pieces) == nbytes
    for (_, stop), (start, _) in itertools.pairwise(pieces):
        assert stop == start and stop % 4096 == 0
    assert all(0 < stop - start <= chunk for start, stop in pieces)


def test_chunk_ranges_refuse_a_chunk_that_is_not_whole_pages():
    with pytest.raises(ValueError, match="multiple of 4096"):
        chunk_ranges(0, 10, 1000)


def test_memlock_limit_text_names_the_limit():
    assert memlock_limit_text().startswith("RLIMIT_MEMLOCK soft=")


# --- the copy code on CPU tensors --------------------------------------------------------------


def _setup(layout, fused, layers, host_pages=40, device_pages=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    geometries = [dsa_indexer(num_layers=layers, host_layout=layout),
                  mla_kv(num_layers=layers, host_layout=layout)]
    pool = HostPool.create(geometries, host_pages)
    bindings = {}
    for g in geometries:
        shape = (layers, device_pages, g.bytes_per_page_per_layer)
        if fused:
            device = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        else:  # separately allocated layers, viewed as another dtype (bytes are bytes)
            device = [torch.randint(0, 256, shape[1:], dtype=torch.uint8, generator=gen)
                      .view(torch.int16) for _ in range(layers)]
        bindings[g.name] = bind_pool(g, pool.arenas[g.name], device)
    assert all((b.device_fused is not None) == fused or layers == 1 for b in bindings.values())
    return pool, bindings


def _page_sets(kind, rng, n, host_pages, device_pages):
    if kind == "contiguous":
        return np.arange(3, 3 + n), np.arange(5, 5 + n)
    if kind == "extents":  # host in two extents, device scattered
        host = np.concatenate([np.arange(0, n // 2), np.arange(20, 20 + n - n // 2)])
        return host, rng.permutation(device_pages)[:n]
    if kind == "long_runs":  # device in two long runs inside one host segment
        return np.arange(0, n), np.concatenate([np.arange(30, 30 + n // 2),
                                                np.arange(0, n - n // 2)])
    return rng.permutation(host_pages)[:n], rng.permutation(device_pages)[:n]


CPU = torch.device("cpu")


def _targets(bindings, mapped=True):
    """Pool targets as the engine builds them; on the CPU the "mapped view" is the arena."""
    return [PoolTarget.of(b, b.host if mapped else None) for b in bindings.values()]


def _run(bindings, host, dev, direction, capacity, mapped=True):
    """Issue one batch the way the engine does (plan, one upload, layer groups)."""
    targets = _targets(bindings, mapped)
    index_pages = min(min(b.host.shape[1], b.device_pages) for b in bindings.values())
    staging = DeviceStaging(CPU, capacity, index_pages)
    copy = BatchCopy(host.astype(np.int64), dev.astype(np.int64), targets, direction, staging,
                     RegistrationMap([]))
    copy.upload_index()
    issue_batch(copy, max(b.geometry.num_layers for b in bindings.values()))
    return copy


_CASES = [(layout, fused, layers, kind, 64 << 20, mapped)
          for layout in HostLayout for fused in (True, False) for layers in (1, 5)
          for kind in ("contiguous", "extents", "long_runs", "random")
          for mapped in ((True, False) if layers > 1 else (True,))]
_CASES += [(layout, fused, 5, kind, 150_000, mapped)  # several tiles per batch
           for layout in HostLayout for fused in (True, False) for kind in ("extents", "random")
           for mapped in (True, False)]


@pytest.mark.parametrize(("layout", "fused", "layers", "kind", "capacity", "mapped"), _CASES)
def test_cuda_copy_plan_round_trips_byte_exact(layout, fused, layers, kind, capacity, mapped):
    _round_trip(layout, fused, layers, kind, capacity, mapped)


class _IndexWrites(TorchDispatchMode):
    """Records ``(dim, destination contiguous)`` of every index write issued inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.index_copy_, torch.ops.aten.index_copy,
                                   torch.ops.aten.index_put_, torch.ops.aten.index_put):
            dim = args[1] if func.overloadpacket in (torch.ops.aten.index_copy_,
                                                     torch.ops.aten.index_copy) else 0
            self.writes.append((dim, args[0].is_contiguous()))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def deterministic_mode():
    """torch's deterministic algorithms on for the test (as a host process may set them)."""
    was_on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was_on, warn_only=warn_only)


@pytest.mark.parametrize(("layout", "fused", "layers", "kind", "capacity", "mapped"), _CASES)
def test_in_deterministic_mode_index_copies_write_rows_of_contiguous_tensors_only(
        deterministic_mode, layout, fused, layers, kind, capacity, mapped):
    # A CUDA index_copy_ then runs as a deterministic index_put_ that copies and rewrites the
    # whole destination unless it writes dim-0 rows of a contiguous tensor: every page of a
    # fused view's layers (racing the forward pass's writes), or the mapped arena slab.
    with _IndexWrites() as recorded:
        _round_trip(layout, fused, layers, kind, capacity, mapped)
    assert all(write == (0, True) for write in recorded.writes), recorded.writes


def test_outside_deterministic_mode_a_fused_scatter_is_one_kernel_per_layer_group():
    assert not torch.are_deterministic_algorithms_enabled()
    with _IndexWrites() as recorded:
        _round_trip(HostLayout.LAYER_FIRST, True, 5, "random", 64 << 20, True)
    assert any(dim == 1 for dim, _ in recorded.writes)  # the fast path where it is safe


def _round_trip(layout, fused, layers, kind, capacity, mapped):
    """A backup then a load of other device pages through the CUDA copy code on CPU tensors,
    checked byte for byte, untouched device pages included."""
    rng = np.random.default_rng(layers * 7 + len(kind))
    _pool, bindings = _setup(layout, fused, layers)
    n = 16
    host, dev = _page_sets(kind, rng, n, 40, 48)
    before = {name: [t.clone() for t in b.device_layers] for name, b in bindings.items()}
    _run(bindings, host, dev, Direction.D2H, capacity, mapped)
    for name, b in bindings.items():
        for layer in range(layers):
            assert torch.equal(b.host[layer][torch.as_tensor(host)],
                               before[name][layer][torch.as_tensor(dev)])
    targets = np.setdiff1d(np.arange(48), dev)[:n]  # other device pages
    rng.shuffle(targets)
    for b in bindings.values():
        for t in b.device_layers:
            t[torch.as_tensor(targets)] = 0
    _run(bindings, host, targets, Direction.H2D, capacity, mapped)
    for name, b in bindings.items():
        for layer in range(layers):
            got = b.device_layers[layer][torch.as_tensor(targets)]
            assert torch.equal(got, before[name][layer][torch.as_tensor(dev)])
            untouched = np.setdiff1d(np.arange(48), np.concatenate([dev, targets]))
            assert torch.equal(b.device_layers[layer][torch.as_tensor(untouched)],
                               before[name][layer][torch.as_tensor(untouched)])


def _paths(copy):
    return [plan.path for plan in copy.plans]


def test_batch_plan_picks_memcpy_for_runs_and_extents_and_kernels_for_scattered_hosts():
    rng = np.random.default_rng(3)
    _pool, bindings = _setup(HostLayout.LAYER_FIRST, False, 3)
    cases = {
        "contiguous": [CopyPath.RUNS, CopyPath.RUNS],
        "extents": [CopyPath.STAGED, CopyPath.STAGED],
        "random": [CopyPath.MAPPED, CopyPath.MAPPED],
    }
    for kind, paths in cases.items():
        host, dev = _page_sets(kind, rng, 16, 40, 48)
        assert _paths(_run(bindings, host, dev, Direction.H2D, 64 << 20)) == paths, kind
    host, dev = _page_sets("random", rng, 16, 40, 48)
    unmapped = _run(bindings, host, dev, Direction.H2D, 64 << 20, mapped=False)
    assert _paths(unmapped) == [CopyPath.STAGED, CopyPath.STAGED]


def test_batch_plan_cuts_host_segments_per_tile_once():
    host = np.array([7, 8, 9, 10, 11, 40, 41], dtype=np.int64)
    dev = np.array([3, 4, 5, 90, 91, 12, 13], dtype=np.int64)
    _pool, bindings = _setup(HostLayout.LAYER_FIRST, False, 1, host_pages=48, device_pages=96)
    staging = DeviceStaging(CPU, 1 << 20, 48)
    copy = BatchCopy(host, dev, _targets(bindings), Direction.D2H, staging, RegistrationMap([]))
    assert copy.segment_pos.tolist() == [0, 5] and copy.segment_host.tolist() == [7, 40]
    assert copy.runs.tolist() == [[7, 3, 3], [10, 90, 2], [40, 12, 2]]
    assert copy.host_pieces(0, 7).rows == ((0, 7, 5), (5, 40, 2))
    assert copy.host_pieces(2, 6).rows == ((0, 9, 3), (3, 40, 1))
    assert copy.host_pieces(6, 7).rows == ((0, 41, 1),)
    assert copy.device_start is None


def test_batch_plan_knows_when_the_device_side_is_one_run():
    _pool, bindings = _setup(HostLayout.LAYER_FIRST, False, 1)
    staging = DeviceStaging(CPU, 1 << 20, 40)
    copy = BatchCopy(np.array([5, 1, 9], dtype=np.int64), np.arange(10, 13, dtype=np.int64),
                     _targets(bindings), Direction.H2D, staging, RegistrationMap([]))
    assert copy.device_start == 10 and len(copy.segment_pos) == 3


def test_h2d_layer_group_widens_only_for_unmapped_page_first_hosts():
    rng = np.random.default_rng(0)
    host, dev = _page_sets("random", rng, 6, 12, 12)
    _pool, lf = _setup(HostLayout.LAYER_FIRST, False, 61, host_pages=12, device_pages=12)
    assert _run(lf, host, dev, Direction.H2D, 64 << 20, mapped=False).h2d_group == 1
    _pool, pf = _setup(HostLayout.PAGE_FIRST, False, 61, host_pages=12, device_pages=12)
    assert _run(pf, host, dev, Direction.H2D, 64 << 20, mapped=True).h2d_group == 1
    group = _run(pf, host, dev, Direction.H2D, 64 << 20, mapped=False).h2d_group
    widest_row = max(b.geometry.bytes_per_page_per_layer for b in pf.values())
    assert group == -(-256 * 1024 // widest_row) and 1 < group < 61  # ~256 KiB per page call
