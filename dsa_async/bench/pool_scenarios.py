"""Host-pool start-up: ``HostPool.create`` against allocating and zero-filling the same bytes."""

from __future__ import annotations

import torch

from ..host_memory.pool import HostPool
from .copy_rig import pages_for_bytes
from .measure import interleaved_pairs
from .registry import (
    BenchContext,
    Comparison,
    Target,
    register_scenario,
    register_target,
)

STARTUP_RATIO = register_target(Target(
    "pool.startup_ratio_to_first_touch", Comparison.AT_MOST, 1.3, "x",
    "HostPool.create(indexer, pages) until it returns (arena allocated and first-touched) vs "
    "torch.empty(n, dtype=uint8).fill_(0) of the same >= 128 MiB; median of interleaved pairs "
    "of pool_s / reference_s (lower is better); memory is freed outside the timed region",
))
STARTUP_S = register_target(Target(
    "pool.startup_s", Comparison.AT_MOST, None, "s",
    "median seconds of HostPool.create in the pool.startup_ratio_to_first_touch pairs "
    "(reported, no target)",
))


@register_scenario
def pool_startup(ctx: BenchContext) -> dict[str, float]:
    g = ctx.geometry
    pages = pages_for_bytes(g, ctx.figure_bytes)
    nbytes = g.bytes_for_pages(pages)
    ctx.progress(f"{STARTUP_RATIO.name}: {pages} pages, {nbytes:,} B, {ctx.pairs} pairs")

    def reference() -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).fill_(0)

    def subject() -> HostPool:
        return HostPool.create([g], pages)

    timings = interleaved_pairs(reference, subject, ctx.pairs, check_stop=ctx.check_stop)
    return {STARTUP_RATIO.name: timings.cost(), STARTUP_S.name: timings.median_subject_s()}
