"""The extent allocator against a page-by-page reference model, in heavily fragmented pools."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.host_memory.extents import ExtentAllocator


class PageModel:
    """Free pages as a bool array; extents and the allocator's choices derived by a scan."""

    def __init__(self, capacity_pages: int) -> None:
        self.free = np.ones(capacity_pages, dtype=bool)

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Maximal free extents: ``(starts, lengths)`` in address order."""
        edges = np.diff(np.concatenate(([0], self.free.view(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        return starts, np.flatnonzero(edges == -1) - starts

    def choice(self, num_pages: int) -> list[tuple[int, int]] | None:
        """Best fit (the smallest extent that holds it, the lowest address among equals), else
        whole extents by length descending, address ascending, the last one in part."""
        if self.free.sum() < num_pages:
            return None
        starts, lengths = self.extents()
        fits = np.flatnonzero(lengths >= num_pages)
        if fits.size:
            best = fits[np.lexsort((starts[fits], lengths[fits]))[0]]
            return [(int(starts[best]), num_pages)]
        runs, needed = [], num_pages
        for i in np.lexsort((starts, -lengths)):
            take = min(needed, int(lengths[i]))
            runs.append((int(starts[i]), take))
            needed -= take
            if not needed:
                break
        return sorted(runs)

    def take(self, runs) -> None:
        for start, n in runs:
            assert self.free[start:start + n].all(), "page handed out twice"
            self.free[start:start + n] = False

    def give_back(self, runs) -> None:
        for start, n in runs:
            self.free[start:start + n] = True


def _check_same_free_space(alloc: ExtentAllocator, model: PageModel) -> None:
    starts, lengths = model.extents()
    assert alloc.free_extents == list(zip(starts.tolist(), lengths.tolist()))
    assert alloc.free_pages == int(model.free.sum())
    assert alloc.largest_free_extent_pages == int(lengths.max(initial=0))


def _fragmented(capacity_pages: int, rng: random.Random):
    """An allocator and its model with every other small allocation freed: tens of thousands
    of holes of 1-3 pages between held runs of 1-3 pages."""
    alloc, model = ExtentAllocator(capacity_pages), PageModel(capacity_pages)
    held = []
    while alloc.free_pages >= 3:
        runs = alloc.allocate(rng.randint(1, 3))
        model.take(runs)
        held.append(runs)
    keep = []
    for i, runs in enumerate(held):
        if i % 2:
            keep.append(runs)
        else:
            for start, n in runs:
                alloc.free(start, n)
            model.give_back(runs)
    return alloc, model, keep


def test_choices_match_a_reference_scan_with_tens_of_thousands_of_holes():
    rng = random.Random(7)
    alloc, model, held = _fragmented(120_000, rng)
    assert len(alloc.free_extents) > 30_000
    _check_same_free_space(alloc, model)
    for step in range(400):
        if held and rng.random() < 0.45:
            runs = held.pop(rng.randrange(len(held)))
            for start, n in runs:
                alloc.free(start, n)
            model.give_back(runs)
        else:
            # Mostly small requests (best fit among the holes), sometimes larger than any
            # hole (the fewest-runs fallback across many extents).
            size = rng.choice([1, 2, 3, 4, 5, 8]) if rng.random() < 0.9 else rng.randint(6, 60)
            expected = model.choice(size)
            runs = alloc.allocate(size)
            assert runs == expected, f"step {step}: size {size}"
            if runs is not None:
                model.take(runs)
                held.append(runs)
        if step % 50 == 0:
            _check_same_free_space(alloc, model)
    _check_same_free_space(alloc, model)
    free_pages = np.flatnonzero(model.free)
    for _ in range(200):  # "is this page free?" against the model, ranges and lists
        a, b = sorted(rng.randrange(120_001) for _ in range(2))
        inside = free_pages[(free_pages >= a) & (free_pages < b)]
        assert alloc.first_free(range(a, b)) == (int(inside[0]) if inside.size else None)
        pages = [rng.randrange(120_000) for _ in range(5)]
        expected = next((p for p in pages if model.free[p]), None)
        assert alloc.first_free(pages) == expected
    for runs in held:
        for start, n in runs:
            alloc.free(start, n)
    assert alloc.free_extents == [(0, 120_000)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(0, 10**6)),
                max_size=150))
def test_every_choice_matches_the_reference_under_random_churn(ops):
    capacity = 200
    alloc, model = ExtentAllocator(capacity), PageModel(capacity)
    held = []
    for kind, size, pick in ops:
        if kind and held:
            runs = held.pop(pick % len(held))
            for start, n in runs:
                alloc.free(start, n)
            model.give_back(runs)
        else:
            expected = model.choice(size)
            runs = alloc.allocate(size)
            assert runs == expected
            if runs is not None:
                model.take(runs)
                held.append(runs)
        _check_same_free_space(alloc, model)


def test_the_size_index_stays_proportional_to_the_free_extents():
    """Extents merged or taken leave stale entries behind; they must not pile up."""
    alloc = ExtentAllocator(4_000)
    held = [alloc.allocate(1) for _ in range(4_000)]
    rng = random.Random(3)
    saw_stale = False
    for step in range(30_000):
        if held and rng.random() < 0.5:
            for start, n in held.pop(rng.randrange(len(held))):
                alloc.free(start, n)  # merges with free neighbours: their entries go stale
        elif (runs := alloc.allocate(rng.randint(1, 3))) is not None:
            held.append(runs)
        if step % 100 == 0:
            extents = len(alloc.free_extents)
            entries = sum(len(heap) for heap in alloc._heaps.values())
            saw_stale |= entries > extents
            assert extents <= entries <= 2 * extents + 16 * len(alloc._heaps)
    assert saw_stale, "the churn never left a stale entry: it tests nothing"


@pytest.mark.parametrize("capacity", [0, 1, 5])
def test_tiny_pools(capacity):
    alloc = ExtentAllocator(capacity)
    assert alloc.free_extents == ([(0, capacity)] if capacity else [])
    assert alloc.allocate(capacity + 1) is None
    if capacity:
        assert alloc.allocate(capacity) == [(0, capacity)]
        assert alloc.first_free(range(-3, capacity + 3)) is None
        alloc.free(0, capacity)
        assert alloc.first_free(range(-3, capacity + 3)) == 0
        assert alloc.first_free([-1, capacity, capacity - 1]) == capacity - 1
