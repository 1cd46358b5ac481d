"""Runs the registered scenarios on a worker thread while a uvloop event loop runs the engines'
completion hand-off, and collects figures, failures and where they were measured."""

from __future__ import annotations

import asyncio
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import uvloop

from ..errors import BenchInterrupted
from ..geometry import PageGeometry, dsa_indexer
from ..kinds import Backend
from .device import load_average_1m, load_engine_class, machine_info, resolve_device
from .measure import MIN_PAIRS
from .registry import SCENARIOS, BenchContext, Scenario, scenario_name
from .sweep import measure_throughput

MIB = 1 << 20
#: Every copy figure moves at least this much per direction: several times any CPU cache.
MIN_FIGURE_BYTES = 128 * MIB


@dataclass(frozen=True)
class BenchConfig:
    backend: Backend = Backend.AUTO
    pairs: int = MIN_PAIRS
    figure_bytes: int = MIN_FIGURE_BYTES
    sweep_batch_pages: tuple[int, ...] = ()  #: empty: no throughput sweep
    geometry: PageGeometry = field(default_factory=dsa_indexer)
    seed: int = 0


@dataclass
class BenchRun:
    results: dict[str, float]
    errors: dict[str, str]  #: scenario name -> what went wrong
    machine: dict[str, object]
    verified: list[str]
    series: dict[str, list[float]]
    elapsed_s: float


def stderr_progress(line: str) -> None:
    print(f"bench: {line}", file=sys.stderr, flush=True)


def _run_all(ctx: BenchContext, scenarios: Sequence[Scenario], run: BenchRun) -> None:
    total = len(scenarios)
    for i, scenario in enumerate(scenarios, 1):
        ctx.check_stop()
        name = scenario_name(scenario)
        ctx.progress(f"[{i}/{total}] {name} ...")
        started = time.perf_counter()
        try:
            results = scenario(ctx)
        except BenchInterrupted:
            raise
        except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the others
            run.errors[name] = f"{type(exc).__name__}: {exc}"
            ctx.progress(f"[{i}/{total}] {name} FAILED: {run.errors[name]}")
            traceback.print_exc(file=sys.stderr)
            continue
        run.results.update({k: float(v) for k, v in results.items()})
        ctx.progress(f"[{i}/{total}] {name} done in {time.perf_counter() - started:.1f} s")
    if ctx.sweep_batch_pages:
        started = time.perf_counter()
        try:
            run.series.update(measure_throughput(ctx, ctx.sweep_batch_pages))
        except BenchInterrupted:
            raise
        except Exception as exc:  # noqa: BLE001
            run.errors["throughput_sweep"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        ctx.progress(f"throughput sweep done in {time.perf_counter() - started:.1f} s")


async def run_bench(config: BenchConfig, scenarios: Sequence[Scenario] | None = None,
                    progress: Callable[[str], None] = stderr_progress) -> BenchRun:
    """Run ``scenarios`` (default: every registered one). Must be awaited on a running loop.

    Cancelled (Ctrl-C), it asks the scenarios to stop, waits until the one running has stopped
    at its next pair or round (its services closed, its threads joined: the worker thread
    still needs this loop meanwhile), then propagates the cancellation."""
    if config.pairs < MIN_PAIRS:
        raise ValueError(f"pairs={config.pairs}: at least {MIN_PAIRS} interleaved pairs")
    device = resolve_device(config.backend)
    ctx = BenchContext(
        device=device,
        engine_class=load_engine_class(device.backend),
        loop=asyncio.get_running_loop(),
        geometry=config.geometry,
        pairs=config.pairs,
        figure_bytes=config.figure_bytes,
        seed=config.seed,
        sweep_batch_pages=config.sweep_batch_pages,
        progress=progress,
    )
    machine = machine_info(device)
    machine.update(pairs=config.pairs, figure_bytes=config.figure_bytes)
    run = BenchRun({}, {}, machine, ctx.verified, ctx.series, 0.0)
    started = time.perf_counter()
    worker = asyncio.ensure_future(asyncio.to_thread(
        _run_all, ctx, list(SCENARIOS if scenarios is None else scenarios), run))
    try:
        await asyncio.shield(worker)
    except asyncio.CancelledError:
        ctx.stopping.set()
        progress("interrupted: stopping at the end of the current measurement")
        await asyncio.wait({worker})
        failure = worker.exception()  # BenchInterrupted is how it stops; anything else is shown
        if failure is not None and not isinstance(failure, BenchInterrupted):
            progress(f"while stopping: {failure!r}")
        raise
    run.elapsed_s = time.perf_counter() - started
    machine["load_average_1m_end"] = load_average_1m()
    return run


def run_bench_blocking(config: BenchConfig, scenarios: Sequence[Scenario] | None = None,
                       progress: Callable[[str], None] = stderr_progress) -> BenchRun:
    """Start a uvloop event loop and run the bench on it."""
    return uvloop.run(run_bench(config, scenarios, progress))
