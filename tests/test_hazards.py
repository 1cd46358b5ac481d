"""The page-state table against a brute-force model of the happens-before rules."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.kinds import Direction
from dsa_async.paging.runs import compact
from dsa_async.scheduling.hazards import HazardTable
from dsa_async.scheduling.request import Request

D2H, H2D = Direction.D2H, Direction.H2D
PAGES = 40  # small page spaces, so requests collide often


def _pages(draw, max_size: int) -> range | list[int]:
    if draw(st.booleans()):
        start = draw(st.integers(0, PAGES - 1))
        return range(start, min(PAGES, start + draw(st.integers(1, max_size))))
    pages = draw(st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=max_size, unique=True))
    if draw(st.booleans()):  # as the front door keeps them: a run, a list, or a PageList
        return compact(np.asarray(pages, dtype=np.int64))
    return pages


def _model_pages(request: Request) -> tuple:
    """Reads and writes in the model: unknown device pages (device indices the engine reads
    later) are every device page."""
    reads, writes = request.read_and_write_pages()
    if request.device_indices is not None:
        if request.direction is D2H:
            reads = range(PAGES)
        else:
            writes = range(PAGES)
    return reads, writes


def _expected_deps(new: Request, pending: list[Request]) -> dict[int, bool]:
    """Every pending request the new one must follow, and whether it needs its data."""
    reads, writes = _model_pages(new)
    deps: dict[int, bool] = {}
    for p in pending:
        p_reads, p_writes = _model_pages(p)
        other = p.direction is not new.direction
        read_after_write = other and not set(p_writes).isdisjoint(reads)
        needs = read_after_write and new.direction is H2D  # a load needs the backup's bytes
        follows = read_after_write or (not other and not set(p_writes).isdisjoint(writes)) or (
            other and not set(p_reads).isdisjoint(writes))
        if follows:
            deps[p.seq] = deps.get(p.seq, False) or needs
    return deps


def _busy_host_pages(pending: list[Request]) -> set[int]:
    busy: set[int] = set()
    for p in pending:
        host = p.host_pages if p.host_pages is not None else ()
        busy.update(host)
    return busy


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_dependencies_and_busy_pages_match_a_brute_force_model(data):
    table = HazardTable(PAGES)
    pending: list[Request] = []
    fresh: list[Request] = []  # backups admitted without host pages yet
    for _ in range(data.draw(st.integers(1, 30))):
        action = data.draw(st.sampled_from(["admit", "admit", "admit", "retire", "fresh"]))
        if action == "retire" and pending:
            victim = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            if victim in fresh:
                fresh.remove(victim)
            table.retire(victim)
        elif action == "fresh" and fresh:
            request = fresh.pop(0)
            used = {p for r in pending for p in (r.read_and_write_pages()[1] if r.direction is D2H
                                                 else r.read_and_write_pages()[0])}
            free = [p for p in range(PAGES) if p not in used][:request.num_pages]
            if len(free) < request.num_pages:
                continue
            if free[-1] - free[0] == len(free) - 1:  # one run: the pool hands it out as a range
                free = range(free[0], free[-1] + 1)
            request.host_pages = free
            table.register_fresh_host_writes(request)
        else:
            direction = data.draw(st.sampled_from([D2H, H2D]))
            size = data.draw(st.sampled_from([4, 40]))  # small ones and large ones
            device = _pages(data.draw, size)
            without_host = direction is D2H and data.draw(st.booleans())
            if without_host:
                host = None
            elif data.draw(st.booleans()):  # one run of host pages, as an allocation gives
                start = data.draw(st.integers(0, PAGES - len(device)))
                host = range(start, start + len(device))
            else:
                host = data.draw(st.lists(st.integers(0, PAGES - 1), min_size=len(device),
                                          max_size=len(device), unique=True))
                if data.draw(st.booleans()):
                    host = compact(np.asarray(host, dtype=np.int64))
            unknown = data.draw(st.integers(0, 4)) == 0  # device indices read later
            request = Request(direction, range(0) if unknown else device, host, without_host,
                              None, 0, 0.0, 0, 0, None)
            if unknown:
                request.device_indices = object()  # only whether it is set matters here
                request.num_pages = len(device)
            expected = _expected_deps(request, pending)
            table.admit(request)
            got = {dep.seq: needs for dep, needs in request.deps}
            assert got == expected
            pending.append(request)
            if without_host:
                fresh.append(request)
        busy = _busy_host_pages(pending)
        assert table.busy_host_pages == len(busy)
        assert table.host_pages_busy(range(PAGES)) == sorted(busy)
    for request in pending:
        table.retire(request)
    assert table.busy_host_pages == 0
    everything = Request(H2D, range(PAGES), list(range(PAGES)), False, None, 0, 0.0, 0, 0, None)
    table.admit(everything)  # nothing is left to follow
    assert everything.deps == ()
