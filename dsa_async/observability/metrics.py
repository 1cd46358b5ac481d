"""Every Prometheus metric the service exports: names, help texts and label sets, in one place.

All metrics live on a ``CollectorRegistry`` the caller injects (never the process-global default),
so an embedding server can serve them next to its own and every test can start from a fresh one.

Conventions (DESIGN.md, section 6):

* prefix ``dsa_async_``, base units (bytes, seconds), ``_total`` on counters;
* label values come only from the enums in :mod:`dsa_async.kinds`; never page, layer or request
  ids;
* histograms (not summaries) with buckets from 10 µs to 250 s;
* every label child is bound in the constructor, so every series exists, at zero, at the first
  scrape, and dashboards never show "no data" for a direction that simply has not moved yet.

The ``record_*``/``set_*``/``observe_*`` methods are cheap and never block: each is a few dict
look-ups and lock-protected float adds. The service calls them from the event-loop thread once per
batch or per request, never per page. The scrape runs on the HTTP server's thread and reads the
host budget through ``budget_reader`` at that moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import ConfigError
from ..kinds import Backend, BudgetKind, Direction, Outcome, PoolState, Timeliness
from .batch_metrics import BatchCounter, BatchHistogram

__all__ = [
    "DURATION_BUCKETS_S",
    "BudgetFigures",
    "ServiceMetrics",
]

_log = logging.getLogger("dsa_async.metrics")  # the logger name operators configure

PREFIX = "dsa_async_"

#: Histogram buckets for every duration, 10 µs to 250 s in 1-2.5-5 steps. A single page copy over
#: PCIe takes a few µs, a large batch tens of ms; a request that waits for a producer, or for a
#: drain at close (30 s by default), may take minutes, and its percentile must not stop at 10 s.
DURATION_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5,
    1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0, 25.0, 50.0,
    100.0, 250.0,
)  # fmt: skip


@dataclass(frozen=True)
class BudgetFigures:
    """The host-memory budget as the probe sees it now, in bytes.

    ``limit_bytes`` is what the machine/cgroup allows this process in total, ``reserved_bytes`` what
    the machine-wide ledger holds for pools already sized, ``available_bytes`` what a new pool may
    still take. ``free_bytes`` is what is free for this process before the reserve is taken off
    (the tightest of MemAvailable, cgroup headroom and free hugepages, less reservations not yet
    allocated) and ``reserve_bytes`` the margin kept free for the rest of the machine, so
    ``available_bytes == max(0, free_bytes - reserve_bytes)``. An auto-sized pool takes what is
    available, which leaves ``free_bytes`` near ``reserve_bytes``; below it, the rest of the
    machine is growing into the reserve.
    """

    limit_bytes: int
    reserved_bytes: int
    available_bytes: int
    reserve_bytes: int
    free_bytes: int


BudgetReader = Callable[[], BudgetFigures]

_E = TypeVar("_E")
_C = TypeVar("_C")


def _pick(children: Mapping[_E, _C], key: _E, what: str) -> _C:
    """Return the pre-bound child for ``key``; a non-member (e.g. a string) is a caller error."""
    try:
        return children[key]
    except KeyError:
        choices = ", ".join(repr(k) for k in children)
        raise ConfigError(f"{what}={key!r} is not one of {choices}") from None


_LABEL = {d: d.value for d in Direction}  # label values without Enum.value's property look-up


def _check_direction(direction: object) -> None:
    if direction not in _LABEL:
        raise ConfigError(f"direction={direction!r} is not one of {', '.join(map(repr, _LABEL))}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")


class _BudgetCollector(Collector):
    """Exports ``dsa_async_host_budget_bytes{kind}`` from ``reader`` at scrape time.

    The budget moves with the container and with other processes on the machine, so a value cached
    at the last allocation would be stale; reading at scrape time keeps the gauge honest. The
    reader runs on the scrape thread: it must be thread-safe and cheap (a few ``/proc`` and
    cgroup file reads). If it raises, the family is left out of that scrape (and the error
    logged) instead of failing the whole scrape or exporting made-up numbers.
    """

    NAME = PREFIX + "host_budget_bytes"
    HELP = (
        "Host-memory budget in bytes, read at scrape time: limit (what this process may use in "
        "total), reserved (held by pools on this machine's ledger), available (what a new pool "
        "may still take), reserve (kept free for the rest of the machine), free (free for this "
        "process before the reserve: available = max(0, free - reserve))."
    )

    def __init__(self, reader: BudgetReader) -> None:
        self._reader = reader

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.NAME, self.HELP, labels=["kind"])

    def describe(self) -> Iterable[Metric]:
        """Name the family for the registry's duplicate check without calling the reader."""
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        """Call the reader (blocks for as long as it does) and yield one family, five series."""
        try:
            figures = self._reader()
        except Exception:  # noqa: BLE001 - a failing probe must not break the whole scrape
            _log.exception("reading the host-memory budget for %s failed", self.NAME)
            return []
        family = self._family()
        values = {
            BudgetKind.LIMIT: figures.limit_bytes,
            BudgetKind.RESERVED: figures.reserved_bytes,
            BudgetKind.AVAILABLE: figures.available_bytes,
            BudgetKind.RESERVE: figures.reserve_bytes,
            BudgetKind.FREE: figures.free_bytes,
        }
        for kind in BudgetKind:
            family.add_metric([kind.value], float(values[kind]))
        return [family]


