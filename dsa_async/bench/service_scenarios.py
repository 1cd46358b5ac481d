"""Service figures: front-door overhead with a no-op engine, and per-layer overlap.

These are absolute medians (µs) or a fraction, not ratios to a copy: the scheduler figures
isolate Python work (validation, padding, page states, hazards, batching, metrics) from bytes.
"""

from __future__ import annotations

import asyncio
import queue
import random
import statistics
import tempfile
import threading
import time

import torch

from ..config import PoolSize, ServiceConfig
from ..front_door.service import OffloadService
from ..geometry import PageGeometry
from ..transfer.noop import NoopEngine
from .registry import BenchContext, Comparison, Target, register_scenario, register_target

OVERHEAD = register_target(Target(
    "scheduler.overhead_us_per_request", Comparison.AT_MOST, 20.0, "us",
    "1,000 evictions of 1-4 pages given as token ranges at random in-page offsets, submitted "
    "then awaited together and released, through the full front door with a no-op engine; "
    "wall time / requests, median of rounds"))
LATENCY = register_target(Target(
    "scheduler.single_request_latency_us", Comparison.AT_MOST, 100.0, "us",
    "one such eviction submitted and awaited alone (no-op engine); median of 200"))
REFERENCE = register_target(Target(
    "scheduler.python_reference_us", Comparison.AT_MOST, None, "us",
    "a fixed loop of interpreter work shaped like a request's (a tensor's numpy view, a slotted "
    "object, a range, a dict update), per iteration, timed in the same rounds as the overhead "
    "figure: how fast this machine ran Python during the run, to read the absolute scheduler "
    "figures against (reported, no target)"))
OVERLAP = register_target(Target(
    "overlap.exposed_fraction", Comparison.AT_MOST, 0.10, "",
    "a forward-pass thread runs torch matmuls per layer sized so the pass takes 1.5x the copy "
    "and waits on each layer of a 61-layer prefetch of >= 128 MiB (wait_layer); sum of its "
    "waits / the same prefetch's engine copy time measured alone; median of rounds"))
PASS_OVER_COPY = register_target(Target(
    "overlap.forward_pass_over_copy", Comparison.AT_MOST, None, "x",
    "the overlap figure's forward pass alone / its prefetch's copy alone, as calibrated for "
    "that run (aimed at 1.5: below it the exposed fraction reads high, above it low; "
    "reported, no target)"))

DEVICE_PAGES = 512


def bench_service(ctx: BenchContext, host_pages: int, engine_factory, device_pages: int,
                  geometry: PageGeometry | None = None
                  ) -> tuple[OffloadService, list[torch.Tensor]]:
    """A CPU-backend service (not started) with zeroed per-layer device tensors and a private
    ledger; ``geometry`` defaults to the bench's."""
    g = ctx.geometry if geometry is None else geometry
    device = [torch.zeros(device_pages, g.bytes_per_page_per_layer, dtype=torch.uint8)
              for _ in range(g.num_layers)]
    config = ServiceConfig(geometries=(g,), host_pool=PoolSize(pages=host_pages), backend="cpu",
                           ledger_directory=tempfile.mkdtemp(prefix="dsa-async-bench-"))
    return OffloadService(config, device, engine_factory=engine_factory), device


