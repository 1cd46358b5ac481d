"""The page-extent allocator and the page-state table."""

import resource

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.errors import UnknownHostPagesError
from dsa_async.geometry import HostLayout, dsa_indexer, mla_kv
from dsa_async.host_memory.extents import ExtentAllocator
from dsa_async.host_memory.pool import HostPool


def _reference_choice(extents: list[tuple[int, int]], size: int) -> list[tuple[int, int]] | None:
    """Best fit by a scan in address order (the smallest extent that holds it all, the lowest
    address among equals); else the largest extents first."""
    if sum(n for _, n in extents) < size:
        return None
    fits = [(n, s) for s, n in extents if n >= size]
    if fits:
        _, start = min(fits)
        return [(start, size)]
    runs, needed = [], size
    for s, n in sorted(extents, key=lambda e: (-e[1], e[0])):
        runs.append((s, min(n, needed)))
        needed -= runs[-1][1]
        if not needed:
            break
    return sorted(runs)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=80))
def test_allocator_never_hands_out_a_page_twice_and_merges_back(ops):
    capacity = 256
    alloc = ExtentAllocator(capacity)
    held: list[list[tuple[int, int]]] = []
    owned = np.zeros(capacity, dtype=bool)
    for is_alloc, size, pick in ops:
        if is_alloc or not held:
            expected = _reference_choice(alloc.free_extents, size)
            runs = alloc.allocate(size)
            assert runs == expected
            if runs is None:
                assert alloc.free_pages < size
                continue
            assert sum(n for _, n in runs) == size
            for s, n in runs:
                assert not owned[s:s + n].any(), "page handed out twice"
                owned[s:s + n] = True
            held.append(runs)
        else:
            runs = held.pop(pick % len(held))
            for s, n in runs:
                alloc.free(s, n)
                owned[s:s + n] = False
        assert alloc.free_pages == capacity - owned.sum()
        extents = alloc.free_extents
        assert alloc.largest_free_extent_pages == max((n for _, n in extents), default=0)
        for (s1, n1), (s2, _) in zip(extents, extents[1:]):
            assert s1 + n1 < s2, "adjacent free extents must be merged"
    for runs in held:
        for s, n in runs:
            alloc.free(s, n)
    assert alloc.free_extents == [(0, capacity)]


def test_allocation_prefers_one_best_fit_run():
    alloc = ExtentAllocator(100)
    a = alloc.allocate(10)
    b = alloc.allocate(30)
    c = alloc.allocate(5)
    alloc.allocate(55)
    alloc.free(*a[0])  # hole of 10 at 0
    alloc.free(*c[0])  # hole of 5 at 40
    assert alloc.allocate(5) == [(40, 5)]  # best fit, not first fit
    alloc.free(*b[0])  # 0..40 free again (merged)
    assert alloc.free_extents == [(0, 40)]


def test_best_fit_takes_the_lowest_address_among_equal_extents():
    alloc = ExtentAllocator(20)
    runs = [alloc.allocate(2)[0] for _ in range(10)]
    for start, n in (runs[7], runs[2], runs[5]):  # three free extents of 2 pages, freed out of order
        alloc.free(start, n)
    assert alloc.allocate(2) == [runs[2]]
    assert alloc.allocate(1) == [(runs[5][0], 1)]  # the smallest that holds it: still 2 pages
    assert alloc.allocate(1) == [(runs[5][0] + 1, 1)]  # now an exact fit


def test_best_fit_finds_the_one_extent_that_fits_in_a_fragmented_pool():
    alloc = ExtentAllocator(40_000)
    held = [alloc.allocate(2) for _ in range(20_000)]
    for runs in held[::2]:
        for start, n in runs:
            alloc.free(start, n)  # 10,000 free extents of 2 pages
    assert alloc.largest_free_extent_pages == 2
    alloc.free(*held[12_345][0])  # merges with both neighbours: one 6-page extent
    assert alloc.largest_free_extent_pages == 6
    assert alloc.allocate(5) == [(held[12_344][0][0], 5)]
    assert alloc.largest_free_extent_pages == 2


def test_fallback_uses_the_fewest_runs():
    alloc = ExtentAllocator(30)
    runs = [alloc.allocate(1)[0] for _ in range(30)]
    for start, n in runs[0:3] + runs[5:15] + runs[20:26]:  # free extents of 3, 10, 6
        alloc.free(start, n)
    got = alloc.allocate(15)
    assert got == [(5, 10), (20, 5)]


