"""Threads blocked on a ``BatchHandle``: each returns once what it waits for happened (a layer
issued or ready, or the batch finished), never before; a failure wakes everyone with the
right outcome; a timeout leaves nothing behind, so later waits and wake-ups still work."""

from __future__ import annotations

import concurrent.futures
import random

import numpy as np
import pytest

from dsa_async.errors import TransferFailedError
from dsa_async.kinds import Direction
from dsa_async.transfer.batch import BatchHandle, CopyBatch

LAYERS = 12
BOUND_S = 10  # only proves that a wait returns at all


def _handle() -> BatchHandle:
    pages = np.arange(2, dtype=np.int64)
    return BatchHandle(CopyBatch(Direction.H2D, pages, pages), LAYERS)


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


def _settled(futures: dict[int, concurrent.futures.Future]) -> set[int]:
    return {key for key, f in futures.items() if f.done()}


def test_layer_waiters_return_exactly_when_their_layer_is_ready(pool):
    rng = random.Random(7)
    for _ in range(20):
        handle = _handle()
        wanted = [rng.randrange(LAYERS) for _ in range(8)]
        futures = {i: pool.submit(handle.wait_ready, layer, BOUND_S)
                   for i, layer in enumerate(wanted)}
        ready = 0
        while ready < LAYERS:
            ready = min(LAYERS, ready + rng.randint(1, 3))
            handle.mark_ready(ready)
            due = {i for i, layer in enumerate(wanted) if layer < ready}
            concurrent.futures.wait([futures[i] for i in due], BOUND_S)
            for i in due:
                futures[i].result(0)  # returned, without an error
            # The others have not returned: a wake-up is released before mark_ready returns,
            # so one that was due would already be done.
            assert _settled(futures) == due


def test_issued_waiters_follow_layers_issued_not_ready(pool):
    handle = _handle()
    issued = pool.submit(handle.wait_issued, 3, BOUND_S)
    ready = pool.submit(handle.wait_ready, 3, BOUND_S)
    handle.mark_issued(4)
    issued.result(BOUND_S)
    assert not ready.done()
    handle.mark_ready(4)
    ready.result(BOUND_S)


def test_a_thread_waiting_for_the_batch_returns_only_when_it_finishes(pool):
    handle = _handle()
    finished = pool.submit(handle.done.wait, BOUND_S)
    for layer in range(1, LAYERS + 1):
        handle.mark_ready(layer)
        assert not finished.done(), f"returned after layer {layer}, before the batch finished"
    handle.finish(None, 0.0)
    assert finished.result(BOUND_S) is True
    assert handle.done.wait(0) is True  # already finished: no blocking


def test_a_failure_wakes_every_waiter_with_its_outcome(pool):
    handle = _handle()
    handle.mark_ready(3)
    early = pool.submit(handle.wait_ready, 2, BOUND_S)  # ready before the failure
    late = pool.submit(handle.wait_ready, 7, BOUND_S)
    whole = pool.submit(handle.done.wait, BOUND_S)
    early.result(BOUND_S)
    handle.finish(RuntimeError("device fault"), 0.0)
    with pytest.raises(TransferFailedError, match="device fault"):
        late.result(BOUND_S)
    assert whole.result(BOUND_S) is True
    handle.wait_ready(1, 0)  # a layer that landed before the failure stays usable
    with pytest.raises(TransferFailedError):
        handle.wait_ready(5, 0)


def test_timeouts_leave_nothing_behind(pool):
    handle = _handle()
    with pytest.raises(TimeoutError, match="layer 4 .* not ready"):
        handle.wait_ready(4, 0.01)
    with pytest.raises(TimeoutError, match="layer 4 .* not issued"):
        handle.wait_issued(4, 0.0)
    assert handle.done.wait(0.01) is False
    # The timed-out waits left no state: new waiters are woken as usual.
    ready = pool.submit(handle.wait_ready, 4, BOUND_S)
    whole = pool.submit(handle.done.wait, BOUND_S)
    handle.mark_ready(5)
    ready.result(BOUND_S)
    handle.finish(None, 0.0)
    assert whole.result(BOUND_S) is True


def test_many_threads_racing_the_engine_all_return(pool):
    """Waiters that arrive while layers land (before, during and after their layer)."""
    rng = random.Random(11)
    for _ in range(10):
        handle = _handle()
        futures = []
        for layer in range(1, LAYERS + 1):
            futures += [pool.submit(handle.wait_ready, rng.randrange(LAYERS), BOUND_S)
                        for _ in range(2)]
            futures.append(pool.submit(handle.done.wait, BOUND_S))
            handle.mark_ready(layer)
        handle.finish(None, 0.0)
        for f in futures:
            assert f.result(BOUND_S) in (None, True)
