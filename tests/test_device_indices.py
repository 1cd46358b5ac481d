"""Device index tensors read by the engine after the request's producers (device_indices.py).

The CPU backend refuses index tensors that are not on the CPU (a ``meta`` tensor stands in for
one on a GPU). The deferred path itself (shape checks at submit, values read on the engine's
thread after the producers, bad values failing that transfer alone, ordering against requests
whose device pages are known) runs here through the real CPU engine with one policy changed:
``LateIndexEngine`` defers every index *tensor* the way the CUDA engine defers CUDA tensors,
reading the values only when its worker resolves the batch. Ranges, numpy arrays and ``Pages``
of lists are still read at submit, so both kinds meet in one service.
"""

from __future__ import annotations

import asyncio
import re
import threading

import numpy as np
import pytest
import torch
from service_fixtures import PAGE, LateIndexEngine, make_buffers, page_bytes, tokens

from dsa_async import Pages
from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import (
    IndexTypeError,
    IndexValueError,
    TransferFailedError,
    UnknownHostPagesError,
)
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer, mla_kv
from dsa_async.transfer.cpu import CpuEngine

BOUND_S = 10
LAYERS = 2
DEVICE_PAGES = 16


def _service(tmp_path, engine=LateIndexEngine, host_pages: int = 32):
    geometries = (dsa_indexer(num_layers=LAYERS), mla_kv(num_layers=LAYERS))
    buffers = {g.name: make_buffers(g, DEVICE_PAGES, seed=i) for i, g in enumerate(geometries)}
    config = ServiceConfig(geometries=geometries, host_pool=PoolSize(pages=host_pages),
                           backend="cpu", ledger_directory=str(tmp_path / "ledger"))
    return OffloadService(config, buffers, engine_factory=engine), buffers


def _fill(buffers, page: int, value: int) -> None:
    for layers in buffers.values():
        for layer in layers:
            layer[page].fill_(value)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for name in a for x, y in zip(a[name], b[name], strict=True))


def _backed_up_as(service, result, expected: dict) -> bool:
    """Whether the host pages of an eviction's result hold ``expected`` (per pool, per layer)."""
    host = torch.as_tensor(result.host_pages.pages)
    return all(torch.equal(arena[layer][host], expected[name][layer])
               for name, arena in service.host_pool.arenas.items() for layer in range(LAYERS))


async def _staged_page(service, buffers, value: int):
    """One host page holding device page 0 filled with ``value``, and those bytes (what a load
    from it brings)."""
    staged = service.allocate_host_pages(1)
    _fill(buffers, 0, value)
    await service.evict(range(0, PAGE), host_tokens=staged.token_indices())
    return staged, page_bytes(buffers, [0])


def _cause_chain(error):
    while error is not None:
        yield error
        error = error.__cause__


# --- the CPU backend refuses index tensors off the CPU ---------------------------------------


@pytest.mark.parametrize("form", ["tokens", "pages"])
@pytest.mark.parametrize("call", ["evict", "prefetch", "evict_threadsafe", "prefetch_threadsafe"])
async def test_the_cpu_backend_refuses_index_tensors_off_the_cpu(tmp_path, form, call):
    service, _ = _service(tmp_path, engine=CpuEngine)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        before = service.statistics()
        meta = torch.arange(PAGE, device="meta")
        value = Pages(torch.zeros(1, dtype=torch.int64, device="meta")) if form == "pages" else meta
        method = getattr(service, call)
        args = (value,) if call.startswith("evict") else (held, value)
        with pytest.raises(TypeError, match="on device meta.*cpu backend reads index tensors on the "
                                            "CPU") as caught:
            await asyncio.to_thread(method, *args) if call.endswith("threadsafe") else method(*args)
        assert isinstance(caught.value, IndexTypeError)
        # the advice names a tensor of what was passed (one that has a .cpu())
        advice = re.search(r"pass (device_tokens[\w.]*)\.cpu\(\)", str(caught.value))
        assert advice is not None, str(caught.value)
        named = eval(advice.group(1), {"device_tokens": value})  # noqa: S307 - our own text
        assert isinstance(named, torch.Tensor), advice.group(1)
        assert service.statistics() == before


