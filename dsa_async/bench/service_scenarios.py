"""Service figures: front-door overhead with a no-op engine.

These are absolute medians (µs) or a fraction, not ratios to a copy: the scheduler figures
isolate Python work (validation, padding, page states, hazards, batching, metrics) from bytes.
"""

from __future__ import annotations

import random
import statistics
import tempfile
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
