"""Page-copy figures: the engine against a contiguous copy and against the token-granular path.

Each figure times one evict + prefetch round trip of the same page pairs through the real engine
(a D2H batch, then an H2D batch that depends on it, each the whole >= 128 MiB at once), against a
reference that moves the same bytes, as the median of interleaved pairs. After measuring, the
bytes the engine moved are compared with their source, so a broken copy is never reported.
"""

from __future__ import annotations

from .baselines import ContiguousCopy, TokenGranularCopy
from .copy_rig import CopyRig, DeviceLayout, PagePattern
from .measure import interleaved_pairs
from .registry import (
    BenchContext,
    Comparison,
    Target,
    register_scenario,
    register_target,
)

_ROUND_TRIP = (
    "evict (one D2H batch) then prefetch (one H2D batch, dependent) of the same "
    ">= 128 MiB of DSA indexer pages through the engine, vs two contiguous copies "
    "(dst.copy_(src), one per direction) of the same bytes; median of interleaved pairs of "
    "reference_s / engine_s"
)

EXTENTS = register_target(Target(
    "copy.extents.ratio_to_contiguous", Comparison.AT_LEAST, 0.7, "x",
    f"host pages from the extent allocator, device pages in runs of 16 at random positions, "
    f"separate per-layer device tensors: {_ROUND_TRIP}",
))
RANDOM = register_target(Target(
    "copy.random.ratio_to_contiguous", Comparison.AT_LEAST, 0.35, "x",
    f"single pages at random positions on both sides, separate per-layer device tensors: "
    f"{_ROUND_TRIP}",
))
EXTENTS_3D = register_target(Target(
    "copy.extents3d.ratio_to_contiguous", Comparison.AT_LEAST, 0.85, "x",
    f"as copy.extents but the per-layer device tensors are views of one 3-D allocation: "
    f"{_ROUND_TRIP}",
))
RANDOM_3D = register_target(Target(
    "copy.random3d.ratio_to_contiguous", Comparison.AT_LEAST, 0.5, "x",
    f"as copy.random but the per-layer device tensors are views of one 3-D allocation: "
    f"{_ROUND_TRIP}",
))
RANDOM_3D_OVER_RANDOM = register_target(Target(
    "copy.random3d_over_random", Comparison.AT_LEAST, 0.9, "x",
    "copy.random3d.ratio_to_contiguous / copy.random.ratio_to_contiguous, measured directly: "
    "the same page pairs through two engines, one with separate per-layer device tensors and "
    "one with views of one 3-D allocation (its copy path as chosen at engine start), their "
    "round trips timed in interleaved pairs; median of separate_s / fused_s",
))
TOKEN = register_target(Target(
    "copy.random.speedup_vs_token_baseline", Comparison.AT_LEAST, 1.5, "x",
    "the copy.random round trip vs the token-granular path on the same pages (per layer: "
    "132 B token rows as int32 [tokens, 33], index_select of each page's 64 rows, index_copy_ "
    "into the other side, both directions); median of interleaved pairs of token_s / engine_s",
))


def _ratio_to_contiguous(ctx: BenchContext, pattern: PagePattern, layout: DeviceLayout,
                         target: Target, *, with_token_baseline: bool = False) -> dict[str, float]:
    with CopyRig(ctx, pattern, layout) as rig:
        reference = ContiguousCopy(ctx.device, rig.bytes_per_direction)
        ctx.progress(f"{target.name}: {rig.num_pages} pages, {rig.bytes_per_direction:,} B "
                     f"per direction, {ctx.pairs} pairs")
        timings = interleaved_pairs(reference.round_trip, rig.round_trip, ctx.pairs,
                                    check_stop=ctx.check_stop)
        del reference
        rig.verify_round_trip(target.name)
        results = {target.name: timings.speedup()}
        if with_token_baseline:
            token = TokenGranularCopy(rig)
            ctx.progress(f"{TOKEN.name}: same pages, {ctx.pairs} pairs")
            timings = interleaved_pairs(token.round_trip, rig.round_trip, ctx.pairs,
                                        check_stop=ctx.check_stop)
            rig.verify(f"{TOKEN.name} (token path)", token.d2h, token.h2d)
            results[TOKEN.name] = timings.speedup()
    return results


@register_scenario
def copy_extents(ctx: BenchContext) -> dict[str, float]:
    return _ratio_to_contiguous(ctx, PagePattern.EXTENTS, DeviceLayout.SEPARATE, EXTENTS)


@register_scenario
def copy_random(ctx: BenchContext) -> dict[str, float]:
    return _ratio_to_contiguous(ctx, PagePattern.RANDOM, DeviceLayout.SEPARATE, RANDOM,
                                with_token_baseline=True)


@register_scenario
def copy_extents3d(ctx: BenchContext) -> dict[str, float]:
    return _ratio_to_contiguous(ctx, PagePattern.EXTENTS, DeviceLayout.FUSED, EXTENTS_3D)


@register_scenario
def copy_random3d(ctx: BenchContext) -> dict[str, float]:
    return _ratio_to_contiguous(ctx, PagePattern.RANDOM, DeviceLayout.FUSED, RANDOM_3D)


@register_scenario
def copy_random3d_over_random(ctx: BenchContext) -> dict[str, float]:
    with CopyRig(ctx, PagePattern.RANDOM, DeviceLayout.SEPARATE) as separate, \
            CopyRig(ctx, PagePattern.RANDOM, DeviceLayout.FUSED) as fused:
        ctx.progress(f"{RANDOM_3D_OVER_RANDOM.name}: {fused.num_pages} pages each, "
                     f"{ctx.pairs} pairs")
        timings = interleaved_pairs(separate.round_trip, fused.round_trip, ctx.pairs,
                                    check_stop=ctx.check_stop)
        separate.verify_round_trip(f"{RANDOM_3D_OVER_RANDOM.name} (separate)")
        fused.verify_round_trip(f"{RANDOM_3D_OVER_RANDOM.name} (fused)")
    return {RANDOM_3D_OVER_RANDOM.name: timings.speedup()}