# --- deferred indices: bytes, reading after the producers ------------------------------------


@pytest.mark.parametrize("form", ["tokens", "pages", "tokens-int32"])
async def test_device_indices_read_by_the_engine_round_trip_byte_exact(tmp_path, form):
    service, buffers = _service(tmp_path)
    source, target = [9, 2, 14, 5], [0, 11, 3, 7]

    def given(pages):
        if form == "pages":
            return Pages(torch.tensor(pages))
        t = tokens(pages)
        return t.to(torch.int32) if form == "tokens-int32" else t

    async with service, asyncio.timeout(BOUND_S):
        expected = page_bytes(buffers, source)
        backup = await service.evict(given(source))
        assert backup.pages == 4 and backup.padded_tokens == 0
        await service.prefetch(backup.host_pages, given(target))
        assert _same(page_bytes(buffers, target), expected)
        service.release(backup.host_pages)


async def test_device_indices_are_read_after_the_requests_producers(tmp_path):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        indices = torch.full((2 * PAGE,), -1, dtype=torch.int64)  # not valid yet
        written = threading.Event()
        transfer = service.evict(indices, after=written)  # shape checked, values not read
        indices.copy_(tokens([6, 1]))  # the producer's work, before it signals
        expected = page_bytes(buffers, [6, 1])
        written.set()
        result = await transfer
        assert _backed_up_as(service, result, expected)
        service.release(result.host_pages)


async def test_device_indices_from_a_thread_without_a_loop(tmp_path):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        expected = page_bytes(buffers, [4, 8])

        def run():
            backup = service.evict_threadsafe(tokens([4, 8])).wait(BOUND_S)
            service.prefetch_threadsafe(backup.host_pages, Pages(torch.tensor([12, 13]))
                                        ).wait(BOUND_S)
            service.release_threadsafe(backup.host_pages)

        await asyncio.to_thread(run)
        assert _same(page_bytes(buffers, [12, 13]), expected)


# --- bad values fail that transfer alone; shape errors raise at submit ------------------------


