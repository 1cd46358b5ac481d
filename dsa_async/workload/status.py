"""The live status: one refreshing line on a terminal, a log line every few seconds otherwise.

Rates are over the last interval, from the service's registry; counts are totals so far.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TextIO

from prometheus_client import CollectorRegistry

from .counters import WorkloadCounters
from .readings import ServiceReadings

log = logging.getLogger("dsa_async.serve")

TTY_INTERVAL_S = 0.5
LOG_INTERVAL_S = 2.0


class StatusReporter:
    def __init__(self, registry: CollectorRegistry, counters: WorkloadCounters, *,
                 stream: TextIO, tty: bool, interval_s: float | None = None) -> None:
        self._registry = registry
        self._counters = counters
        self._stream = stream
        self._tty = tty
        self._interval_s = interval_s or (TTY_INTERVAL_S if tty else LOG_INTERVAL_S)
        self._last = ServiceReadings.read(registry)
        self._last_t = time.perf_counter()
        self._width = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dsa-async-status")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        if self._tty and self._width:
            self._stream.write("\n")  # leave the last status line in place
            self._stream.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self.report()

    def line(self) -> str:
        """One status line; advances the rate window."""
        now = ServiceReadings.read(self._registry)
        t = time.perf_counter()
        dt = max(t - self._last_t, 1e-9)
        d2h = (now.bytes_d2h - self._last.bytes_d2h) / dt / 1e9
        h2d = (now.bytes_h2d - self._last.bytes_h2d) / dt / 1e9
        self._last, self._last_t = now, t
        c = self._counters
        errors = c.errors  # every failure the workload saw (failed requests among them)
        return (f"d2h {d2h:6.2f} GB/s | h2d {h2d:6.2f} GB/s | host pool {now.host_pool_use:4.0%} "
                f"| late layers {now.prefetch_layers_late} | errors {errors} "
                f"| turns {c.turns_finished} | verified {c.verified_pages} pages, "
                f"mismatches {c.mismatches}")

    def report(self) -> None:
        text = self.line()
        if self._tty:
            self._width = max(self._width, len(text))
            self._stream.write("\r" + text.ljust(self._width))
            self._stream.flush()
        else:
            log.info("%s", text)
