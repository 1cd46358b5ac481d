"""Throughput by batch size, for the plot: the engine, the token-granular path and a plain copy.

For each batch size ``b`` (pages), the same >= 128 MiB of random page pairs (the ``copy.random``
case, separate per-layer device tensors) moves D2H then H2D in batches of ``b`` pages: the engine
gets every batch of a direction submitted at once (FIFO on its worker), the token path runs batch
by batch, and the contiguous reference copies consecutive ``b``-page slices of two flat buffers.
Throughput = 2 x bytes / median seconds over ``SWEEP_REPEATS`` runs, in GB/s (10^9 B/s).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ..kinds import Direction
from .baselines import ContiguousCopy, TokenGranularCopy
from .copy_rig import CopyRig, DeviceLayout, PagePattern
from .registry import BenchContext

SWEEP_REPEATS = 3
GB = 1e9


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_throughput(ctx: BenchContext, batch_pages: tuple[int, ...]) -> dict[str, list[float]]:
    """Throughput by batch size: ``batch_pages``, ``engine_gbps``, ``token_gbps``,
    ``contiguous_gbps``."""
    series: dict[str, list[float]] = {"batch_pages": [], "engine_gbps": [], "token_gbps": [],
                                      "contiguous_gbps": []}
    with CopyRig(ctx, PagePattern.RANDOM, DeviceLayout.SEPARATE) as rig:
        token = TokenGranularCopy(rig)
        reference = ContiguousCopy(ctx.device, rig.bytes_per_direction)
        page_bytes = rig.geometry.bytes_per_page
        moved = 2 * rig.bytes_per_direction
        for b in sorted({min(b, rig.num_pages) for b in batch_pages}):
            ctx.check_stop()
            ctx.progress(f"throughput sweep: batches of {b} pages")

            def engine(b: int = b) -> None:
                rig.move(Direction.D2H, b)
                rig.move(Direction.H2D, b)

            def tokens(b: int = b) -> None:
                token.d2h(b)
                token.h2d(b)

            def contiguous(b: int = b) -> None:
                step = b * page_bytes
                for offset in range(0, rig.bytes_per_direction, step):
                    reference.d2h(min(step, rig.bytes_per_direction - offset), offset)
                for offset in range(0, rig.bytes_per_direction, step):
                    reference.h2d(min(step, rig.bytes_per_direction - offset), offset)

            series["batch_pages"].append(float(b))
            for key, fn in (("engine_gbps", engine), ("token_gbps", tokens),
                            ("contiguous_gbps", contiguous)):
                series[key].append(moved / _median_s(fn, SWEEP_REPEATS) / GB)
        smallest = min(batch_pages)
        rig.verify("throughput sweep (engine, smallest batch)",
                   lambda: rig.move(Direction.D2H, smallest),
                   lambda: rig.move(Direction.H2D, smallest))
    return series
