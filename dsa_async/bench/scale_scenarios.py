"""The front door at scale: long scattered requests and fragmented host pools (no-op engine).

Like the other scheduler figures these are absolute medians with a no-op engine (Python work
only: validation, paging, page states, hazards, allocation, metrics), read against
``scheduler.python_reference_us``; the fragmentation cost is also a ratio to the same pool
empty, from interleaved rounds of one run.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..front_door.service import OffloadService
from ..geometry import dsa_indexer
from ..paging.runs import page_tokens
from ..transfer.noop import NoopEngine
from .measure import MIN_PAIRS
from .registry import BenchContext, Comparison, Target, register_scenario, register_target
from .runner import MIN_FIGURE_BYTES
from .service_scenarios import DEVICE_PAGES, bench_service, overhead_round_us, token_requests

SCATTERED = register_target(Target(
    "scheduler.scattered_us_per_page", Comparison.AT_MOST, 1.0, "us",
    "a 2-layer indexer pool of 32,768 host pages, 4,096 device pages; 20 evictions one after "
    "another (each submitted, awaited and released before the next), each of 1,024 distinct "
    "device pages at random positions given as one int64 token tensor holding all 64 tokens "
    "of each page, pages in random order; no-op engine; wall time / pages; median of rounds"))
FRAGMENTED = register_target(Target(
    "scheduler.fragmented_us_per_request", Comparison.AT_MOST, 20.0, "us",
    "the scheduler.overhead_us_per_request workload on a 1-layer indexer pool of 262,144 pages "
    "in which pages are held in 4-page handles alternating with 4-page holes (32,768 holes, "
    "each fits any request of the workload); median of the 15 fragmented rounds of "
    "scheduler.fragmented_overhead_ratio"))
FRAGMENTED_RATIO = register_target(Target(
    "scheduler.fragmented_overhead_ratio", Comparison.AT_MOST, 1.5, "x",
    "scheduler.fragmented_us_per_request / the same workload on the same pool with nothing "
    "held, in the same run: 5 interleaved pairs (3 rounds with the pool empty, then 3 with it "
    "fragmented afresh), after one warm-up round; per pair the ratio of the median rounds; "
    "median of the pairs"))
ONE_PAGE_HOLES_RATIO = register_target(Target(
    "scheduler.one_page_holes_overhead_ratio", Comparison.AT_MOST, 1.5, "x",
    "1,000 evictions of one page each (a token range inside one page, at a random in-page "
    "offset; no-op engine; submitted, awaited together and released, as "
    "scheduler.overhead_us_per_request) on a 1-layer indexer pool of 262,144 pages in which "
    "every other page is held (131,072 one-page holes) / the same on the pool with nothing "
    "held, pairs as in scheduler.fragmented_overhead_ratio (DESIGN's 131k free holes)"))


@dataclass(frozen=True)
class ScaleSizes:
    """The sizes the figures are defined at (tests shrink them)."""

    scattered_host_pages: int = 32_768
    scattered_device_pages: int = 4_096
    scattered_request_pages: int = 1_024
    scattered_requests_per_round: int = 20
    fragmented_pool_pages: int = 262_144
    fragmented_run_pages: int = 4  #: each held handle and each hole between them


SIZES = ScaleSizes()
#: Runs whose copy figures are below the command line's minimum size (the test suite's tiny
#: runs) shrink these scenarios too; ``dsa-async bench`` always measures at ``SIZES``.
TINY_SIZES = ScaleSizes(scattered_host_pages=1_024, scattered_device_pages=256,
                        scattered_request_pages=64, scattered_requests_per_round=4,
                        fragmented_pool_pages=16_384)
#: Pairs of rounds for the fragmentation figures, whatever ``ctx.pairs`` says: fragmenting
#: the pool again for each pair (65,536 allocations) costs ~1 s, far more than the rounds.
FRAGMENTED_PAIRS = MIN_PAIRS
#: Rounds of each state per pair: a pair compares the median round of each, so one round that
#: other work on the machine slowed does not decide the pair.
ROUNDS_PER_STATE = 3


def _scattered_requests(sizes: ScaleSizes, page_size_tokens: int, seed: int
                        ) -> list[torch.Tensor]:
    """Distinct device pages at random positions, in random order, as all their tokens."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(sizes.scattered_requests_per_round):
        pages = rng.permutation(sizes.scattered_device_pages)[:sizes.scattered_request_pages]
        requests.append(torch.from_numpy(page_tokens(pages, page_size_tokens)))
    return requests


