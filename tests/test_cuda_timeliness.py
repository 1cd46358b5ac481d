"""The CUDA engine's wait_layer timeliness protocol, without a device.

``CudaEngine.wait_layer`` and the completion thread's ``_recycle`` run here for real, on a
batch handle whose CUDA events are stand-ins with chosen device timestamps; only the engine's
constructor (which needs a device) is skipped. The properties: a layer is late only when the
consumer's stream reached its wait before the layer's copy ended; ``classify`` runs exactly once
for a call that returns and never for one that raises; the other entry points keep their
contracts (``normalize_after`` accepts exactly events and streams).
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

from dsa_async.errors import IndexValueError, TransferFailedError
from dsa_async.kinds import Direction
from dsa_async.transfer import cuda as cuda_module
from dsa_async.transfer.batch import BatchHandle, CopyBatch
from dsa_async.transfer.cuda import _STATE, CudaEngine, _Progress
from dsa_async.transfer.layer_probes import verdict

LAYERS = 4


class FakeEvent:
    """A CUDA event stand-in: ``done_ms`` is its device timestamp, ``None`` while pending."""

    def __init__(self, done_ms: float | None = None) -> None:
        self.done_ms = done_ms
        self.recorded_on = None

    def record(self, stream) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.done_ms is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done_ms is not None and end.done_ms is not None
        return end.done_ms - self.done_ms


class FakeStream:
    def __init__(self) -> None:
        self.waited_on: list[FakeEvent] = []

    def wait_event(self, event) -> None:
        self.waited_on.append(event)


class Pool:
    def __init__(self, events=()) -> None:
        self.free = list(events)
        self.given: list = []

    def take(self):
        return self.free.pop(0)

    def give(self, event) -> None:
        self.given.append(event)


class Lane:
    def __init__(self) -> None:
        self.layer_events, self.timing_events = Pool(), Pool()


@pytest.fixture
def consumer(monkeypatch):
    stream = FakeStream()
    monkeypatch.setattr(cuda_module.torch.cuda, "current_stream", lambda device=None: stream)
    return stream


def engine_with_probes(*probe_times_ms):
    engine = CudaEngine.__new__(CudaEngine)  # no device: skip the constructor
    engine.device = torch.device("cpu")
    engine._probe_events = Pool([FakeEvent(t) for t in probe_times_ms])
    return engine


def handle_of(layers: int = LAYERS) -> BatchHandle:
    batch = CopyBatch(Direction.H2D, np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64))
    handle = BatchHandle(batch, layers)
    setattr(handle, _STATE, _Progress())
    return handle


def issue(handle: BatchHandle, *layer_done_ms: float) -> None:
    """What the issuing thread does: one event per layer, then mark the layers issued."""
    for t in layer_done_ms:
        handle.layer_events.append(FakeEvent(t))
    handle.mark_issued(len(handle.layer_events))


def complete(engine: CudaEngine, handle: BatchHandle, completed: bool = True) -> None:
    """What the completion thread does once every event of the batch completed."""
    progress = getattr(handle, _STATE)
    progress.end = FakeEvent(max(e.done_ms for e in handle.layer_events))
    handle.finish(None, 0.0)
    engine._recycle(Lane(), handle, progress, completed)


def test_a_layer_is_late_only_when_the_consumers_stream_reached_the_wait_first(consumer):
    engine = engine_with_probes(1.0, 9.0, None)  # consumer ready at 1 ms, at 9 ms, not yet
    handle = handle_of()
    issue(handle, 4.0, 5.0, 6.0, 7.0)  # the layers' copies end at 4, 5, 6, 7 ms
    verdicts: dict[int, list] = {0: [], 1: [], 2: []}
    for layer in verdicts:
        engine.wait_layer(handle, layer, 1.0, lambda late, s, k=layer: verdicts[k].append((late, s)))
    assert consumer.waited_on == handle.layer_events[:3]  # GPU-side waits, in order
    assert all(not v for v in verdicts.values())  # decided only once the events completed
    complete(engine, handle)
    assert verdicts[0] == [(True, pytest.approx(0.003))]  # stream idle from 1 ms to 4 ms
    assert verdicts[1] == [(False, 0.0)]  # the copy ended at 5 ms, the stream got there at 9
    assert verdicts[2] == [(False, 0.0)]  # the stream had not reached its wait at completion


def test_a_layer_already_ready_is_on_time_without_a_probe(consumer):
    engine = engine_with_probes()
    handle = handle_of()
    issue(handle, 1.0, 2.0, 3.0, 4.0)
    handle.mark_ready(2)
    seen = []
    engine.wait_layer(handle, 1, None, lambda late, s: seen.append((late, s)))
    assert seen == [(False, 0.0)] and consumer.waited_on == []


def test_a_wait_that_times_out_raises_and_is_never_classified(consumer):
    engine = engine_with_probes(0.5)
    handle = handle_of()
    seen = []
    with pytest.raises(TimeoutError):
        engine.wait_layer(handle, 0, 0.05, lambda late, s: seen.append((late, s)))
    issue(handle, 3.0, 3.0, 3.0, 3.0)  # the transfer kept running
    complete(engine, handle)
    assert seen == [] and consumer.waited_on == []


def test_a_wait_that_returns_is_classified_exactly_once_from_the_completion_thread(consumer):
    engine = engine_with_probes(2.0)
    handle = handle_of()
    seen = []
    waiter = threading.Thread(
        target=engine.wait_layer, args=(handle, 1, 5.0, lambda late, s: seen.append((late, s))))
    waiter.start()  # blocks until layer 1 is issued
    issue(handle, 1.0)
    issue(handle, 6.0)
    waiter.join(5.0)
    assert not waiter.is_alive()
    complete(engine, handle)
    complete(engine, handle)  # a second pass finds nothing left to classify
    assert seen == [(True, pytest.approx(0.004))]


def test_after_a_device_fault_returned_waits_count_on_time(consumer):
    engine = engine_with_probes(1.0)
    handle = handle_of()
    issue(handle, 8.0, 8.0, 8.0, 8.0)
    seen = []
    engine.wait_layer(handle, 0, 1.0, lambda late, s: seen.append((late, s)))
    complete(engine, handle, completed=False)
    assert seen == [(False, 0.0)]


@pytest.mark.parametrize("layers_issued", [0, 2])
def test_a_wait_on_a_batch_that_failed_raises_even_after_it_was_recycled(consumer,
                                                                        layers_issued):
    """A batch that failed (before any copy, or after some layers) and that the completion
    thread already recycled: a wait for a layer it never loaded raises TransferFailedError,
    never returns as if the layer had landed (the consumer would read stale pages)."""
    engine = engine_with_probes(1.0, 1.0)
    handle = handle_of()
    issue(handle, *([2.0] * layers_issued))
    progress = getattr(handle, _STATE)
    progress.error = IndexValueError("a device index names a page twice")
    progress.end = FakeEvent(3.0)
    handle.finish(progress.error, 0.0)
    engine._recycle(Lane(), handle, progress, True)
    seen = []
    with pytest.raises(TransferFailedError):
        engine.wait_layer(handle, layers_issued, 1.0, lambda late, s: seen.append((late, s)))
    assert seen == [] and consumer.waited_on == []


def test_verdict_without_device_timestamps_is_on_time():
    class NoTiming(FakeEvent):
        def elapsed_time(self, end):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")

    assert verdict(NoTiming(1.0), FakeEvent(5.0)) == (False, 0.0)
    assert verdict(FakeEvent(1.0), None) == (False, 0.0)


@pytest.mark.parametrize("bad", [3, "stream", object(), threading.Event()])
def test_normalize_after_accepts_only_cuda_events_and_streams(bad):
    engine = CudaEngine.__new__(CudaEngine)
    with pytest.raises(TypeError, match=r"torch\.cuda\.Event.*torch\.cuda\.Stream"):
        engine.normalize_after(bad)


class StickyErrorEvent(FakeEvent):
    """An event whose query() raises, as after a sticky device error on its stream."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class SyncedEvent(FakeEvent):
    def synchronize(self) -> None:
        return None