class ServiceMetrics:
    """All metrics of one service instance, registered on ``registry``.

    Construction registers every family and binds every label child, so the first scrape already
    shows each series at zero. Registering two ``ServiceMetrics`` on one registry raises
    ``ValueError`` (duplicate names): give each instance its own registry.

    Every method below is non-blocking and cheap; call them once per batch or request from the
    event-loop thread (they are also thread-safe). Enum members are required wherever a label is
    chosen; anything else raises ``ConfigError``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        version: str,
        backend: Backend,
        budget_reader: BudgetReader,
    ) -> None:
        """Register every family on ``registry`` and bind all label children.

        ``version`` and ``backend`` go into ``dsa_async_build_info``; ``backend`` is the resolved
        backend (CPU or CUDA); ``AUTO`` is refused because it says nothing about what runs. ``budget_reader`` is called on every scrape,
        from the scrape thread; it must be thread-safe and cheap.
        """
        if not isinstance(backend, Backend) or backend is Backend.AUTO:
            raise ConfigError(
                f"backend must be the resolved Backend.CPU or Backend.CUDA, got {backend!r}"
            )
        if not callable(budget_reader):
            raise ConfigError(f"budget_reader must be a zero-argument callable, got {budget_reader!r}")
        reg = registry
        buckets = DURATION_BUCKETS_S

        def per_direction(metric: Counter | Gauge | Histogram) -> dict[Direction, object]:
            return {d: metric.labels(direction=d.value) for d in Direction}

        # --- copies -----------------------------------------------------------------------------
        by_direction = {d: (d.value,) for d in Direction}
        # The per-batch figures (see batch_metrics.py).
        self._transfer_bytes = BatchCounter(
            PREFIX + "transfer_bytes",
            "Bytes copied between device and host, by direction (d2h: backup/eviction, "
            "h2d: prefetch). Counted when a copy batch completes; includes padding.",
            ["direction"], by_direction)
        self._transfer_pages = BatchCounter(
            PREFIX + "transfer_pages",
            "Whole pages copied between device and host, by direction; each page counts "
            "once for all of its layers.",
            ["direction"], by_direction)
        reg.register(self._transfer_bytes)
        reg.register(self._transfer_pages)
        self._transfer_errors = per_direction(
            Counter(
                PREFIX + "transfer_errors",
                "Copy batches that failed, by direction.",
                ["direction"],
                registry=reg,
            )
        )
        self._transfer_duration = BatchHistogram(
            PREFIX + "transfer_duration_seconds",
            "Device-timed duration of one copy batch, by direction, in seconds.",
            "direction",
            [d.value for d in Direction],
            buckets,
        )
        reg.register(self._transfer_duration)
        # --- requests ---------------------------------------------------------------------------
        self._requests = BatchCounter(
            PREFIX + "requests",
            "Requests that ended, by direction and outcome (done, failed, cancelled).",
            ["direction", "outcome"],
            {(d, o): (d.value, o.value) for d in Direction for o in Outcome})
        self._padding_bytes = BatchCounter(
            PREFIX + "padding_bytes",
            "Bytes moved only because a request was padded to whole pages, by direction.",
            ["direction"], by_direction)
        reg.register(self._requests)
        reg.register(self._padding_bytes)
        # Observed a batch of requests at a time (see batch_metrics.py).
        self._request_latency = BatchHistogram(
            PREFIX + "request_latency_seconds",
            "Time from submit to the request's end (any outcome), by direction, in seconds.",
            "direction",
            [d.value for d in Direction],
            buckets,
        )
        reg.register(self._request_latency)
        self._queue_depth = per_direction(
            Gauge(
                PREFIX + "queue_depth",
                "Requests queued (accepted, not yet handed to the copy engine), by direction.",
                ["direction"],
                registry=reg,
            )
        )
        self._inflight_bytes = per_direction(
            Gauge(
                PREFIX + "inflight_bytes",
                "Bytes of requests handed to the copy engine and not yet ended (copying, or "
                "waiting there for their producers or the copies they follow), by direction.",
                ["direction"],
                registry=reg,
            )
        )
        self._inflight_requests = per_direction(
            Gauge(
                PREFIX + "inflight_requests",
                "Requests handed to the copy engine and not yet ended (copying, or waiting "
                "there for their producers or the copies they follow), by direction.",
                ["direction"],
                registry=reg,
            )
        )
        # --- host pool and budget ---------------------------------------------------------------
        pool_bytes = Gauge(
            PREFIX + "host_pool_bytes",
            "Host pool bytes by page state: used (held by allocations, in_flight included), "
            "free (used + free = capacity), in_flight (the part of used that a queued or "
            "running copy reads or writes).",
            ["state"],
            registry=reg,
        )
        self._pool_bytes = {s: pool_bytes.labels(state=s.value) for s in PoolState}
        self._pool_capacity = Gauge(
            PREFIX + "host_pool_capacity_bytes",
            "Size of the page-locked host pool in bytes.",
            registry=reg,
        )
        self._pool_allocation = Histogram(
            PREFIX + "pool_allocation_seconds",
            "Time to allocate and first-touch the host pool arenas at start, in seconds.",
            buckets=buckets,
            registry=reg,
        )
        reg.register(_BudgetCollector(budget_reader))
        # --- prefetch and loop ------------------------------------------------------------------
        layers = Counter(
            PREFIX + "prefetch_layers",
            "Prefetched layers by timeliness: on_time (ready before the consumer asked), late "
            "(the consumer waited), wasted (never consumed).",
            ["timeliness"],
            registry=reg,
        )
        self._prefetch_layers = {t: layers.labels(timeliness=t.value) for t in Timeliness}
        self._prefetch_wait = Histogram(
            PREFIX + "prefetch_wait_seconds",
            "How long a consumer waited for late prefetched layers, in seconds.",
            buckets=buckets,
            registry=reg,
        )
        self._loop_lag = Histogram(
            PREFIX + "event_loop_lag_seconds",
            "How late the event loop ran a timer scheduled by the lag monitor, in seconds.",
            buckets=buckets,
            registry=reg,
        )
        # The value is always 1; version and backend are in the labels. A plain gauge, so the
        # exported name is exactly ``dsa_async_build_info``.
        Gauge(
            PREFIX + "build_info",
            "Build information: package version and resolved transfer backend. Always 1.",
            ["backend", "version"],
            registry=reg,
        ).labels(backend=backend.value, version=version).set(1)

    # --- copies --------------------------------------------------------------------------------

    def record_batch(
        self, direction: Direction, *, bytes_moved: int, pages_moved: int, duration_s: float
    ) -> None:
        """Count one completed copy batch and observe its device-timed duration. Non-blocking."""
        _non_negative("bytes_moved", bytes_moved)
        _non_negative("pages_moved", pages_moved)
        _non_negative("duration_s", duration_s)
        _check_direction(direction)
        self._transfer_bytes.inc(direction, bytes_moved)
        self._transfer_pages.inc(direction, pages_moved)
        self._transfer_duration.observe_many(_LABEL[direction], (duration_s,))

    def record_batch_error(self, direction: Direction) -> None:
        """Count one failed copy batch. Non-blocking."""
        _pick(self._transfer_errors, direction, "direction").inc()

    # --- requests ------------------------------------------------------------------------------

    def record_request(
        self, direction: Direction, outcome: Outcome, *, latency_s: float, padding_bytes: int
    ) -> None:
        """Count one ended request, observe its submit-to-end latency, add its padding bytes.

        Non-blocking. ``padding_bytes`` is the part of the moved bytes that only padding to whole
        pages required (0 for page-aligned requests).
        """
        _non_negative("latency_s", latency_s)
        _non_negative("padding_bytes", padding_bytes)
        if not isinstance(outcome, Outcome):
            raise ConfigError(f"outcome={outcome!r} is not an Outcome member")
        _check_direction(direction)
        self._requests.inc((direction, outcome))
        self._request_latency.observe_many(_LABEL[direction], (latency_s,))
        self._padding_bytes.inc(direction, padding_bytes)

    def record_requests(self, direction: Direction, outcome: Outcome, latencies_s: list[float],
                        padding_bytes: int) -> None:
        """:meth:`record_request` for a batch of requests that ended alike. Non-blocking."""
        _non_negative("padding_bytes", padding_bytes)
        if not isinstance(outcome, Outcome):
            raise ConfigError(f"outcome={outcome!r} is not an Outcome member")
        _check_direction(direction)
        self._requests.inc((direction, outcome), len(latencies_s))
        self._request_latency.observe_many(_LABEL[direction], latencies_s)
        self._padding_bytes.inc(direction, padding_bytes)

    def set_queue_depth(self, direction: Direction, requests: int) -> None:
        """Set how many requests of ``direction`` are queued (accepted, not yet handed to the
        engine). Non-blocking."""
        _non_negative("requests", requests)
        _pick(self._queue_depth, direction, "direction").set(requests)

    def set_inflight_bytes(self, direction: Direction, nbytes: int) -> None:
        """Set how many bytes of ``direction`` requests are in the engine, not ended.
        Non-blocking."""
        _non_negative("nbytes", nbytes)
        _pick(self._inflight_bytes, direction, "direction").set(nbytes)

    def set_inflight_requests(self, direction: Direction, requests: int) -> None:
        """Set how many ``direction`` requests are in the engine, not ended. Non-blocking."""
        _non_negative("requests", requests)
        _pick(self._inflight_requests, direction, "direction").set(requests)

    # --- host pool -----------------------------------------------------------------------------

    def set_host_pool(
        self, *, used_bytes: int, free_bytes: int, in_flight_bytes: int, capacity_bytes: int
    ) -> None:
        """Set the host pool's bytes by state and its capacity. Non-blocking."""
        for name, value in (
            ("used_bytes", used_bytes),
            ("free_bytes", free_bytes),
            ("in_flight_bytes", in_flight_bytes),
            ("capacity_bytes", capacity_bytes),
        ):
            _non_negative(name, value)
        self._pool_bytes[PoolState.USED].set(used_bytes)
        self._pool_bytes[PoolState.FREE].set(free_bytes)
        self._pool_bytes[PoolState.IN_FLIGHT].set(in_flight_bytes)
        self._pool_capacity.set(capacity_bytes)

    def observe_pool_allocation(self, seconds: float) -> None:
        """Observe how long allocating and first-touching the host arenas took. Non-blocking."""
        _non_negative("seconds", seconds)
        self._pool_allocation.observe(seconds)

    # --- prefetch and loop ---------------------------------------------------------------------

    def record_prefetch_layers(
        self, timeliness: Timeliness, layers: int, *, waited_s: float | None = None
    ) -> None:
        """Count ``layers`` prefetched layers of one timeliness. Non-blocking.

        For ``Timeliness.LATE``, ``waited_s`` (how long the consumer waited for these layers) is
        observed into ``dsa_async_prefetch_wait_seconds``; it makes no sense for the other kinds
        and is refused there.
        """
        _non_negative("layers", layers)
        child = _pick(self._prefetch_layers, timeliness, "timeliness")
        if waited_s is not None:
            if timeliness is not Timeliness.LATE:
                raise ConfigError(
                    f"waited_s is only meaningful for Timeliness.LATE, got {timeliness!r}"
                )
            _non_negative("waited_s", waited_s)
            self._prefetch_wait.observe(waited_s)
        child.inc(layers)

    def observe_loop_lag(self, seconds: float) -> None:
        """Observe how late the event loop ran a timer. Non-blocking."""
        _non_negative("seconds", seconds)
        self._loop_lag.observe(seconds)