async def _scattered_us_per_page(ctx: BenchContext, sizes: ScaleSizes) -> float:
    geometry = dsa_indexer(num_layers=2)
    service, _ = bench_service(ctx, sizes.scattered_host_pages, NoopEngine,
                               sizes.scattered_device_pages, geometry)
    requests = _scattered_requests(sizes, geometry.page_size_tokens, ctx.seed)
    pages = sizes.scattered_request_pages * len(requests)
    per_page = []
    async with service:
        for round_ in range(max(ctx.pairs, 5) + 1):
            ctx.check_stop()
            started = time.perf_counter()
            for tokens in requests:
                service.release((await service.evict(tokens)).host_pages)
            if round_:  # the first round warms allocators and caches
                per_page.append((time.perf_counter() - started) / pages * 1e6)
    return statistics.median(per_page)


def _fragment(service: OffloadService, run_pages: int) -> list:
    """Fill the (empty) pool with handles of ``run_pages`` and release every other one: held
    runs alternate with holes of the same size. Returns the held handles."""
    capacity = service.statistics().capacity_pages
    handles = [service.allocate_host_pages(run_pages) for _ in range(capacity // run_pages)]
    for handle in handles[::2]:
        service.release(handle)
    held = handles[1::2]
    statistics_now = service.statistics()
    if statistics_now.largest_free_extent_pages != run_pages:
        raise RuntimeError(f"fragmenting left a free extent of "
                           f"{statistics_now.largest_free_extent_pages} pages, not {run_pages}")
    return held


async def _rounds_us(service: OffloadService, requests: list[torch.Tensor]) -> list[float]:
    """``ROUNDS_PER_STATE`` overhead rounds. The collector runs as it would in a server
    (a full collection over the handles held can land in a round: medians of rounds)."""
    return [await overhead_round_us(service, requests) for _ in range(ROUNDS_PER_STATE)]


async def _holes_pairs(ctx: BenchContext, sizes: ScaleSizes, run_pages: int,
                       requests: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Pairs of (empty, fragmented into ``run_pages`` holes) rounds of ``requests``: every
    fragmented round (us per request), and per pair the ratio of the median rounds."""
    service, _ = bench_service(ctx, sizes.fragmented_pool_pages, NoopEngine, DEVICE_PAGES,
                               dsa_indexer(num_layers=1))
    fragmented_us, ratios = [], []
    async with service:
        await overhead_round_us(service, requests)  # warms allocators and caches
        for _ in range(FRAGMENTED_PAIRS):
            ctx.check_stop()
            empty = await _rounds_us(service, requests)
            held = _fragment(service, run_pages)
            fragmented = await _rounds_us(service, requests)
            for handle in held:
                service.release(handle)
            del held
            gc.collect()  # the dropped handles are not the next pair's empty rounds' cost
            fragmented_us += fragmented
            ratios.append(statistics.median(fragmented) / statistics.median(empty))
    return fragmented_us, ratios


def _one_page_requests(count: int, seed: int) -> list[torch.Tensor]:
    """Token ranges inside one page each, at random pages and in-page offsets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        page, first = int(rng.integers(DEVICE_PAGES)), int(rng.integers(64))
        last = int(rng.integers(first, 64))
        out.append(torch.arange(page * 64 + first, page * 64 + last + 1))
    return out


async def _fragmented_figures(ctx: BenchContext, sizes: ScaleSizes) -> dict[str, float]:
    fragmented_us, ratios = await _holes_pairs(ctx, sizes, sizes.fragmented_run_pages,
                                               token_requests(1000, ctx.seed))
    _, one_page_ratios = await _holes_pairs(ctx, sizes, 1, _one_page_requests(1000, ctx.seed))
    return {FRAGMENTED.name: statistics.median(fragmented_us),
            FRAGMENTED_RATIO.name: statistics.median(ratios),
            ONE_PAGE_HOLES_RATIO.name: statistics.median(one_page_ratios)}


@register_scenario
def scheduler_at_scale(ctx: BenchContext) -> dict[str, float]:
    sizes = SIZES if ctx.figure_bytes >= MIN_FIGURE_BYTES else TINY_SIZES
    ctx.progress(f"{SCATTERED.name}: {sizes.scattered_requests_per_round} evictions of "
                 f"{sizes.scattered_request_pages} scattered pages per round")
    figures = {SCATTERED.name: ctx.run_on_loop(_scattered_us_per_page(ctx, sizes))}
    ctx.progress(f"{FRAGMENTED.name}: a pool of {sizes.fragmented_pool_pages} pages with "
                 f"{sizes.fragmented_pool_pages // (2 * sizes.fragmented_run_pages)} holes, "
                 f"then {sizes.fragmented_pool_pages // 2} one-page holes")
    figures.update(ctx.run_on_loop(_fragmented_figures(ctx, sizes)))
    return figures
