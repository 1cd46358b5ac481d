"""A copy crew: every item copied once, by the issuing thread and its helpers; errors come back
to the issuing thread only after every share is done; short run copies through a fused device
view move the same bytes whatever the crew's size."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import numpy as np
import pytest
import torch

from dsa_async.geometry import HostLayout, dsa_indexer, mla_kv
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Direction
from dsa_async.transfer import copy_crew, cpu, layer_calls
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.copy_crew import MAX_CREW_THREADS, CopyCrew, crew_threads
from dsa_async.transfer.copyplan import LONG_RUN_PAGES, PagePlan, Staging, copy_layers_cpu
from dsa_async.transfer.cpu import CpuEngine
from dsa_async.transfer.handoff import LoopHandoff


@pytest.fixture
def crew3():
    crew = CopyCrew(2, "test-crew")
    yield crew
    crew.close()


def test_every_item_is_handled_once_in_contiguous_shares(crew3):
    for count in (0, 1, 2, 3, 7, 100):
        seen: list[tuple[int, list[int]]] = []
        lock = threading.Lock()

        def record(share, seen=seen, lock=lock):
            with lock:
                seen.append((threading.get_ident(), list(share)))

        crew3.map(record, list(range(count)))
        shares = sorted(share for _, share in seen if share)
        assert [i for share in shares for i in share] == list(range(count))
        assert all(share == list(range(share[0], share[-1] + 1)) for share in shares)
        assert len({ident for ident, share in seen if share}) == min(count, 3)


def test_the_issuing_thread_copies_the_first_share(crew3):
    owners = {}
    crew3.map(lambda share: owners.update({share[0]: threading.get_ident()}), list(range(9)))
    assert owners[0] == threading.get_ident()
    assert threading.get_ident() not in (owners[3], owners[6])


@pytest.mark.parametrize("failing_share", [0, 1, 2])
def test_an_error_comes_back_after_every_share_is_done(crew3, failing_share):
    finished = []
    lock = threading.Lock()
    release = threading.Event()

    def work(share):
        if share[0] == 3 * failing_share:
            release.set()
            raise ValueError(f"share {failing_share} failed")
        release.wait(10)  # the other shares end after the failure
        with lock:
            finished.append(share[0])

    with pytest.raises(ValueError, match=f"share {failing_share} failed"):
        crew3.map(work, list(range(9)))
    assert len(finished) == 2  # nothing still runs once map raised
    crew3.map(lambda share: finished.append(len(share)), list(range(9)))  # still usable
    assert finished[2:] == [3, 3, 3]


def test_close_stops_the_helpers():
    crew = CopyCrew(3, "test-crew-close")
    names = {t.name for t in threading.enumerate()}
    assert {f"test-crew-close-{i}" for i in (1, 2, 3)} <= names
    crew.close()
    assert not {t.name for t in threading.enumerate()} & {f"test-crew-close-{i}" for i in (1, 2, 3)}


def test_crew_size_follows_torch_threads_within_bounds():
    assert crew_threads(1) == 1 and crew_threads(2) == 2
    assert crew_threads(64) == MAX_CREW_THREADS
    assert CopyCrew(0, "alone").size == 1


def _start_bytes(geometry, host_pages: int, device_pages: int, seed: int):
    """Random bytes for a pool's arena of ``host_pages`` and ``[layers, device_pages, row]``
    device bytes, to start each compared copy from."""
    arena_bytes = HostPool.create([geometry], host_pages).arenas[geometry.name].numel()
    gen = torch.Generator().manual_seed(seed)
    arena = torch.randint(0, 256, (arena_bytes,), dtype=torch.uint8, generator=gen)
    device = torch.randint(0, 256, (geometry.num_layers, device_pages,
                                    geometry.bytes_per_page_per_layer),
                           dtype=torch.uint8, generator=gen)
    return arena, device


def _fresh_arena(geometry, host_pages: int, arena_start: torch.Tensor) -> torch.Tensor:
    """A new pool's arena holding ``arena_start``."""
    arena = HostPool.create([geometry], host_pages).arenas[geometry.name]
    arena.view(-1).copy_(arena_start)
    return arena


