"""The front door from a thread without an event loop, and the loop next to a thread busy in
Python, against the same work on a quiet loop.

Scenarios run on a worker thread that has no event loop (registry.py), the situation of a
server's scheduler or forward-pass thread, so the thread rounds run right there.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..front_door.service import OffloadService
from ..transfer.noop import NoopEngine
from .registry import BenchContext, Comparison, Target, register_scenario, register_target
from .service_scenarios import DEVICE_PAGES, bench_service, overhead_round_us, token_requests

THREADSAFE_RATIO = register_target(Target(
    "scheduler.threadsafe_overhead_ratio", Comparison.AT_MOST, 2.0, "x",
    "one thread without an event loop runs the scheduler.overhead_us_per_request workload "
    "(1,000 evictions of 1-4 pages given as token tensors, no-op engine): submits them all "
    "with evict_threadsafe, then waits for each (Transfer.wait) and releases its host pages "
    "(release_threadsafe) from that thread, until the loop has taken the last release; "
    "per-request wall time / the same workload on the loop, in interleaved pairs of rounds of "
    "the same run; median of the per-pair ratios"))

THREADSAFE_US = register_target(Target(
    "scheduler.threadsafe_us_per_request", Comparison.AT_MOST, 10.0, "us",
    "the thread rounds of scheduler.threadsafe_overhead_ratio: wall time per request from "
    "the thread without an event loop (submit, wait, release, up to the loop having taken the "
    "last release); median of the rounds (DESIGN's bar for a thread without a loop; absolute, "
    "so read it against scheduler.python_reference_us)"))

BUSY_THREAD_RATIO = register_target(Target(
    "scheduler.busy_thread_overhead_ratio", Comparison.AT_MOST, 2.5, "x",
    "the scheduler.overhead_us_per_request workload on the loop while another thread of the "
    "process runs Python the whole round (as a server's scheduler or forward-pass thread "
    "does) / the same workload with no such thread, in interleaved pairs of rounds of the "
    "same run; median of the per-pair ratios. Two threads that share the GIL evenly read "
    "about 2; each call on the request path that lets go of the GIL can cost the loop a "
    "whole switch interval (sys.getswitchinterval()) before it runs again"))

#: A bound on any single wait of the thread rounds: reached only if the service hangs.
WAIT_BOUND_S = 60.0


def thread_round_us(service: OffloadService, requests: list[torch.Tensor]) -> float:
    """One round of the workload from the calling thread (no event loop on it): every
    eviction submitted, then each waited for and its host pages released; wall time per
    request (us), up to the loop having taken the last release."""
    started = time.perf_counter()
    transfers = [service.evict_threadsafe(tokens) for tokens in requests]
    for transfer in transfers:
        service.release_threadsafe(transfer.wait(WAIT_BOUND_S).host_pages)
    # One round trip for the whole round: it runs after the loop took every release above.
    service.call_threadsafe(service.statistics).result(WAIT_BOUND_S)
    return (time.perf_counter() - started) / len(requests) * 1e6


@dataclass(frozen=True)
class _Pairs:
    """Interleaved pairs of rounds (the first pair dropped): per request (us) on the quiet
    loop and the other way, and their per-pair ratios."""

    loop_us: tuple[float, ...]
    other_us: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return statistics.median(o / q for o, q in zip(self.other_us, self.loop_us))


def _paired_rounds(ctx: BenchContext, service: OffloadService, requests: list[torch.Tensor],
                   other_round: Callable[[], float]) -> _Pairs:
    """The overhead workload on the quiet loop, then ``other_round()``, in pairs."""
    loop_us, other_us = [], []
    for round_ in range(max(ctx.pairs, 5) + 1):
        ctx.check_stop()
        on_loop = ctx.run_on_loop(overhead_round_us(service, requests))
        other = other_round()
        if round_:  # the first pair warms allocators and caches
            loop_us.append(on_loop)
            other_us.append(other)
    return _Pairs(tuple(loop_us), tuple(other_us))


@contextlib.contextmanager
def _overhead_service(ctx: BenchContext) -> Iterator[tuple[OffloadService, list[torch.Tensor]]]:
    """A started no-op-engine service and the overhead workload's requests; closed after."""
    service, _ = bench_service(ctx, 4096, NoopEngine, DEVICE_PAGES)
    ctx.run_on_loop(service.start())
    try:
        yield service, token_requests(1000, ctx.seed)
    finally:
        ctx.run_on_loop(service.close())


@register_scenario
def threadsafe(ctx: BenchContext) -> dict[str, float]:
    ctx.progress("threadsafe: the overhead workload from a thread without an event loop")
    with _overhead_service(ctx) as (service, requests):
        wakeups_before = service.thread_wakeups
        pairs = _paired_rounds(ctx, service, requests,
                               lambda: thread_round_us(service, requests))
        stats = service.call_threadsafe(service.statistics).result(WAIT_BOUND_S)
        if stats.used_pages:
            raise AssertionError(f"{stats.used_pages} host pages still held after the rounds")
        wakeups = service.thread_wakeups - wakeups_before
    ctx.progress(f"threadsafe: {statistics.median(pairs.other_us):.1f} us per request from the "
                 f"thread, {statistics.median(pairs.loop_us):.1f} us on the loop; {wakeups} "
                 f"loop wake-ups for {(len(pairs.loop_us) + 1) * 2 * len(requests)} hand-offs")
    return {THREADSAFE_RATIO.name: pairs.ratio,
            THREADSAFE_US.name: statistics.median(pairs.other_us)}


def _spin(stop: threading.Event) -> None:
    """Pure-Python work until ``stop`` is set: a thread that wants the GIL all the time."""
    count = 0
    while not stop.is_set():
        for _ in range(1000):
            count += 1


def _round_next_to_busy_thread(ctx: BenchContext, service: OffloadService,
                               requests: list[torch.Tensor]) -> float:
    """One overhead round on the loop while a thread runs Python (started and stopped here)."""
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="bench-busy-python")
    spinner.start()
    try:
        return ctx.run_on_loop(overhead_round_us(service, requests))
    finally:
        stop.set()
        spinner.join()


@register_scenario
def busy_thread(ctx: BenchContext) -> dict[str, float]:
    ctx.progress("busy thread: the overhead workload on the loop next to a thread running Python")
    with _overhead_service(ctx) as (service, requests):
        pairs = _paired_rounds(ctx, service, requests,
                               lambda: _round_next_to_busy_thread(ctx, service, requests))
    ctx.progress(f"busy thread: {statistics.median(pairs.other_us):.1f} us per request next to "
                 f"it, {statistics.median(pairs.loop_us):.1f} us without it")
    return {BUSY_THREAD_RATIO.name: pairs.ratio}
