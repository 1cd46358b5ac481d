"""One serving run: device buffers, the service, the metrics server, signals, drain, summary.

``serve(options)`` is a coroutine for a loop the caller runs (the command line uses
``uvloop.run``). Shutdown — SIGINT/SIGTERM, the end of ``duration_s``, or a trace played out —
stops arrivals, lets the steps in flight finish, waits for every copy this run started,
releases every host handle it holds, compares the service's statistics with the snapshot taken
right after start (the leak check, while the service still runs), and only then closes it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil
import torch

from ..config import PoolSize, ServiceConfig
from ..errors import ConfigError, shown
from ..front_door.service import OffloadService
from ..geometry import (
    DEEPSEEK_V32_LAYERS,
    DSA_PAGE_SIZE_TOKENS,
    KvDtype,
    PageGeometry,
    as_flag,
    dsa_indexer,
    mla_kv,
)
from ..host_memory.plan import human_bytes
from ..kinds import Backend
from ..observability.exposition import MetricsServer, start_metrics_server
from ..transfer.base import resolve_backend
from .arrivals import ArrivalDriver
from .consumer import MAX_COMPUTE_DIM
from .conversations import MultiTurnModel, WorkloadSpec, parse_trace
from .counters import WorkloadCounters
from .engine import EngineSettings, ServingEngine
from .pagedata import MAX_SEED, PagePatterns
from .readings import ServiceReadings
from .status import StatusReporter
from .output_files import check_distinct_files, check_writable_file
from .summary import ServeSummary

log = logging.getLogger("dsa_async.serve")

#: 80 pages x 61 layers x (8,448 + 41,984) B = 246 MB of device buffers (indexer + KV fp8).
DEFAULT_DEVICE_PAGES = 80
HOST_PAGES_PER_DEVICE_PAGE = 4  #: ``auto`` host pool: at most this many times the device cache
STARTED = "dsa-async serve: started"


@dataclass(frozen=True)
class ServeOptions:
    backend: Backend = Backend.AUTO
    duration_s: float | None = None  #: None: until SIGINT/SIGTERM (or a trace played out)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  #: None: no metrics server; 0: a free port
    host_pool_bytes: int | None = None  #: None: auto
    num_layers: int = DEEPSEEK_V32_LAYERS
    device_pages: int = DEFAULT_DEVICE_PAGES
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    seed: int = 0
    json_summary: Path | None = None
    quiet: bool = False
    arrival_rate_per_s: float = 4.0
    compute_dim: int = 256
    max_conversations: int = 64

    def __post_init__(self) -> None:
        for name, low, high in (("seed", 0, MAX_SEED), ("compute_dim", 1, MAX_COMPUTE_DIM)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"ServeOptions.{name} must be an int from {low} to {high}, "
                                  f"got {shown(value)}")
        as_flag("ServeOptions.quiet", self.quiet)


def pool_geometries(num_layers: int) -> tuple[PageGeometry, ...]:
    """The DSA indexer and the MLA KV cache (fp8), sharing one page table."""
    return (dsa_indexer(num_layers=num_layers), mla_kv(KvDtype.FP8, num_layers=num_layers))


def _check_device_buffers_fit(options: ServeOptions, backend: Backend) -> None:
    """Refuse device buffers larger than the memory available for them before anything is
    allocated: free device memory (CUDA), else this machine's (they are host memory there)."""
    need = options.device_pages * sum(g.num_layers * g.bytes_per_page_per_layer
                                      for g in pool_geometries(options.num_layers))
    if backend is Backend.CUDA:
        available, where = torch.cuda.mem_get_info()[0], "the CUDA device has"
    else:
        available, where = psutil.virtual_memory().available, "this machine has"
    if need > available:
        raise ConfigError(
            f"--layers {shown(options.num_layers)} x --device-pages {shown(options.device_pages)} "
            f"need {human_bytes(need)} of device buffers, and {where} {human_bytes(available)} "
            f"available; lower --device-pages or --layers")


def allocate_device_buffers(geometries: tuple[PageGeometry, ...], device_pages: int,
                            device: torch.device) -> dict[str, torch.Tensor]:
    """One zeroed ``uint8 [layers, pages, bytes_per_page_per_layer]`` tensor per pool (blocking)."""
    return {g.name: torch.zeros((g.num_layers, device_pages, g.bytes_per_page_per_layer),
                                dtype=torch.uint8, device=device) for g in geometries}


class _PressureHook:
    """Forwards the service's host-pressure calls to the engine once it exists."""

    engine: ServingEngine | None = None

    def __call__(self, pages_needed: int) -> int:
        return self.engine.on_host_pressure(pages_needed) if self.engine is not None else 0


