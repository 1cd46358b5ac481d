"""How page-locking an arena in chunks answers each thing the driver may say, without a device.

``HostPinning`` registers an arena chunk by chunk; a chunk refused as already registered may be
a partial end page that a neighbouring allocation's registration holds (retried without it), or
memory its owner page-locked (left alone); any other refusal undoes every chunk of the call.
These tests stand a fake driver in for ``cudaHostRegister``/``cudaHostUnregister`` that keeps
the registered page ranges and answers as the runtime does: 712 for an overlap, or a given
error for a given range.
"""

from __future__ import annotations

import pytest
import torch

from dsa_async.errors import HostBudgetExceeded
from dsa_async.geometry import HostLayout, dsa_indexer
from dsa_async.host_memory.pool import HostPool
from dsa_async.transfer import pinning
from dsa_async.transfer.pinning import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_SUCCESS,
    HostPinning,
    chunk_ranges,
)
from dsa_async.transfer.registrations import HOST_PAGE_BYTES

PAGE = HOST_PAGE_BYTES
OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation


class FakeDriver:
    """Registrations by whole host pages, as the driver counts them."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[int, int]] = {}  # start -> page range [lo, hi)
        self.refuse: dict[tuple[int, int], int] = {}  # exact range -> error code

    @staticmethod
    def pages(start: int, stop: int) -> tuple[int, int]:
        return start // PAGE, -(-stop // PAGE)

    def register(self, start: int, stop: int, flags: int) -> int:
        if (start, stop) in self.refuse:
            return self.refuse[(start, stop)]
        lo, hi = self.pages(start, stop)
        if any(a < hi and lo < b for a, b in self.registered.values()):
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[start] = (lo, hi)
        return CUDA_SUCCESS

    def unregister(self, start: int) -> int:
        return CUDA_SUCCESS if self.registered.pop(start, None) else 713


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(pinning, "_register", fake.register)
    monkeypatch.setattr(pinning, "_unregister", fake.unregister)
    return fake


def _pieces(lo: int, hi: int, chunk_bytes: int = 4 * PAGE):
    pinning_ = HostPinning(torch.device("cpu"), chunk_bytes=chunk_bytes)
    return pinning_._register_pieces(lo, hi, chunk_ranges(lo, hi - lo, chunk_bytes))


def test_every_chunk_registers_when_nothing_else_holds_the_memory(driver):
    lo, hi = 100 * PAGE + 64, 110 * PAGE + 8
    done, foreign, edges, failure = _pieces(lo, hi)
    assert failure is None and foreign == [] and edges == 0
    assert [(r.start, r.stop) for r in done] == chunk_ranges(lo, hi - lo, 4 * PAGE)
    assert set(driver.registered) == {r.start for r in done}


def test_a_neighbour_holding_the_first_partial_page_costs_only_that_page(driver):
    lo, hi = 100 * PAGE + 64, 110 * PAGE
    driver.registered[0] = (100, 101)  # another allocation's registration in page 100
    done, foreign, edges, failure = _pieces(lo, hi)
    assert failure is None and foreign == []
    assert done[0].start == 101 * PAGE and edges == PAGE - 64
    assert sum(r.nbytes for r in done) + edges == hi - lo


def test_memory_its_owner_page_locked_is_left_alone_and_reported(driver):
    lo, hi = 100 * PAGE, 112 * PAGE
    driver.registered[0] = (104, 108)  # the whole middle chunk
    done, foreign, edges, failure = _pieces(lo, hi)
    assert failure is None and foreign == [(104 * PAGE, 108 * PAGE)] and edges == 0
    assert [(r.start, r.stop) for r in done] == [(100 * PAGE, 104 * PAGE),
                                                 (108 * PAGE, 112 * PAGE)]


def test_another_refusal_undoes_every_chunk_of_the_call(driver):
    lo, hi = 100 * PAGE, 112 * PAGE
    driver.refuse[(108 * PAGE, 112 * PAGE)] = OUT_OF_MEMORY
    done, foreign, edges, failure = _pieces(lo, hi)
    assert (done, foreign, edges) == ([], [], 0)
    assert failure == (108 * PAGE, 112 * PAGE, OUT_OF_MEMORY)
    assert driver.registered == {}


def test_a_retry_without_the_partial_page_that_fails_otherwise_is_a_failure_not_foreign(driver):
    lo, hi = 100 * PAGE + 64, 112 * PAGE
    driver.registered[0] = (100, 101)  # the first chunk is refused for its partial page...
    driver.refuse[(101 * PAGE, 104 * PAGE)] = OUT_OF_MEMORY  # ...and its retry for memory
    done, foreign, edges, failure = _pieces(lo, hi)
    assert (done, foreign, edges) == ([], [], 0)
    assert failure == (lo, 104 * PAGE, OUT_OF_MEMORY)
    assert set(driver.registered) == {0}  # only the neighbour's registration is left


@pytest.fixture
def on_this_thread(monkeypatch):
    """``register`` runs its driver calls here (no device to bind a thread to)."""
    monkeypatch.setattr(pinning, "run_isolated", lambda device, fn: fn())


@pytest.mark.parametrize(("code", "says", "never_says"), [
    (OUT_OF_MEMORY, "Make the host pool smaller (ServiceConfig.host_pool)", "cudaDevAttr"),
    (801, "cudaDevAttrHostRegisterSupported", "Make the host pool smaller"),  # not supported
])
def test_a_refused_arena_says_what_to_change_for_that_refusal(driver, on_this_thread, code,
                                                                says, never_says):
    arena = torch.empty(12 * PAGE, dtype=torch.uint8)
    start = arena.data_ptr()
    host = HostPinning(torch.device("cpu"), chunk_bytes=4 * PAGE)
    driver.refuse[chunk_ranges(start, 12 * PAGE, 4 * PAGE)[-1]] = code
    with pytest.raises(HostBudgetExceeded) as refused:
        host.register_tensor_bytes(arena, "the indexer arena")
    message = str(refused.value)
    assert f"cudaError {code}" in message and "the indexer arena" in message
    assert says in message and never_says not in message
    assert driver.registered == {} and host.pinned_bytes == 0  # all or nothing


def test_chunks_and_trims_fall_on_the_hosts_own_page_size():
    import resource

    assert PAGE == resource.getpagesize()
    for page in (4096, 16384, 65536):  # x86, some arm64, Grace-class arm64 kernels
        pieces = chunk_ranges(7 * page + 40, 9 * page, 2 * page, page_bytes=page)
        assert all(stop % page == 0 for _start, stop in pieces[:-1])
        assert all(b[0] == a[1] for a, b in zip(pieces, pieces[1:]))


@pytest.mark.parametrize("layout", list(HostLayout))
def test_an_arena_locks_its_own_bytes_not_the_allocation_around_them(driver, on_this_thread,
                                                                     layout):
    # the arena is a page-aligned view into an allocation up to a page larger: locking the
    # whole allocation would lock memory outside the pool and more than the ledger reserved
    pool = HostPool.create([dsa_indexer(num_layers=3, host_layout=layout)], 5)
    arena = pool.arenas["indexer"]
    assert arena.untyped_storage().nbytes() > arena.nbytes  # a view: the case that matters
    seen_as = arena if layout is HostLayout.LAYER_FIRST else arena.transpose(0, 1)
    host = HostPinning(torch.device("cpu"), chunk_bytes=4 * PAGE)
    host.register_tensor_bytes(seen_as, "the indexer arena")  # as the engine sees it
    starts = sorted(r.start for r in host.registrations)
    stops = sorted(r.stop for r in host.registrations)
    assert starts[0] == arena.data_ptr() and stops[-1] == arena.data_ptr() + arena.nbytes
    assert host.pinned_bytes == arena.nbytes
    first_page = arena.data_ptr() // PAGE
    assert min(lo for lo, _ in driver.registered.values()) == first_page
