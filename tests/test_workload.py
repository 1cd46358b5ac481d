"""The serve workload's parts: device page table and LRU, page checksums, trace parsing, the
seeded arrival model, host-copy reclaim, and the engine end to end on a small CPU service."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.host_memory.pool import HostPages
from dsa_async.workload.conversations import (
    MAX_TURN_TOKENS,
    Conversation,
    MultiTurnModel,
    TraceError,
    Turn,
    WorkloadSpec,
    parse_trace,
    parse_trace_lines,
)
from dsa_async.workload.consumer import ForwardPass, Step
from dsa_async.workload.device_cache import DeviceCache
from dsa_async.workload.engine import EngineSettings, ServingEngine
from dsa_async.workload.host_cache import HostCache
from dsa_async.workload.pagedata import PagePatterns
from dsa_async.workload.runner import allocate_device_buffers, pool_geometries
from dsa_async.workload.segments import Segment, SegmentState, pages_spanned
from dsa_async.workload.tiers import PageTiers

BOUND_S = 20  # generous: only proves nothing hangs


# --- device page table and LRU ------------------------------------------------------------


def test_device_pages_are_handed_out_lowest_first_and_come_back():
    cache = DeviceCache(8)
    first = cache.allocate(3)
    second = cache.allocate(2)
    assert first.tolist() == [0, 1, 2] and second.tolist() == [3, 4]
    cache.free(first)
    assert cache.free_pages == 6 and cache.used_pages == 2
    assert cache.allocate(4).tolist() == [0, 1, 2, 5]


def test_device_page_table_refuses_double_free_and_overdraw():
    cache = DeviceCache(4)
    pages = cache.allocate(2)
    cache.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        cache.free(pages)
    with pytest.raises(RuntimeError, match="5 pages asked, 4 free"):
        cache.allocate(5)


def test_lru_yields_least_recently_used_first_and_forgets_discarded():
    cache = DeviceCache(4)
    a, b, c = (Segment(k, 0, 64, 64) for k in "abc")
    for s in (a, b, c):
        cache.touch(s)
    cache.touch(a)  # used again: now the most recent
    cache.discard(b)  # pinned: not evictable
    assert list(cache.evictable()) == [c, a]
    assert b not in cache and a in cache


# --- segments -----------------------------------------------------------------------------


def test_segment_token_range_maps_onto_its_device_pages_with_both_ends_inside_pages():
    seg = Segment("conversation", first_token=100, end_token=200, page_size=64)
    assert seg.first_page == 1 and seg.num_pages == pages_spanned(100, 200, 64) == 3
    tokens = seg.device_tokens(np.array([7, 3, 9]))
    assert tokens.size == 100
    assert tokens[0] == 7 * 64 + 100 % 64  # starts mid-page: padding in front
    assert tokens[-1] == 9 * 64 + 199 % 64  # ends mid-page: padding behind
    assert pages_spanned(64, 64, 64) == 0 and pages_spanned(0, 65, 64) == 2


# --- page contents and checksums ----------------------------------------------------------


def _patterns(layers=3, pages=10, seed=1):
    buffers = allocate_device_buffers(pool_geometries(layers), pages, torch.device("cpu"))
    return buffers, PagePatterns(buffers, seed=seed)


def test_checksum_of_written_pages_matches_what_the_device_holds():
    _, patterns = _patterns()
    pages = np.array([1, 4, 5])
    written = patterns.write_pages(pages, np.array([7, 8, 9], dtype=np.uint64))
    assert np.array_equal(written, patterns.checksums(pages))
    assert len(set(written.tolist())) == 3


def test_one_flipped_byte_changes_only_that_pages_checksum():
    buffers, patterns = _patterns()
    pages = np.array([2, 6])
    before = patterns.write_pages(pages, np.array([11, 12], dtype=np.uint64))
    buffers["kv"][1, 6, 1234] ^= 1
    after = patterns.checksums(pages)
    assert after[0] == before[0] and after[1] != before[1]


def test_swapped_layers_or_pages_change_the_checksum():
    buffers, patterns = _patterns()
    pages = np.array([0, 1])
    before = patterns.write_pages(pages, np.array([5, 6], dtype=np.uint64))
    assert np.array_equal(patterns.checksums(np.array([1, 0])), before[::-1])
    layer0 = buffers["indexer"][0, 0].clone()
    buffers["indexer"][0, 0] = buffers["indexer"][1, 0]
    buffers["indexer"][1, 0] = layer0
    assert patterns.checksums(pages)[0] != before[0]


def test_same_seed_writes_the_same_bytes():
    a_buffers, a = _patterns(seed=3)
    b_buffers, b = _patterns(seed=3)
    seeds = np.array([42], dtype=np.uint64)
    assert np.array_equal(a.write_pages(np.array([2]), seeds), b.write_pages(np.array([2]), seeds))
    assert torch.equal(a_buffers["kv"], b_buffers["kv"])


# --- traces -------------------------------------------------------------------------------


def _line(**fields):
    record = {"arrival_s": 0.5, "conversation": "c1", "prompt_tokens": 10, "output_tokens": 5}
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def test_trace_groups_turns_by_conversation_in_arrival_order():
    lines = ["# recorded", "", _line(arrival_s=1.0, conversation=7, prompt_tokens=30),
             _line(arrival_s=0.2, conversation="b"), _line(arrival_s=0.5, conversation=7)]
    conversations = parse_trace_lines(lines)
    assert [c.conversation_id for c in conversations] == ["b", "7"]
    seven = conversations[1]
    assert seven.start_s == 0.5
    assert [(t.arrival_s, t.prompt_tokens) for t in seven.turns] == [(0.5, 10), (1.0, 30)]


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_line(output_tokens=...), "missing ['output_tokens']"),
    (_line(extra=1), "unknown ['extra']"),
    (_line(prompt_tokens="10"), "prompt_tokens must be int"),
    (_line(prompt_tokens=True), "prompt_tokens must be int"),
    (_line(prompt_tokens=0), "prompt_tokens must be >= 1"),
    (_line(output_tokens=-1), "output_tokens must be >= 0"),
    (_line(arrival_s=-0.1), "arrival_s must be a finite number >= 0"),
    (_line(conversation=[1]), "conversation must be str or int"),
])
def test_a_bad_trace_line_is_refused_with_its_line_number(tmp_path, bad, message):
    path = tmp_path / "t.jsonl"
    path.write_text(f"# header\n{_line()}\n\n{bad}\n{_line()}\n")
    with pytest.raises(TraceError) as info:
        parse_trace(path)
    assert f"{path} line 4: " in str(info.value) and message in str(info.value)


# Number literals JSON parses (Python's json takes NaN and Infinity too) that no field can use:
# beyond a float, beyond int()'s 4,300 digits, not finite, fractional, negative.
UNUSABLE_NUMBERS = ["1e400", "-1e400", "1" + "0" * 400, "-" + "9" * 400, "7" * 5000, "NaN",
                    "Infinity", "-Infinity", "-1", "-0.5"]
UNUSABLE_COUNTS = UNUSABLE_NUMBERS + ["2.5", "5.0", str(MAX_TURN_TOKENS + 1), str(2**64)]
UNUSABLE_FIELDS = ([("arrival_s", v) for v in UNUSABLE_NUMBERS]
                   + [(f, v) for f in ("prompt_tokens", "output_tokens") for v in UNUSABLE_COUNTS]
                   + [("conversation", v) for v in ("1e400", "NaN", "-Infinity", "2.5")])


@pytest.mark.parametrize(("field", "literal"), UNUSABLE_FIELDS,
                         ids=[f"{f}={v[:12]}({len(v)})" for f, v in UNUSABLE_FIELDS])
def test_a_trace_number_no_field_can_use_is_a_trace_error_naming_line_field_and_value(
        tmp_path, field, literal):
    """Never an OverflowError or ValueError (int() digit limit, float(huge int)), never a
    value taken as given that the run cannot use."""
    bad = _line(**{field: "@"}).replace('"@"', literal)
    path = tmp_path / "t.jsonl"
    path.write_text(f"# header\n{_line()}\n\n{bad}\n{_line()}\n")
    with pytest.raises(TraceError) as info:
        parse_trace(path)
    message = str(info.value)
    assert f"{path} line 4: {field} must be" in message and literal[:20] in message, message
    assert len(message) < 300  # a 5,000-digit value is shortened


def test_trace_edges_that_are_fine_stay_fine():
    lines = [_line(arrival_s=0, prompt_tokens=MAX_TURN_TOKENS, output_tokens=0),
             _line(arrival_s=1e300, conversation="x"),
             _line(conversation="@").replace('"@"', "1" + "0" * 400)]
    first, second, third = parse_trace_lines(lines)
    assert first.turns[0].prompt_tokens == MAX_TURN_TOKENS
    assert third.start_s == 1e300 and second.conversation_id == "1" + "0" * 400


def test_a_trace_line_nested_too_deeply_is_a_trace_error():
    with pytest.raises(TraceError, match="line 1: not a trace line"):
        parse_trace_lines(["[" * 100_000 + "]" * 100_000])


def test_missing_or_empty_trace_is_refused(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        parse_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("# nothing\n\n")
    with pytest.raises(TraceError, match="no turns"):
        parse_trace(tmp_path / "empty.jsonl")


def test_workload_spec_spellings():
    assert WorkloadSpec.parse("multiturn").trace_path is None
    assert str(WorkloadSpec.parse("trace:/x/y.jsonl").trace_path) == "/x/y.jsonl"
    for bad in ("trace:", "multi", ""):
        with pytest.raises(ValueError, match="not known"):
            WorkloadSpec.parse(bad)


# --- the forward pass -----------------------------------------------------------------------


@pytest.mark.parametrize(("compute_dim", "seed"), [(10**400, 0), (2**64, 0), (8, 2**64)],
                         ids=["dim-beyond-a-float", "dim-beyond-int64", "seed-beyond-64-bits"])
def test_a_forward_pass_that_cannot_set_up_reports_it_with_every_step(compute_dim, seed):
    """Whatever its setup raises (here before any allocation: the scale of a dimension beyond
    a float, a seed torch refuses), the thread lives on and fails each step, so the run can
    stop; a thread that died there left the run waiting for ever."""
    buffers = allocate_device_buffers(pool_geometries(2), 8, torch.device("cpu"))
    results: queue.SimpleQueue = queue.SimpleQueue()
    forward = ForwardPass(PagePatterns(buffers, seed=0), num_layers=2, compute_dim=compute_dim,
                          post=lambda step, result: results.put(result), seed=seed)
    forward.start()
    try:
        for _ in range(2):
            forward.submit(Step((), (), ()))
            error = results.get(timeout=BOUND_S).error
            assert "could not set up its compute" in str(error), error
    finally:
        forward.stop()


# --- the seeded arrival model ------------------------------------------------------------


def _first(model: MultiTurnModel, n: int) -> list[Conversation]:
    return list(itertools.islice(model.conversations(), n))


def test_arrival_model_is_deterministic_for_a_seed():
    a = _first(MultiTurnModel(seed=7, context_tokens=1024), 50)
    b = _first(MultiTurnModel(seed=7, context_tokens=1024), 50)
    c = _first(MultiTurnModel(seed=8, context_tokens=1024), 50)
    assert a == b and a != c


def test_arrival_model_shares_prompts_and_stays_within_bounds():
    conversations = _first(MultiTurnModel(seed=1, context_tokens=1024, system_prompts=3), 200)
    starts = [c.start_s for c in conversations]
    assert starts == sorted(starts) and starts[0] > 0
    prompts = {c.system_prompt for c in conversations}
    assert len(prompts) == 3  # a few prompts, each shared by many conversations
    assert all(64 <= p.tokens <= 1024 // 3 for p in prompts)
    turns = [t for c in conversations for t in c.turns]
    assert all(16 <= t.prompt_tokens <= 1024 // 6 and 16 <= t.output_tokens <= 1024 // 8
               for t in turns)
    assert 2.5 < len(turns) / len(conversations) < 5.5  # mean 4 turns
    assert all(c.turns[0].think_s == 0 for c in conversations)


# --- host copies under pressure ------------------------------------------------------------


def _hosted(key: str, allocation_id: int, pages: int) -> Segment:
    seg = Segment(key, 0, 64 * pages, 64, state=SegmentState.HOSTED)
    seg.host = HostPages(((0, pages),), allocation_id, 64)
    return seg


def test_reclaim_releases_least_recently_used_unheld_copies_until_enough():
    released: list[int] = []
    cache = HostCache(lambda handle: released.append(handle.allocation_id))
    a, b, c = _hosted("a", 1, 2), _hosted("b", 2, 3), _hosted("c", 3, 4)
    for seg in (a, b, c):
        cache.touch(seg)
    cache.hold(a.host)  # a prefetch reads a: never released while it does

    def detach(seg):
        handle, seg.host = seg.host, None
        return handle

    assert cache.reclaim(3, detach) == 3
    assert released == [2] and a.host is not None and c.host is not None
    assert cache.reclaim(100, detach) == 4  # all that is free of holds
    assert released == [2, 3] and cache.segments == 1


def test_dropping_a_held_handle_waits_for_the_last_hold():
    released: list[int] = []
    cache = HostCache(lambda handle: released.append(handle.allocation_id))
    handle = HostPages(((0, 2),), 9, 64)
    cache.hold(handle)
    cache.hold(handle)
    cache.drop(handle)
    cache.unhold(handle)
    assert released == [] and cache.pending_releases == 1
    cache.unhold(handle)
    assert released == [9] and cache.pending_releases == 0


# --- the engine on a real (small, CPU) service --------------------------------------------


class _CorruptingTiers(PageTiers):
    """Flips one byte of the first backup's host copy, as a bad copy path would."""

    corrupted: Segment | None = None

    def _eviction_done(self, segment, transfer, recorded):
        super()._eviction_done(segment, transfer, recorded)
        if self.corrupted is None and segment.host is not None:
            self.corrupted = segment
            arena = self.service.host_pool.arenas["kv"]
            arena[0, int(segment.host.pages[-1]), 5] ^= 0xFF