@pytest.mark.parametrize("geometry_of", [dsa_indexer, mla_kv], ids=["indexer", "kv"])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_short_run_copies_are_byte_exact_for_any_crew_size(geometry_of, layout, direction):
    """Single scattered pages and short runs, through a fused view, with crews of 1 to 4
    threads: the same bytes as a crew-less copy."""
    geometry = geometry_of(num_layers=9, host_layout=layout)
    host_pages, device_pages_total, n = 24, 20, 12
    arena_start, device_start = _start_bytes(geometry, host_pages, device_pages_total, 11)
    # single pages scattered on both sides, then one run of 4 on both sides
    host = np.concatenate((np.random.default_rng(1).choice(20, n - 4, replace=False),
                           np.arange(20, 24))).astype(np.int64)
    dev = np.concatenate((np.random.default_rng(2).choice(16, n - 4, replace=False),
                          np.arange(16, 20))).astype(np.int64)
    plan = PagePlan.build(host, dev)
    for threads in range(1, MAX_CREW_THREADS + 1):
        crew = CopyCrew(threads - 1, f"test-crew-{threads}")
        try:
            results = []
            for use_crew in (False, True):
                arena = _fresh_arena(geometry, host_pages, arena_start)
                device = device_start.clone()
                binding = bind_pool(geometry, arena, list(device))
                assert binding.device_fused is not None
                copy_layers_cpu(binding, plan, direction, 2, 8, Staging(),
                                crew if use_crew else None)
                results.append((arena.clone(), device.clone()))
            (arena_a, device_a), (arena_b, device_b) = results
            assert torch.equal(arena_a, arena_b) and torch.equal(device_a, device_b)
            # and the copy did something: layers 2..7 of the pages now agree on both sides
            h = binding.host
            assert torch.equal(h[2:8, host], binding.device_fused[2:8, dev])
            assert not torch.equal(h[0:2, host], binding.device_fused[0:2, dev])
        finally:
            crew.close()