BAD_VALUES = {
    "shifted tokens": lambda: tokens([3]) + 1,
    "page out of range": lambda: tokens([DEVICE_PAGES]),
    "negative token": lambda: tokens([0]) - PAGE,
    "page twice": lambda: tokens([3, 3]),
    "pages out of range": lambda: Pages(torch.tensor([1, DEVICE_PAGES])),
    "pages negative": lambda: Pages(torch.tensor([-1])),
    "pages twice": lambda: Pages(torch.tensor([2, 2])),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
async def test_bad_device_index_values_fail_that_transfer_alone(tmp_path, case):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        before = service.statistics()
        expected = page_bytes(buffers, [10])
        gate = threading.Event()  # the bad request and a good one share a tick
        bad = service.evict(BAD_VALUES[case](), after=gate)  # no error at submit
        good = service.evict(range(10 * PAGE, 11 * PAGE))
        gate.set()
        with pytest.raises(TransferFailedError) as caught:
            await bad
        assert any(isinstance(e, IndexValueError) for e in _cause_chain(caught.value))
        result = await good
        host = torch.as_tensor(result.host_pages.pages)
        for name, arena in service.host_pool.arenas.items():
            assert torch.equal(arena[0][host], expected[name][0])
        service.release(result.host_pages)
        assert service.statistics() == before  # the failed backup's host pages came back


@pytest.mark.parametrize("value, error, match", [
    (lambda: tokens([3])[: PAGE - 1].contiguous(), IndexValueError, "not a whole number"),
    (lambda: tokens([3]).view(2, PAGE // 2), IndexValueError, "1-D"),
    (lambda: tokens([3]).to(torch.float32), IndexTypeError, "dtype"),
    (lambda: Pages(torch.tensor([[1]])), IndexValueError, "1-D"),
])
async def test_what_the_shape_of_device_indices_tells_is_checked_at_submit(tmp_path, value, error,
                                                                          match):
    service, _ = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(1)
        before = service.statistics()
        with pytest.raises(error, match=match):
            service.evict(value())
        with pytest.raises(error, match=match):
            service.prefetch(held, value())
        assert service.statistics() == before


async def test_device_indices_pair_with_whole_host_pages_of_the_same_count(tmp_path):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        before = service.statistics()
        with pytest.raises(IndexValueError, match="2 distinct whole pages"):
            service.evict(tokens([1, 2]), host_tokens=held.token_indices()[:PAGE])
        with pytest.raises(IndexValueError, match="holds 2"):
            service.prefetch(held, tokens([1, 2, 3]))
        with pytest.raises(IndexValueError, match="both sides as Pages"):
            service.evict(Pages(torch.tensor([1, 2])), host_tokens=held.token_indices())
        assert service.statistics() == before
        expected = page_bytes(buffers, [1, 2])
        await service.evict(tokens([1, 2]), host_tokens=held.token_indices())
        await service.prefetch(None, Pages(torch.tensor([5, 6])),
                               host_tokens=Pages(np.asarray(held.pages)))
        assert _same(page_bytes(buffers, [5, 6]), expected)


# --- ordering: unknown device pages stand for every device page while pending ----------------


async def test_a_load_into_a_page_waits_for_an_earlier_backup_of_unknown_pages(tmp_path):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        original = page_bytes(buffers, [5])
        staged, _ = await _staged_page(service, buffers, 77)
        gate = threading.Event()
        backup = service.evict(tokens([5]), after=gate)  # reads page 5 once the gate opens
        load = service.prefetch(staged, range(5 * PAGE, 6 * PAGE))  # overwrites page 5
        gate.set()
        result = await backup
        await load
        assert _backed_up_as(service, result, original)


async def test_a_backup_of_a_page_waits_for_an_earlier_load_into_unknown_pages(tmp_path):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        staged, loaded = await _staged_page(service, buffers, 91)
        gate = threading.Event()
        load = service.prefetch(staged, tokens([9]), after=gate)
        backup = service.evict(range(9 * PAGE, 10 * PAGE))  # must see the loaded bytes
        gate.set()
        await load
        result = await backup
        assert _backed_up_as(service, result, loaded)


async def test_a_backup_of_unknown_pages_waits_for_an_earlier_load_into_a_page(tmp_path):
    service, buffers = _service(tmp_path)
    async with service, asyncio.timeout(BOUND_S):
        staged, loaded = await _staged_page(service, buffers, 33)
        gate = threading.Event()
        load = service.prefetch(staged, range(4 * PAGE, 5 * PAGE), after=gate)
        backup = service.evict(tokens([4]))  # unknown pages: follows every pending load
        gate.set()
        await load
        result = await backup
        assert _backed_up_as(service, result, loaded)
        assert service.statistics().in_flight_pages == 0


class _CountingStages(LateIndexEngine):
    staged = 0

    def stage_indices(self, tensor, producers):
        type(self).staged += 1
        return super().stage_indices(tensor, producers)


async def test_a_loop_request_refused_after_taking_threads_handoffs_stages_nothing(tmp_path):
    """A loop prefetch naming a hand-off not taken yet in after= takes the hand-offs first;
    when one of them was the release of the host pages it names, it is refused before its
    device indices are staged for a copy (a refusal changes nothing, and wastes nothing)."""
    service, _ = _service(tmp_path, engine=_CountingStages)
    async with service:
        held, other = service.allocate_host_pages(1), service.allocate_host_pages(1)
        async with asyncio.timeout(BOUND_S):
            # Hand-offs as a thread makes them; made here, on the loop, they are surely not
            # taken yet when the prefetch below comes.
            backup = service.evict_threadsafe(tokens([2]), host_tokens=other.token_indices())
            service.release_threadsafe(held)
            before = _CountingStages.staged
            with pytest.raises(UnknownHostPagesError, match="host pages"):
                service.prefetch(None, torch.arange(3 * PAGE, 4 * PAGE),
                                 host_tokens=held.token_indices(), after=backup)
            assert _CountingStages.staged == before
            await backup


# --- what the values wait for: indices_after= -----------------------------------------------


class _RecordingStages(LateIndexEngine):
    """Records the producers each device index tensor is staged after."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.staged_after: list[tuple] = []

    def stage_indices(self, tensor, producers):
        self.staged_after.append(tuple(producers))
        return super().stage_indices(tensor, producers)


async def test_index_values_wait_for_the_copys_producers_unless_indices_after_names_fewer(
        tmp_path):
    service, buffers = _service(tmp_path, engine=_RecordingStages)
    async with service, asyncio.timeout(BOUND_S):
        staged, loaded = await _staged_page(service, buffers, 41)
        engine = service._engine
        fence, made = threading.Event(), threading.Event()  # a fence on the pages; the indices'
        made.set()
        cases = [(None, (fence, made)), ([made], (made,)), ((), ())]
        for indices_after, staged_after in cases:
            load = service.prefetch(staged, torch.arange(5 * PAGE, 6 * PAGE),
                                    after=[fence, made], indices_after=indices_after)
            assert engine.staged_after[-1] == staged_after
            await asyncio.sleep(0)
            assert not load.done()  # the copy itself still waits for every producer in after=
            fence.set()
            await load
            assert _same({n: [t[5:6] for t in b] for n, b in buffers.items()}, loaded)
            fence.clear()
        backup = service.evict(tokens([5]), after=fence, indices_after=())  # backups alike
        assert engine.staged_after[-1] == ()
        fence.set()
        assert _backed_up_as(service, await backup, loaded)


def test_index_values_wait_as_named_from_a_thread_without_a_loop(tmp_path):
    from dsa_async.integrations.loop_thread import ServiceThread

    geometry = dsa_indexer(num_layers=LAYERS)
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    st = ServiceThread.start(config, make_buffers(geometry, DEVICE_PAGES, seed=3),
                             engine_factory=_RecordingStages, stop_at_exit=False)
    try:
        service = st.service
        handle = service.call_threadsafe(service.allocate_host_pages, 1).result(BOUND_S)
        fence = threading.Event()
        load = service.prefetch_threadsafe(handle, torch.arange(2 * PAGE, 3 * PAGE),
                                           after=fence, indices_after=())
        assert service._engine.staged_after[-1] == ()  # staged on this thread, at submit
        assert not load.done()
        fence.set()
        load.wait(timeout_s=BOUND_S)
    finally:
        st.stop(BOUND_S)


@pytest.mark.parametrize("indices_after", ["not a producer", [[threading.Event()]],
                                           asyncio.Event(), "transfer"],
                         ids=["str", "nested", "asyncio.Event", "Transfer"])
async def test_indices_after_names_device_work_only_and_a_refusal_changes_nothing(
        tmp_path, indices_after):
    service, buffers = _service(tmp_path, engine=_RecordingStages)
    async with service, asyncio.timeout(BOUND_S):
        staged, _ = await _staged_page(service, buffers, 7)
        if indices_after == "transfer":
            indices_after = service.evict(tokens([3]))
            await indices_after
        before = service.statistics()
        stages = len(service._engine.staged_after)
        with pytest.raises(TypeError, match=r"indices_after=.*only its producers"):
            service.prefetch(staged, torch.arange(5 * PAGE, 6 * PAGE),
                             indices_after=indices_after)
        assert service.statistics() == before
        assert len(service._engine.staged_after) == stages


async def test_indices_after_is_ignored_for_indices_read_at_submit(tmp_path):
    service, buffers = _service(tmp_path, engine=CpuEngine)  # reads every tensor at submit
    async with service, asyncio.timeout(BOUND_S):
        staged, loaded = await _staged_page(service, buffers, 9)
        for device_tokens in (torch.arange(4 * PAGE, 5 * PAGE), range(4 * PAGE, 5 * PAGE)):
            await service.prefetch(staged, device_tokens, indices_after=())
            assert _same({n: [t[4:5] for t in b] for n, b in buffers.items()}, loaded)