class _CorruptingEngine(ServingEngine):
    tiers_class = _CorruptingTiers


async def _run_engine(tmp_path, engine_cls=ServingEngine):
    layers, device_pages = 2, 16
    geometries = pool_geometries(layers)
    buffers = allocate_device_buffers(geometries, device_pages, torch.device("cpu"))
    config = ServiceConfig(geometries=geometries, host_pool=PoolSize(pages=32), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"))
    holder: list[ServingEngine] = []
    service = OffloadService(config, buffers,
                             on_host_pressure=lambda n: holder[0].on_host_pressure(n))
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        settings = EngineSettings.for_device(page_size_tokens=64, device_pages=device_pages,
                                             num_layers=layers, compute_dim=8)
        engine = engine_cls(service, PagePatterns(buffers, seed=0), settings)
        holder.append(engine)
        engine.start()
        states = {}
        for key in "ABCDE":  # 3 pages each: E fills the device, A (least recent) is evicted
            states[key] = engine.open_conversation(Conversation(key, 0.0, None, ()))
            await engine.run_turn(states[key], Turn(prompt_tokens=150, output_tokens=40))
        await engine.run_turn(states["A"], Turn(prompt_tokens=10, output_tokens=5))
        for state in states.values():
            engine.close_conversation(state)
        await engine.drain()
        engine.release_everything()
        end = service.statistics()
    return engine, start, end


async def test_engine_evicts_prefetches_and_verifies_every_page_without_leaks(tmp_path):
    engine, start, end = await _run_engine(tmp_path)
    c = engine.counters
    assert c.evicted_pages >= 3 and c.prefetched_pages == 3
    assert c.verified_pages == c.prefetched_pages and c.mismatches == 0 and c.errors == 0
    assert c.turns_finished == 6 and c.conversations_finished == 5
    assert engine.device.used_pages == 0 and engine.host.pending_releases == 0
    assert end == start


async def test_engine_detects_a_corrupted_host_copy(tmp_path):
    engine, start, end = await _run_engine(tmp_path, _CorruptingEngine)
    corrupted = engine.tiers.corrupted
    assert corrupted is not None and corrupted.key == "conversation:A"
    assert engine.counters.verified_pages == 3 and engine.counters.mismatches == 1
    assert end == start


class _PressureBeforeTheCheck(ServingEngine):
    """The service runs short of host pages once a step's loads are done (their host copies are
    no longer read) and before the step's pages are checked."""

    def _on_step_done(self, step, result):
        loading = [t for t in step.waits if self.tiers.loading(t)]  # its done callback pending
        if loading:  # callbacks run in order: the engine's own bookkeeping of the load first
            loading[0].add_done_callback(lambda _t: self._on_step_done(step, result))
            return
        if step.waits:
            self.on_host_pressure(10**6)
        super()._on_step_done(step, result)


async def test_host_copy_released_after_its_load_still_checks_against_the_backup(tmp_path):
    engine, start, end = await _run_engine(tmp_path, _PressureBeforeTheCheck)
    c = engine.counters
    assert engine.host.reclaimed_pages >= 3  # A's copy went before A's pages were checked
    assert c.prefetched_pages == c.verified_pages == 3
    assert c.mismatches == 0 and c.errors == 0
    assert end == start


@pytest.mark.parametrize("field", ["arrival_s", "conversation", "prompt_tokens",
                                   "output_tokens"])
def test_a_field_given_twice_is_refused_not_read_as_its_last_value(tmp_path, field):
    good = _line()
    twice = good[:-1] + f', "{field}": ' + json.dumps(json.loads(good)[field]) + "}"
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n{twice}\n")
    with pytest.raises(TraceError, match=f"line 2: key '{field}' appears twice"):
        parse_trace(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{_line()}\n{_line()}\n".encode() + b'{"conversation": "\xff"}\n')
    with pytest.raises(TraceError, match="line 3: not UTF-8 text"):
        parse_trace(path)


def test_line_numbers_count_newlines_only(tmp_path):
    # a lone carriage return does not start a line (wc -l and editors agree); CRLF ends one
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{_line()}\r\r\n{_line()}\r\n{{bad\n".encode())
    with pytest.raises(TraceError, match="line 3: not valid JSON"):
        parse_trace(path)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_trace_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    path = {"fifo": tmp_path / "pipe", "directory": tmp_path, "device": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes to it: reading it would wait forever
    named = {"fifo": "a FIFO", "directory": "a directory", "device": "a device"}[kind]
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: outcome.append(_raised(parse_trace, path)),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading the trace blocked"
    assert isinstance(outcome[0], TraceError) and f"is {named}" in str(outcome[0]), outcome


def _raised(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None