def _pool(pages=32, layout=HostLayout.LAYER_FIRST):
    geos = [dsa_indexer(num_layers=3, host_layout=layout), mla_kv(num_layers=3, host_layout=layout)]
    return HostPool.create(geos, pages)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_arenas_have_exact_whole_page_sizes(layout):
    pool = _pool(10, layout)
    idx = pool.arenas["indexer"]
    assert idx.numel() == 10 * 3 * 8448 and idx.dtype == torch.uint8
    assert pool.arenas["kv"].numel() == 10 * 3 * 64 * 656
    assert pool.capacity_bytes == 10 * 3 * (8448 + 64 * 656)
    assert int(idx.max()) == 0 and pool.startup_s > 0


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("pages", [1, 3, 10])
def test_every_arena_starts_on_a_host_memory_page(layout, pages):
    # as SGLang's own mmap-backed host pools do: O_DIRECT storage backends check it
    page_bytes = resource.getpagesize()
    for _ in range(3):  # whatever the allocator hands out, each time
        pool = _pool(pages, layout)
        for name, arena in pool.arenas.items():
            assert arena.data_ptr() % page_bytes == 0, name
            assert arena.is_contiguous() and int(arena.max()) == 0


def test_release_checks_ownership_and_returns_the_pages():
    pool = _pool()
    start = pool.statistics()
    h = pool.allocate(5)
    assert pool.statistics().used_pages == 5
    pool.release(h)
    with pytest.raises(UnknownHostPagesError, match="already released"):
        pool.release(h)
    assert pool.statistics() == start


def test_handle_lists_its_token_indices():
    pool = _pool()
    pool.allocate(2)
    h = pool.allocate(2)
    assert h.token_indices().tolist() == list(range(128, 256))


def test_exhaustion_returns_none_and_changes_nothing():
    pool = _pool(4)
    assert pool.allocate(5) is None
    assert pool.statistics().free_pages == 4


def test_unallocated_pages_are_refused_for_explicit_slots():
    pool = _pool()
    h = pool.allocate(2)
    pool.check_allocated(h.pages, name="host_tokens")
    with pytest.raises(UnknownHostPagesError, match="host page 7"):
        pool.check_allocated([0, 7], name="host_tokens")
    with pytest.raises(UnknownHostPagesError, match="host page 2"):
        pool.check_allocated(range(1, 4), name="host_tokens")


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.data())
def test_first_free_page_matches_a_page_by_page_scan(sizes, data):
    alloc = ExtentAllocator(40)
    held = [r for n in sizes if (r := alloc.allocate(n))]
    for i in data.draw(st.sets(st.integers(0, len(held) - 1))) if held else ():
        for start, n in held[i]:
            alloc.free(start, n)
    free = {s + i for s, n in alloc.free_extents for i in range(n)}
    start, stop = data.draw(st.integers(0, 40)), data.draw(st.integers(0, 40))
    pages = data.draw(st.one_of(st.just(range(start, stop)),
                                st.lists(st.integers(0, 39), max_size=8)))
    expected = next((p for p in pages if p in free), None)
    assert alloc.first_free(pages) == expected


def test_allocations_of_one_loop_step_are_cut_from_one_run_and_the_rest_returned():
    pool = _pool(16)
    hole = pool.allocate(3)
    pool.allocate(13)
    pool.release(hole)  # one free extent: pages 0-2
    first = pool.allocate(1, ahead_pages=2)
    second = pool.allocate(1, ahead_pages=1)
    pool.end_batch()  # one page of the run was not used: it goes back
    assert (first.runs, second.runs) == (((0, 1),), ((1, 1),))
    assert pool.statistics().free_pages == 1
    pool.release(first)
    pool.release(second)
    assert pool.statistics().largest_free_extent_pages == 3  # merged back into one extent


def test_a_run_ahead_that_does_not_fit_falls_back_to_best_fit():
    pool = _pool(8)
    held = [pool.allocate(2) for _ in range(4)]
    pool.release(held[0])
    pool.release(held[2])  # free: two extents of 2 pages
    got = pool.allocate(2, ahead_pages=2)  # no single extent holds 4 pages
    pool.end_batch()
    assert got.runs == ((0, 2),) and pool.statistics().free_pages == 2


@pytest.mark.parametrize("seed", range(5))
def test_first_released_since_names_the_first_page_a_later_release_freed(seed):
    """Against a reference kept here: after random allocations and releases, for random
    page sets (ranges, short and long lists), the first page freed after a given release."""
    rng = np.random.default_rng(seed)
    pool = HostPool([dsa_indexer(num_layers=1)], 512)
    freed_by: dict[int, int] = {}  # page -> number of the release that last freed it
    live = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            handle = live.pop(int(rng.integers(len(live))))
            pool.release(handle)
            for page in handle.page_seq:
                freed_by[page] = pool.releases
        elif (handle := pool.allocate(int(rng.integers(1, 9)))) is not None:
            live.append(handle)
        seen = int(rng.integers(0, pool.releases + 1))
        start = int(rng.integers(0, 500))
        for pages in (range(start, start + int(rng.integers(1, 12))),
                      rng.choice(512, int(rng.integers(1, 9)), replace=False).tolist(),
                      rng.choice(512, 200, replace=False).tolist()):
            want = next((p for p in pages if freed_by.get(p, 0) > seen), None)
            assert pool.first_released_since(pages, seen) == want, (pages, seen)
