"""A thread's call preempted at any line of the service's code while ``close()`` runs to its end.

Threads without an event loop read what the loop tears down at close (the pool, the engine).
The README promises that such a call raises ``ServiceClosedError`` once ``close()`` has begun
(or completes as it would have), and that a layer wait on a prefetch that copied the layer
returns, also after ``close()``. This explorer pauses the calling thread before its n-th line in
the ``dsa_async`` package, for every n in turn, closes the service meanwhile, and resumes it:
whatever line the preemption hit, the call ends with its documented outcome, never another
exception, and nothing is left reserved.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

import dsa_async
from dsa_async import DsaAsyncError, Pages, PoolSize, ServiceConfig, dsa_indexer
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.integrations.loop_thread import ServiceThread

PACKAGE_DIR = os.path.dirname(dsa_async.__file__) + os.sep
BOUND_S = 10
#: How long the close may wait for the paused thread (a lock it holds) before it is resumed.
CLOSE_WAIT_S = 0.1
LAYERS = 2


class _Paused:
    """Runs ``call`` on a plain thread, paused before its ``nth`` line in the package."""

    def __init__(self, call: Callable[[], object], nth: int) -> None:
        self.call, self.nth, self.lines = call, nth, 0
        self.paused, self.resume = threading.Event(), threading.Event()
        self.outcome: tuple[bool, object] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.nth:
                self.paused.set()
                self.resume.wait(BOUND_S)
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(PACKAGE_DIR) else None

    def _run(self) -> None:
        sys.settrace(self._global)
        try:
            self.outcome = (True, self.call())
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.outcome = (False, exc)
        finally:
            sys.settrace(None)


def _service(tmp_path) -> ServiceThread:
    geometry = dsa_indexer(num_layers=LAYERS)
    buffers = [torch.zeros(8, geometry.bytes_per_page_per_layer, dtype=torch.uint8)
               for _ in range(LAYERS)]
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=8), backend="cpu",
                           ledger_directory=str(tmp_path / "ledger"), drain_timeout_s=1.0)
    return ServiceThread.start(config, buffers, stop_at_exit=False)


def _evict(st: ServiceThread) -> Callable[[], object]:
    return lambda: st.service.evict_threadsafe(Pages([1, 2]))


def _prefetch_handle(st: ServiceThread) -> Callable[[], object]:
    handle = st.service.call_threadsafe(st.service.allocate_host_pages, 1).result(BOUND_S)
    return lambda: st.service.prefetch_threadsafe(handle, Pages([3]))


def _prefetch_tokens(st: ServiceThread) -> Callable[[], object]:
    handle = st.service.call_threadsafe(st.service.allocate_host_pages, 2).result(BOUND_S)
    return lambda: st.service.prefetch_threadsafe(
        None, Pages([4, 5]), host_tokens=Pages(list(handle.page_seq)))


def _release(st: ServiceThread) -> Callable[[], object]:
    handle = st.service.call_threadsafe(st.service.allocate_host_pages, 1).result(BOUND_S)
    return lambda: st.service.release_threadsafe(handle)


def _wait_layer(st: ServiceThread) -> tuple[Callable[[], object], Callable[[], None]]:
    """A load held by its producer until the waiter is paused; then it copies every layer
    while the service closes."""
    handle = st.service.call_threadsafe(st.service.allocate_host_pages, 1).result(BOUND_S)
    gate = threading.Event()
    load = st.service.prefetch_threadsafe(handle, Pages([6]), after=gate)
    return (lambda: load.wait_layer(LAYERS - 1, timeout_s=BOUND_S)), gate.set


def _wait(st: ServiceThread) -> Callable[[], object]:
    load = st.service.evict_threadsafe(Pages([7]))
    return lambda: load.wait(timeout_s=BOUND_S)


SCENARIOS = {"evict": _evict, "prefetch-handle": _prefetch_handle,
             "prefetch-tokens": _prefetch_tokens, "release": _release, "wait": _wait}


def _explore(tmp_path, scenario: Callable[[ServiceThread], object],
             allowed: tuple[type[BaseException], ...]) -> int:
    """Every preemption point of the scenario's call; returns how many there were. A scenario
    gives the call, or the call and what to do once it is paused (or blocked in a wait)."""
    for nth in range(1, 10_000):
        st = _service(tmp_path / str(nth))
        made = scenario(st)
        call, on_pause = made if isinstance(made, tuple) else (made, lambda: None)
        paused = _Paused(call, nth)
        paused.thread.start()
        blocked_after = time.monotonic() + CLOSE_WAIT_S
        while not paused.paused.wait(0.01):
            if not paused.thread.is_alive():  # it ended before its nth line: all explored
                on_pause()
                st.stop(BOUND_S)
                return nth - 1
            if time.monotonic() > blocked_after:  # blocked in a wait before its nth line
                on_pause()
        on_pause()
        stopper = threading.Thread(target=st.stop, args=(BOUND_S,), daemon=True)
        stopper.start()
        stopper.join(CLOSE_WAIT_S)  # the close may need a lock the paused thread holds
        paused.resume.set()
        paused.thread.join(BOUND_S)
        stopper.join(BOUND_S)
        assert not paused.thread.is_alive() and not stopper.is_alive(), f"hung at line {nth}"
        ok, value = paused.outcome
        assert ok or isinstance(value, allowed), (
            f"preempted at its line {nth}, the call raised {type(value).__name__}: {value}")
        assert HostLedger(tmp_path / str(nth) / "ledger").entries() == ()
    raise AssertionError("the call never ended")


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_thread_call_preempted_anywhere_by_close_raises_service_closed_or_completes(
        tmp_path, name):
    points = _explore(tmp_path, SCENARIOS[name], (DsaAsyncError,))
    assert points > 10  # the walk went through the call, not around it


def test_a_layer_wait_preempted_anywhere_by_close_returns_the_copied_layer(tmp_path):
    """The load copies every layer while the service closes, the waiter paused anywhere in its
    wait: it must return, not fail on the torn-down engine."""
    points = _explore(tmp_path, _wait_layer, ())
    assert points > 5