def token_requests(count: int, seed: int) -> list[torch.Tensor]:
    """The overhead workload: token ranges of 1-4 pages at random in-page offsets."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pages = rng.randint(1, 4)
        start = rng.randrange(0, DEVICE_PAGES - 5) * 64 + rng.randrange(64)
        out.append(torch.arange(start, start + (pages - 1) * 64 + 1))
    return out


class _Slot:
    __slots__ = ("first", "pages", "waiters", "key")


def _python_reference_us(tensors: list[torch.Tensor]) -> float:
    """Per-iteration time of a fixed loop of interpreter work (see ``REFERENCE``)."""
    table: dict[int, _Slot] = {}
    started = time.perf_counter()
    for _ in range(3):
        for i, tensor in enumerate(tensors):
            slot = _Slot()
            slot.first = tensor.numpy().item(0)
            slot.pages = range(i, i + 3)
            slot.waiters = [i]  # not the slot itself: a cycle only the collector frees
            slot.key = (-i, i)
            table[i & 15] = slot  # few survivors: the collector's work would be noise here
    return (time.perf_counter() - started) / (3 * len(tensors)) * 1e6


async def overhead_round_us(service: OffloadService, requests: list[torch.Tensor]) -> float:
    """One round of the ``scheduler.overhead_us_per_request`` workload: every eviction
    submitted, then each awaited and its host pages released; wall time per request (us)."""
    started = time.perf_counter()
    transfers = [service.evict(tokens) for tokens in requests]
    for transfer in transfers:
        service.release((await transfer).host_pages)
    return (time.perf_counter() - started) / len(requests) * 1e6


async def _scheduler_figures(ctx: BenchContext) -> dict[str, float]:
    service, _ = bench_service(ctx, 4096, NoopEngine, DEVICE_PAGES)
    requests = token_requests(1000, ctx.seed)
    async with service:
        per_request, reference = [], []
        for round_ in range(max(ctx.pairs, 5) + 1):
            ctx.check_stop()
            reference.append(_python_reference_us(requests))
            round_us = await overhead_round_us(service, requests)
            if round_:  # the first round warms allocators and caches
                per_request.append(round_us)
        single = []
        for tokens in requests[:200]:
            started = time.perf_counter()
            result = await service.evict(tokens)
            single.append((time.perf_counter() - started) * 1e6)
            service.release(result.host_pages)
    return {OVERHEAD.name: statistics.median(per_request),
            LATENCY.name: statistics.median(single),
            REFERENCE.name: statistics.median(reference[1:])}


@register_scenario
def scheduler(ctx: BenchContext) -> dict[str, float]:
    ctx.progress("scheduler: front-door overhead with a no-op engine")
    return ctx.run_on_loop(_scheduler_figures(ctx))


def _compute_pass_s(matrix: torch.Tensor, layers: int, reps: int) -> float:
    started = time.perf_counter()
    for _ in range(layers):
        for _ in range(reps):
            matrix @ matrix
    return time.perf_counter() - started


#: Calibration stops once the pass is this close to its target (or after ``_CALIBRATIONS``).
_PASS_TOLERANCE = 0.1
_CALIBRATIONS = 4


def _calibrated_compute(target_s: float, layers: int) -> tuple[torch.Tensor, int, float]:
    """A matrix and a per-layer repeat count whose forward pass over ``layers`` takes about
    ``target_s``; also the measured pass time (median of 3) at that count. The count is
    corrected from the measured pass until it is within ``_PASS_TOLERANCE`` of the target (a
    single-repeat pass is too short to time well on a loaded machine)."""
    matrix = torch.randn(128, 128)  # small, so the repeat count sizes the pass finely
    _compute_pass_s(matrix, layers, 1)  # warm-up
    reps = max(1, round(target_s / statistics.median(
        _compute_pass_s(matrix, layers, 1) for _ in range(3))))
    for _ in range(_CALIBRATIONS):
        pass_s = statistics.median(_compute_pass_s(matrix, layers, reps) for _ in range(3))
        if abs(pass_s / target_s - 1) <= _PASS_TOLERANCE:
            break
        reps = max(1, round(reps * target_s / pass_s))
    return matrix, reps, pass_s


async def _overlap(ctx: BenchContext) -> tuple[float, float]:
    g = ctx.geometry
    pages = max(16, -(-ctx.figure_bytes // g.bytes_per_page))  # at least figure_bytes
    service, device = bench_service(ctx, pages, ctx.engine_class, pages)
    async with service:
        backup = await service.evict(torch.arange(0, pages * g.page_size_tokens))
        alone = []
        for _ in range(3):
            result = await service.prefetch(backup.host_pages,
                                            torch.arange(0, pages * g.page_size_tokens))
            alone.append(result.device_s)  # the engine's copy time, without scheduling
        copy_s = statistics.median(alone)
        matrix, reps, compute_s = _calibrated_compute(1.5 * copy_s, g.num_layers)
        ctx.progress(f"overlap: copy alone {copy_s * 1e3:.1f} ms, forward pass alone "
                     f"{compute_s * 1e3:.1f} ms ({compute_s / copy_s:.2f}x)")
        fractions = []
        work: queue.SimpleQueue = queue.SimpleQueue()
        waits: queue.SimpleQueue = queue.SimpleQueue()

        def forward_pass() -> None:
            """A persistent forward-pass thread, as a server has: one prefetch per step."""
            while (load := work.get()) is not None:
                waited = 0.0
                for layer in range(g.num_layers):
                    started = time.perf_counter()
                    load.wait_layer(layer)
                    waited += time.perf_counter() - started
                    for _ in range(reps):
                        matrix @ matrix
                waits.put(waited)

        thread = threading.Thread(target=forward_pass, name="bench-forward-pass")
        thread.start()
        try:
            for _ in range(max(ctx.pairs, 5)):
                ctx.check_stop()
                load = service.prefetch(backup.host_pages,
                                        torch.arange(0, pages * g.page_size_tokens))
                work.put(load)
                await load
                fractions.append(await asyncio.to_thread(waits.get) / copy_s)
        finally:
            work.put(None)
            await asyncio.to_thread(thread.join)
        service.release(backup.host_pages)
    return statistics.median(fractions), compute_s / copy_s


@register_scenario
def overlap(ctx: BenchContext) -> dict[str, float]:
    ctx.progress("overlap: forward pass consuming a prefetch layer by layer")
    exposed, pass_over_copy = ctx.run_on_loop(_overlap(ctx))
    return {OVERLAP.name: exposed, PASS_OVER_COPY.name: pass_over_copy}
