"""CPU backend: one worker thread per direction plays the role of a CUDA stream.

Same semantics as the CUDA backend on plain tensors: FIFO per direction, per-layer readiness,
dependencies honoured by waiting in the worker (as ``stream.wait_event`` would), completions
handed to the loop in batches. torch releases the GIL during copies, so copies overlap with
compute in other threads, as on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import torch

from ..errors import (
    ArgumentTypeError,
    ConfigError,
    CopyNotRunError,
    CopySkipped,
    ServiceClosedError,
)
from ..kinds import Backend, Direction
from .base import TransferEngine
from .batch import BatchHandle, CopyBatch
from .copy_crew import CopyCrew, crew_threads
from .copyplan import LayerCopies, PagePlan, Staging, measure_fused_for_short_runs

#: How often a worker blocked on a dependency or producer checks whether waits were abandoned.
WAIT_POLL_S = 0.1


class _FutureDone:
    """``wait(timeout)`` on a ``concurrent.futures.Future``: true once it finished, failed or
    was cancelled. (``concurrent.futures.wait`` misses a plain ``cancel()``: it counts only
    cancellations an executor was notified of; done-callbacks run for every ending.)"""

    __slots__ = ("ended",)

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.ended = threading.Event()
        future.add_done_callback(lambda _future: self.ended.set())

    def wait(self, timeout_s: float) -> bool:
        return self.ended.wait(timeout_s)


class CpuEngine(TransferEngine):
    backend = Backend.CPU
    producer_kinds = "threading.Event, concurrent.futures.Future"
    producer_waits_can_fail = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, b in self.bindings.items():
            if b.device.type != "cpu":
                raise ConfigError(
                    f"pool {name!r}: device buffers are on {b.device}; the cpu backend copies "
                    f"between CPU tensors (use backend 'cuda' for buffers on a CUDA device)")
        # Each worker shares copies with helper threads (copy_crew.py): short strided copies
        # through fused device views, and whole layers of pages scattered on both sides.
        helpers = crew_threads(torch.get_num_threads()) - 1
        self._crews: dict[Direction, CopyCrew] = {}
        self._abandoned = threading.Event()
        self._queues = {d: queue.SimpleQueue() for d in Direction}
        self._threads: dict[Direction, threading.Thread] = {}
        try:  # whatever fails here, no thread started so far is left behind
            for d in Direction:
                self._crews[d] = CopyCrew(helpers, f"dsa-async-{d.value}-crew")
            # Fused device views: which copy path wins for scattered pages depends on the
            # machine (and its load), so it is measured here, once (a few ms; the engine starts
            # off the loop).
            self.bindings = {
                name: dataclasses.replace(
                    b, fused_for_short_runs=measure_fused_for_short_runs(
                        b, crew=self._crews[Direction.D2H]))
                if b.device_fused is not None else b
                for name, b in self.bindings.items()}
            for binding in self.bindings.values():
                binding.layers_wide  # noqa: B018 - made now, not by the first batch's worker
            for d in Direction:
                thread = threading.Thread(target=self._run, args=(d,),
                                          name=f"dsa-async-{d.value}", daemon=True)
                thread.start()
                self._threads[d] = thread
        except BaseException:
            self.close()
            raise

    def submit(self, batch: CopyBatch) -> BatchHandle:
        handle = BatchHandle(batch, self.num_layers)
        self._queues[batch.direction].put(handle)
        return handle

    def normalize_after(self, after: object) -> object:
        if isinstance(after, (threading.Event, concurrent.futures.Future)):
            return after
        raise ArgumentTypeError(f"after={after!r}: the CPU backend waits for {self.producer_kinds}")

    def wait_layer(self, handle: BatchHandle, layer: int, timeout_s: float | None,
                   classify: Callable[[bool, float], None]) -> None:
        late = handle.layers_ready <= layer
        waited_from = time.perf_counter()
        handle.wait_ready(layer, timeout_s)
        classify(late, time.perf_counter() - waited_from if late else 0.0)

    def close(self) -> None:
        """Stop the workers (after the batches already submitted) and their crews. Blocks."""
        for d in self._threads:
            self._queues[d].put(None)
        for thread in self._threads.values():
            thread.join()
        for crew in self._crews.values():
            crew.close()

    def _run(self, direction: Direction) -> None:
        q = self._queues[direction]
        staging, crew = Staging(), self._crews[direction]
        while (handle := q.get()) is not None:
            if not handle.claim_start():
                continue  # every request was cancelled while it queued: already ended
            due = []
            started = time.perf_counter()
            try:
                # A load must not bind all its layers before its first one (that delays the
                # first layer a consumer waits for); one that has to wait anyway binds them
                # during the wait, so that its layers then run back to back.
                ahead = None
                if _will_wait(handle.batch):  # known device pages: no indices to resolve
                    ahead = self._layer_copies(handle.batch, handle.batch.device_pages,
                                               direction, staging, crew, bind_all=True)
                self._wait_dependencies(handle)
                started = time.perf_counter()
                due = self._copy(handle, direction, staging, crew, ahead)
                error = None
            except BaseException as exc:  # noqa: BLE001 - reported to every waiter
                error = exc
            due += handle.finish(error, time.perf_counter() - started)
            self._report(handle, due)

    def drop_unstarted(self, handle: BatchHandle) -> None:
        due = handle.end_unstarted(
            CopySkipped("cancelled while it queued behind other copies; it never ran"))
        if due is not None:
            self._report(handle, due)

    def abandon_waits(self) -> None:
        self._abandoned.set()

    def _wait_for(self, event, what: str, handle: BatchHandle) -> None:
        """Block until ``event.wait()`` returns true, unless the engine abandons waits or every
        request of ``handle`` is cancelled meanwhile (checked every ``WAIT_POLL_S``, and before
        waiting at all: copies queued behind one that was abandoned end at once, not one poll
        each)."""
        if event.wait(0):
            return
        while True:
            if self._abandoned.is_set():
                raise ServiceClosedError(
                    f"the service closed while this copy still waited for {what}; it never ran")
            if handle.skip_requested:
                raise CopySkipped(f"cancelled while it waited for {what}; it never ran")
            if event.wait(WAIT_POLL_S):
                return

    def _wait_dependencies(self, handle: BatchHandle) -> None:
        batch = handle.batch
        for dep in batch.deps:
            # hazard: an earlier copy touches the same pages
            self._wait_for(dep.handle.done, f"batch {dep.handle.batch.batch_id}", handle)
            if dep.needs_data and dep.handle.error is not None:
                raise CopyNotRunError(
                    f"batch {dep.handle.batch.batch_id}, which produced the host pages this "
                    f"batch reads, failed: {dep.handle.error!r}"
                ) from dep.handle.error
        for producer in batch.after:
            # the caller's producer must finish writing the pages first
            if isinstance(producer, concurrent.futures.Future):
                self._wait_for(_FutureDone(producer), f"its producer {producer!r}", handle)
                if producer.cancelled():
                    raise CopyNotRunError(
                        f"its producer {producer!r} was cancelled; the copy did not run")
                if producer.exception() is not None:
                    raise CopyNotRunError(
                        f"its producer failed with {producer.exception()!r}; the copy did not "
                        f"run") from producer.exception()
            else:
                self._wait_for(producer, f"its producer {producer!r}", handle)
        if handle.skip_requested:
            raise CopySkipped("cancelled before its copy started; it never ran")

    def _layer_copies(self, batch: CopyBatch, device_pages, direction: Direction,
                      staging: Staging, crew: CopyCrew, *, bind_all: bool = False
                      ) -> tuple[PagePlan, list[tuple[LayerCopies, int]]]:
        """The batch's plan and, per pool, its copies (``bind_all``: every layer bound now)."""
        plan = PagePlan.build(batch.host_pages, device_pages)
        copies = [(LayerCopies(b, plan, direction, staging, crew), b.geometry.num_layers)
                  for b in self.bindings.values()]
        if bind_all:
            for pool_copies, _layers in copies:
                pool_copies.bind_all()
        return plan, copies

    def _copy(self, handle: BatchHandle, direction: Direction, staging: Staging,
              crew: CopyCrew, ahead: tuple[PagePlan, list] | None = None) -> list:
        """Copy the batch; ``ahead``: its plan and bound copies, made while it waited."""
        batch = handle.batch
        due = []
        plan, copies = ahead if ahead is not None else self._layer_copies(
            batch, batch.resolve_device_pages(), direction, staging, crew)
        if plan.num_pages == 0:
            return due
        if direction is Direction.D2H:  # no layer is ready before the whole batch: bind all
            if self.fault_hook is not None:
                self.fault_hook(batch, 0)
            for pool_copies, layers in copies:
                pool_copies.bind_all()
                pool_copies.run(0, layers)
            return due
        if crew.size > 1 and all(c.splits_layers for c, _ in copies):
            self._stream_layers(handle, crew, copies)
            return due
        # Pools share readiness, so the finest grouping of any pool sets the pace.
        groups = min((plan.layer_groups(b, self.num_layers, crew.size)
                      for b in self.bindings.values()), key=len)
        for first, last in groups:
            if self.fault_hook is not None:
                self.fault_hook(batch, first)
            for pool_copies, layers in copies:
                if first < layers:
                    pool_copies.run(first, min(last, layers))
            for callback in handle.mark_ready(last):
                self.handoff.post(callback)  # per-layer readiness reaches the loop now
        return due

    def _stream_layers(self, handle: BatchHandle, crew: CopyCrew, copies: list) -> None:
        """A load whose every layer is one independent call: the crew's threads take layers in
        turn, none waiting for another between layers, and readiness advances as each prefix
        of layers is in (a lockstep of crew-size groups, one hand-over per group, cost a load
        a fifth of its time). Blocks this worker thread."""
        batch, fault_hook = handle.batch, self.fault_hook

        def copy_layer(layer: int) -> None:
            if fault_hook is not None:
                fault_hook(batch, layer)
            for pool_copies, layers in copies:
                if layer < layers:
                    pool_copies.run(layer, layer + 1)

        def reached(layers: int) -> None:
            for callback in handle.mark_ready(layers):
                self.handoff.post(callback)  # per-layer readiness reaches the loop now

        crew.stream(copy_layer, self.num_layers, reached)


def _will_wait(batch: CopyBatch) -> bool:
    """Whether the batch has an unfinished dependency or producer (known device pages only)."""
    if batch.device_indices is not None:
        return False
    for dep in batch.deps:
        if not dep.handle.finished:
            return True
    for producer in batch.after:
        if not (producer.done() if isinstance(producer, concurrent.futures.Future)
                else producer.is_set()):
            return True
    return False