def test_a_device_error_while_recycling_still_ends_the_batch_and_keeps_the_thread(
        consumer, monkeypatch):
    """The completion thread reports the batch whatever recycling its events does (a sticky
    device error makes query() raise), and goes on with the next batch: its requests end and
    layer waits are classified, instead of hanging with every later batch of the direction."""
    engine = engine_with_probes()
    engine._probe_events = Pool()
    reported, classified = [], []
    monkeypatch.setattr(engine, "_report", lambda handle, due: reported.append(handle),
                        raising=False)
    lane = Lane()
    lane.direction = Direction.H2D
    lane.issued = queue.SimpleQueue()
    handles = []
    for _ in range(2):
        handle = handle_of()
        for t in range(LAYERS):
            handle.layer_events.append(SyncedEvent(float(t)))
        handle.mark_issued(LAYERS)
        progress = getattr(handle, _STATE)
        probe = cuda_module.LayerProbe(1, StickyErrorEvent(0.5),
                                       lambda late, s: classified.append(late))
        probe.armed = True
        progress.probes.append(probe)
        handles.append(handle)
        lane.issued.put(handle)
    lane.issued.put(None)
    monkeypatch.setattr(cuda_module.torch.cuda, "set_device", lambda device: None)
    engine._complete_loop(lane)
    assert reported == handles and all(h.finished and h.error is None for h in handles)
    assert classified == [False, False]


def test_engine_threads_that_cannot_select_the_device_still_end_every_batch(monkeypatch):
    """A sticky device error when the engine's threads start (set_device raises): the issue
    thread fails every batch instead of dying, and the completion thread ends them, so no
    request or close() waits for ever."""
    def unusable(device) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cuda_module.torch.cuda, "set_device", unusable)
    engine = engine_with_probes()
    reported = []
    monkeypatch.setattr(engine, "_report", lambda handle, due: reported.append(handle),
                        raising=False)
    lane = Lane()
    lane.direction = Direction.H2D
    lane.pending, lane.issued = queue.SimpleQueue(), queue.SimpleQueue()
    handles = [handle_of() for _ in range(3)]
    for handle in handles:
        lane.pending.put(handle)
    lane.pending.put(None)
    issuer = threading.Thread(target=engine._issue_loop, args=(lane,))
    completer = threading.Thread(target=engine._complete_loop, args=(lane,))
    issuer.start()
    completer.start()
    issuer.join(10)
    completer.join(10)
    assert not issuer.is_alive() and not completer.is_alive()
    assert reported == handles
    for handle in handles:
        assert handle.finished and "illegal memory access" in repr(handle.error)