async def serve(options: ServeOptions, *, stdout: TextIO | None = None,
                ignore_signals_after: bool = False) -> ServeSummary:
    """Run until stopped; return the summary (also printed to ``stdout``, default
    ``sys.stdout`` as it is at the call, and written as JSON if asked).

    SIGINT and SIGTERM stop it from the first step to the last: one that comes during set-up
    ends the run as soon as the service is up (with the summary of what ran, nothing), and
    later ones only log that it is already draining, until the summary is written. Then the
    signals go back to their defaults, or with ``ignore_signals_after`` (the program, whose
    exit code the summary has decided) are ignored for the rest of the process, so one that
    lands while the process exits cannot turn a passing run into a killed one."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_reason: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s: already draining", sig.name)
            return
        stop_reason.append(sig.name)
        log.info("%s: stopping arrivals and draining", sig.name)
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await _serve(options, sys.stdout if stdout is None else stdout, stop,
                            stop_reason)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
            if ignore_signals_after:
                signal.signal(sig, signal.SIG_IGN)  # not reset when the interpreter ends


async def _serve(options: ServeOptions, stdout: TextIO, stop: asyncio.Event,
                 stop_reason: list[str]) -> ServeSummary:
    loop = asyncio.get_running_loop()
    backend = resolve_backend(options.backend)
    if backend is Backend.CUDA and not torch.cuda.is_available():
        raise ConfigError("--backend cuda needs a CUDA device and a CUDA build of torch; "
                          "none is available here: use --backend cpu (or auto)")
    if options.json_summary is not None:  # refused now, not after the whole run
        check_writable_file(options.json_summary, "--json-summary")
        check_distinct_files({"--workload trace:PATH": options.workload.trace_path,
                              "--json-summary": options.json_summary})
    _check_device_buffers_fit(options, backend)
    settings = EngineSettings.for_device(
        page_size_tokens=DSA_PAGE_SIZE_TOKENS,
        device_pages=options.device_pages, num_layers=options.num_layers,
        max_conversations=options.max_conversations, compute_dim=options.compute_dim,
        seed=options.seed)
    if options.workload.trace_path is not None:
        conversations = await asyncio.to_thread(parse_trace, options.workload.trace_path)
    else:
        conversations = MultiTurnModel(options.seed, settings.context_tokens,
                                       arrival_rate_per_s=options.arrival_rate_per_s).conversations()

    geometries = pool_geometries(options.num_layers)
    device = torch.device("cuda" if backend is Backend.CUDA else "cpu")
    buffers = await asyncio.to_thread(allocate_device_buffers, geometries, options.device_pages,
                                      device)
    host_pool = (PoolSize(bytes=options.host_pool_bytes) if options.host_pool_bytes is not None
                 else PoolSize.auto(max_pages=HOST_PAGES_PER_DEVICE_PAGE * options.device_pages))
    config = ServiceConfig(geometries=geometries, host_pool=host_pool, backend=backend)
    hook = _PressureHook()
    service = OffloadService(config, buffers, on_host_pressure=hook)
    counters = WorkloadCounters()
    metrics_server: MetricsServer | None = None
    status: StatusReporter | None = None
    try:
        await service.start()
        try:
            baseline = service.statistics()
            if options.metrics_port is not None:
                metrics_server = await _start_metrics(service, options)
                log.info("metrics at %s", metrics_server.url)
            patterns = PagePatterns(buffers, seed=options.seed)
            engine = ServingEngine(service, patterns, settings, counters)
            hook.engine = engine
            engine.start()
            if not options.quiet:
                status = StatusReporter(service.registry, counters, stream=stdout,
                                        tty=stdout.isatty())
                status.start()
            driver = ArrivalDriver(engine, conversations,
                                   max_conversations=settings.max_conversations)
            started_at = loop.time()
            log.info("%s: backend %s, workload %s, %d layers, %d device pages, host pool %d "
                     "pages (%.2f GB), pid %d; stop with Ctrl-C", STARTED, backend.value,
                     options.workload, options.num_layers, options.device_pages,
                     baseline.capacity_pages, service.host_pool.capacity_bytes / 1e9,
                     os.getpid())
            reason = await _run_until_stopped(driver, engine, stop, options.duration_s)
            if not stop_reason:
                stop_reason.append(reason)
            await driver.stop()
            await engine.drain()
            duration_s = loop.time() - started_at
            engine.release_everything()
            end = service.statistics()
            if status is not None:
                await status.stop()
                status = None
        finally:
            await service.close()
    finally:
        if status is not None:
            await status.stop()
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.close)
    gc.collect()  # prefetches never consumed count as wasted when their handles go
    summary = ServeSummary.build(
        readings=ServiceReadings.read(service.registry), counters=counters, start=baseline, end=end,
        duration_s=duration_s, backend=backend.value, workload=str(options.workload),
        num_layers=options.num_layers, device_pages=options.device_pages,
        host_pool_pages=baseline.capacity_pages,
        bytes_per_page=sum(g.bytes_per_page for g in geometries), stop_reason=stop_reason[0],
        device_pages_in_use=engine.device.used_pages,
        host_pages_reclaimed=engine.host.reclaimed_pages,
        forward_pass_busy_s=engine.forward_stats.busy_s,
        forward_pass_waited_s=engine.forward_stats.waited_s,
        forward_steps=engine.forward_stats.steps,
        failed_steps=engine.forward_stats.failed_steps,
        forward_pass_error=engine.forward_stats.first_error,
        metrics_url=metrics_server.url if metrics_server is not None else None)
    print(summary.as_text(), file=stdout, flush=True)
    if options.json_summary is not None:
        await asyncio.to_thread(summary.write_json, options.json_summary)
    return summary


async def _start_metrics(service: OffloadService, options: ServeOptions) -> MetricsServer:
    try:
        return await asyncio.to_thread(start_metrics_server, service.registry,
                                       options.metrics_host, options.metrics_port)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {options.metrics_host}:{options.metrics_port}: "
                          f"{exc.strerror or exc}; pick another --metrics-port (0: any free one) "
                          f"or --metrics-host") from None


async def _run_until_stopped(driver: ArrivalDriver, engine: ServingEngine, stop: asyncio.Event,
                             duration_s: float | None) -> str:
    """Play arrivals until a signal, the duration or the end of a finite workload."""
    playing = asyncio.ensure_future(driver.run())
    stopped = asyncio.ensure_future(stop.wait())
    admission = engine.admission
    try:
        done, _ = await asyncio.wait({playing, stopped, admission}, timeout=duration_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (playing, stopped):
            task.cancel()
        await asyncio.wait({playing, stopped})
    for task in (admission, playing):
        if task in done and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    if admission in done:
        raise RuntimeError("the engine stopped admitting turns")
    if stopped in done:
        return "signal"
    if playing in done:
        return "workload played out"
    return "duration reached"