def _pairs(pattern: str, host_pages: int, device_pages: int, n: int):
    """``n`` page pairs: single pages scattered on both sides, runs of 4 scattered on both
    sides, or one host extent whose device pages are runs of 4 (or, with a page short,
    a run of 3)."""
    rng = np.random.default_rng(len(pattern))
    if pattern == "scattered":
        return (rng.choice(host_pages, n, replace=False).astype(np.int64),
                rng.choice(device_pages, n, replace=False).astype(np.int64))
    dev = (rng.choice(device_pages // 4, -(-n // 4), replace=False)[:, None] * 4
           + np.arange(4)).reshape(-1)[:n]
    if pattern == "extent":
        return np.arange(3, 3 + n, dtype=np.int64), dev.astype(np.int64)
    host = (rng.choice(host_pages // 4, -(-n // 4), replace=False)[:, None] * 4
            + np.arange(4)).reshape(-1)[:n]
    return host.astype(np.int64), dev.astype(np.int64)


# runs of 4 on average go through a fused view's run copies, not layer by layer
@pytest.mark.parametrize(("pattern", "device_layout"), [
    ("scattered", "separate"), ("scattered", "fused-per-layer"), ("runs", "separate"),
    ("extent", "separate")])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_layers_shared_out_by_a_crew_are_byte_exact(pattern, device_layout, layout, direction):
    """Pages copied layer by layer (separate device tensors, or a fused view whose per-layer
    path was measured faster), scattered, in runs or from one host extent: a crew of 2 to 4
    threads shares the layers out and moves exactly what one thread moves, and only the
    layers asked for."""
    geometry = dsa_indexer(num_layers=7, host_layout=layout)
    host_pages, device_pages_total, n = 24, 20, 12
    arena_start, device_start = _start_bytes(geometry, host_pages, device_pages_total, 5)
    host, dev = _pairs(pattern, host_pages, device_pages_total, n)
    plan = PagePlan.build(host, dev)
    # runs of 4 on average take block copies per run, single pages the gather-scatter
    assert (plan.num_pages >= LONG_RUN_PAGES * len(plan.runs)) == (pattern != "scattered")
    for threads in range(2, MAX_CREW_THREADS + 1):
        crew = CopyCrew(threads - 1, f"test-crew-{threads}")
        try:
            results = []
            for use_crew in (False, True):
                arena = _fresh_arena(geometry, host_pages, arena_start)
                device = device_start.clone()
                layers = ([device[i].clone() for i in range(geometry.num_layers)]
                          if device_layout == "separate" else list(device))
                binding = bind_pool(geometry, arena, layers)
                if binding.device_fused is not None:
                    binding = dataclasses.replace(binding, fused_for_short_runs=False)
                assert plan.crew_splits_layers(binding, crew.size, direction is Direction.D2H)
                copy_layers_cpu(binding, plan, direction, 1, 6, Staging(),
                                crew if use_crew else None)
                results.append((arena.clone(), torch.stack([x.clone() for x in layers])))
            (arena_a, device_a), (arena_b, device_b) = results
            assert torch.equal(arena_a, arena_b) and torch.equal(device_a, device_b)
            h, d = binding.host, torch.stack(list(binding.device_layers))
            assert torch.equal(h[1:6, host], d[1:6][:, dev])  # layers 1..5 moved
            assert not torch.equal(h[0, host], d[0, dev])  # layer 0 did not
            assert not torch.equal(h[6, host], d[6, dev])  # nor layer 6
        finally:
            crew.close()


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
async def test_the_cpu_engine_runs_a_crew_per_direction_and_stops_them(fused):
    geometry = dsa_indexer(num_layers=3)
    pool = HostPool.create([geometry], 8)
    whole = torch.zeros(3, 8, geometry.bytes_per_page_per_layer, dtype=torch.uint8)
    layers = [whole[i] if fused else whole[i].clone() for i in range(3)]
    binding = bind_pool(geometry, pool.arenas[geometry.name], layers)
    before = {t.name for t in threading.enumerate()}
    engine = CpuEngine({geometry.name: binding}, LoopHandoff(asyncio.get_running_loop()),
                       lambda handle: None)
    crew = {t.name for t in threading.enumerate()} - before
    crew = {name for name in crew if "-crew-" in name}
    expected = crew_threads(torch.get_num_threads()) - 1
    assert len(crew) == 2 * expected  # fused run copies and scattered layers share them
    await asyncio.to_thread(engine.close)
    assert not crew & {t.name for t in threading.enumerate()}


class _StartFails(threading.Thread):
    """A thread class whose n-th ``start()`` (counted over all instances) fails, as when the
    process is out of threads."""

    starts = 0
    fail_at = 0

    def start(self) -> None:
        type(self).starts += 1
        if type(self).starts == type(self).fail_at:
            raise RuntimeError("can't start new thread")
        super().start()


def _threading_failing_at(n: int):
    failing = type("StartFails", (_StartFails,), {"starts": 0, "fail_at": n})
    return types.SimpleNamespace(Thread=failing, Event=threading.Event, Lock=threading.Lock)


def _alive(prefix: str) -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(prefix)}


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_crew_that_cannot_start_a_helper_stops_the_ones_it_started(monkeypatch, fail_at):
    monkeypatch.setattr(copy_crew, "threading", _threading_failing_at(fail_at))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        CopyCrew(3, "test-crew-start")
    assert not _alive("test-crew-start")


@pytest.mark.parametrize("fail_at", range(1, 7))
async def test_an_engine_that_cannot_start_a_thread_leaves_none_behind(monkeypatch, fail_at):
    """Every thread a fused-view CPU engine starts (two crews' helpers, two workers): whichever
    fails to start, the engine refuses to start and stops those that did."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # one helper per crew
    failing = _threading_failing_at(fail_at)
    monkeypatch.setattr(copy_crew, "threading", failing)
    monkeypatch.setattr(cpu, "threading", failing)
    geometry = dsa_indexer(num_layers=3)
    pool = HostPool.create([geometry], 8)
    whole = torch.zeros(3, 8, geometry.bytes_per_page_per_layer, dtype=torch.uint8)
    binding = bind_pool(geometry, pool.arenas[geometry.name], [whole[i] for i in range(3)])
    before = _alive("dsa-async-")
    if fail_at > 4:  # only four threads to start: this one starts them all
        engine = CpuEngine({geometry.name: binding}, LoopHandoff(asyncio.get_running_loop()),
                           lambda handle: None)
        await asyncio.to_thread(engine.close)
    else:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            CpuEngine({geometry.name: binding}, LoopHandoff(asyncio.get_running_loop()),
                      lambda handle: None)
    assert _alive("dsa-async-") == before


# --- streamed items (a load's layers, readiness as each prefix is in) -------------------------


class _Recorder:
    """Records which thread ran each item, what had finished at each ``reached``, and how many
    items are running at any moment."""

    def __init__(self, count: int, work=None) -> None:
        self.lock = threading.Lock()
        self.owner: dict[int, int] = {}
        self.finished: set[int] = set()
        self.reached: list[int] = []
        self.running = 0
        self.work = work
        self.count = count

    def item(self, i: int) -> None:
        with self.lock:
            assert i not in self.owner, f"item {i} ran twice"
            self.owner[i] = threading.get_ident()
            self.running += 1
        try:
            if self.work is not None:
                self.work(i)
        finally:
            with self.lock:
                self.running -= 1
        with self.lock:
            self.finished.add(i)

    def reach(self, n: int) -> None:
        with self.lock:
            assert set(range(n)) <= self.finished, (n, sorted(self.finished))
        assert threading.get_ident() == self.caller
        self.reached.append(n)

    def stream(self, crew: CopyCrew) -> None:
        self.caller = threading.get_ident()
        crew.stream(self.item, self.count, self.reach)


@pytest.mark.parametrize("threads", range(1, MAX_CREW_THREADS + 1))
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 61])
def test_a_stream_runs_every_item_once_and_reaches_each_prefix_in_order(threads, count):
    crew = CopyCrew(threads - 1, f"test-stream-{threads}")
    try:
        for _ in range(3):  # a crew streams again and again
            rec = _Recorder(count)
            rec.stream(crew)
            assert sorted(rec.owner) == list(range(count))
            assert rec.running == 0
            assert rec.reached == sorted(set(rec.reached))  # strictly increasing
            assert rec.reached[-1:] == ([count] if count else [])
            size = min(threads, count)
            for i, ident in rec.owner.items():  # item i on thread i % size
                assert (ident == rec.caller) == (i % size == 0), (i, size)
            assert len(set(rec.owner.values())) == size
    finally:
        crew.close()


def test_a_stream_does_not_hold_a_thread_back_for_one_that_lags(crew3):
    """Item 1 (a helper's) waits until the calling thread has done items 3 and 6: in lockstep
    the calling thread would wait for item 1 first, and neither would go on."""
    caller_went_on = threading.Event()

    def work(i: int) -> None:
        if i == 1:
            assert caller_went_on.wait(30), "the calling thread waited for item 1"
        elif i == 6:
            caller_went_on.set()

    rec = _Recorder(9, work)
    rec.stream(crew3)
    assert sorted(rec.owner) == list(range(9))
    assert rec.reached[0] == 1 and rec.reached[-1] == 9  # nothing past item 1 before it ended
    assert rec.reached == sorted(set(rec.reached))


@pytest.mark.parametrize("threads", [2, 3, MAX_CREW_THREADS])
@pytest.mark.parametrize("failing", [0, 1, 2, 5, 11])
def test_a_failed_item_stops_later_items_and_every_earlier_one_is_reached(threads, failing):
    """Like a serial loop: the items before the failed one all run and are reached, none after
    it starts once it failed, and its error comes back after every thread stopped."""
    crew = CopyCrew(threads - 1, f"test-stream-fail-{threads}")
    failed = threading.Event()

    def work(i: int) -> None:
        if i == failing:
            failed.set()
            raise ValueError(f"item {i} failed")
        if i < failing and i % threads != failing % threads:
            # earlier items of the other threads end after the failure, so they run while
            # the others stop (those of the failing thread come before it)
            assert failed.wait(30)

    try:
        rec = _Recorder(12, work)
        with pytest.raises(ValueError, match=f"item {failing} failed"):
            rec.stream(crew)
        assert rec.running == 0  # nothing still runs once stream raised
        assert set(range(failing)) <= rec.finished
        assert (rec.reached[-1:] or [0]) == [failing]
        again = _Recorder(12)  # still usable
        again.stream(crew)
        assert again.reached[-1] == 12
    finally:
        crew.close()


def test_of_two_failed_items_the_lower_one_is_raised(crew3):
    """Items 1 and 2 fail on different helpers; item 2 fails first: item 1's error is the one
    a serial loop would have raised."""
    second_failed = threading.Event()

    def work(i: int) -> None:
        if i == 2:
            second_failed.set()
            raise ValueError("item 2 failed")
        if i == 1:
            second_failed.wait(30)
            raise ValueError("item 1 failed")

    rec = _Recorder(9, work)
    with pytest.raises(ValueError, match="item 1 failed"):
        rec.stream(crew3)
    assert rec.reached == [1] and rec.running == 0


def test_an_error_from_reached_stops_every_thread(crew3):
    calls = []

    def reached(n: int) -> None:
        calls.append(n)
        raise RuntimeError(f"reached {n} failed")

    done = []
    with pytest.raises(RuntimeError, match="reached 1 failed"):
        crew3.stream(done.append, 300, reached)
    assert calls == [1]
    ran = len(done)
    crew3.map(lambda share: None, list(range(3)))  # the helpers are back, idle
    assert len(done) == ran < 300


@pytest.mark.parametrize("strided", [None, "host", "device"])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_a_layers_run_copy_moves_each_run_and_nothing_else(strided, direction):
    """Runs of one layer by ``memmove`` (rows back to back on both sides) or by numpy views
    (host rows strided, as in a page-first arena, or device rows that are the front of wider
    rows): each run's rows land, all other rows keep their bytes, on both sides."""
    gen = torch.Generator().manual_seed(7)
    width = 66  # int64 words per row
    # strided host: every other row of a [60, width] block, as one layer of a page-first arena
    host = torch.randint(-2**40, 2**40, (60, width), generator=gen)
    host = host[::2] if strided == "host" else host[:30]
    dev_rows = torch.randint(-2**40, 2**40, (40, width + 6), generator=gen)
    dev = dev_rows[:, :width] if strided == "device" else dev_rows[:, :width].contiguous()
    beyond = dev_rows[:, width:].clone()  # bytes past a strided device row: never written
    assert layer_calls._packed(host) == (strided != "host")
    assert layer_calls._packed(dev) == (strided != "device")
    runs = np.array([[0, 30, 4], [10, 3, 7], [25, 17, 5]], dtype=np.int64)
    blocks = layer_calls.RunBlocks(runs, width * 8)
    to_host = direction is Direction.D2H
    expected_host, expected_dev = host.clone(), dev.clone()
    for h, d, k in runs.tolist():
        if to_host:
            expected_host[h:h + k] = dev[d:d + k]
        else:
            expected_dev[d:d + k] = host[h:h + k]
    layer_calls.run_copy(host, dev, runs, blocks, to_host)()
    assert torch.equal(host, expected_host) and torch.equal(dev, expected_dev)
    assert torch.equal(dev_rows[:, width:], beyond)
