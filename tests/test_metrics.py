"""The metric families: names, label sets, first-scrape completeness, semantics, lint, loop lag."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_harness import require_tool, run_tool

from dsa_async.errors import ConfigError
from dsa_async.kinds import Backend, BudgetKind, Direction, Outcome, PoolState, Timeliness
from dsa_async.observability.loop_lag import EventLoopLagMonitor
from dsa_async.observability.metrics import (
    DURATION_BUCKETS_S,
    BudgetFigures,
    ServiceMetrics,
)

DIRECTIONS = [{"direction": d.value} for d in Direction]

#: family sample name -> every label set that must exist before anything is observed.
EXPECTED_SERIES: dict[str, list[dict[str, str]]] = {
    "dsa_async_transfer_bytes_total": DIRECTIONS,
    "dsa_async_transfer_pages_total": DIRECTIONS,
    "dsa_async_requests_total": [
        {"direction": d.value, "outcome": o.value} for d in Direction for o in Outcome
    ],
    "dsa_async_padding_bytes_total": DIRECTIONS,
    "dsa_async_transfer_errors_total": DIRECTIONS,
    "dsa_async_transfer_duration_seconds_count": DIRECTIONS,
    "dsa_async_request_latency_seconds_count": DIRECTIONS,
    "dsa_async_queue_depth": DIRECTIONS,
    "dsa_async_inflight_bytes": DIRECTIONS,
    "dsa_async_inflight_requests": DIRECTIONS,
    "dsa_async_host_pool_bytes": [{"state": s.value} for s in PoolState],
    "dsa_async_host_pool_capacity_bytes": [{}],
    "dsa_async_host_budget_bytes": [{"kind": k.value} for k in BudgetKind],
    "dsa_async_pool_allocation_seconds_count": [{}],
    "dsa_async_prefetch_layers_total": [{"timeliness": t.value} for t in Timeliness],
    "dsa_async_prefetch_wait_seconds_count": [{}],
    "dsa_async_event_loop_lag_seconds_count": [{}],
    "dsa_async_build_info": [{"backend": "cpu", "version": "9.8.7"}],
}

HISTOGRAMS = [
    ("dsa_async_transfer_duration_seconds", DIRECTIONS),
    ("dsa_async_request_latency_seconds", DIRECTIONS),
    ("dsa_async_pool_allocation_seconds", [{}]),
    ("dsa_async_prefetch_wait_seconds", [{}]),
    ("dsa_async_event_loop_lag_seconds", [{}]),
]


class MutableBudget:
    """A budget reader whose figures the test changes between scrapes."""

    def __init__(self) -> None:
        self.figures = BudgetFigures(limit_bytes=16 << 30, reserved_bytes=4 << 30, available_bytes=12 << 30,
                                     reserve_bytes=1 << 30, free_bytes=13 << 30)
        self.calls = 0

    def __call__(self) -> BudgetFigures:
        self.calls += 1
        return self.figures


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def budget() -> MutableBudget:
    return MutableBudget()


@pytest.fixture
def metrics(registry: CollectorRegistry, budget: MutableBudget) -> ServiceMetrics:
    return ServiceMetrics(registry, version="9.8.7", backend=Backend.CPU, budget_reader=budget)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# --- first scrape -------------------------------------------------------------------------------


def test_every_series_exists_at_first_scrape(registry, metrics):
    for name, label_sets in EXPECTED_SERIES.items():
        for labels in label_sets:
            assert value(registry, name, **labels) is not None, (name, labels)


def test_every_histogram_has_every_bucket_from_10us_to_250s_at_first_scrape(registry, metrics):
    """Up to minutes: a request waiting on a producer or a drain (30 s by default) must not
    read as 10 s in every percentile."""
    assert DURATION_BUCKETS_S[0] == pytest.approx(1e-5)
    assert DURATION_BUCKETS_S[-1] == pytest.approx(250.0)
    assert list(DURATION_BUCKETS_S) == sorted(DURATION_BUCKETS_S)
    for name, label_sets in HISTOGRAMS:
        for labels in label_sets:
            for le in [*DURATION_BUCKETS_S, float("inf")]:
                le_text = "+Inf" if le == float("inf") else repr(float(le))
                assert value(registry, f"{name}_bucket", **labels, le=le_text) == 0.0, (name, le)


def test_no_family_outside_the_prefix_or_with_free_form_labels(registry, metrics):
    allowed_values = {
        "direction": {d.value for d in Direction},
        "outcome": {o.value for o in Outcome},
        "state": {s.value for s in PoolState},
        "kind": {k.value for k in BudgetKind},
        "timeliness": {t.value for t in Timeliness},
    }
    for family in registry.collect():
        assert family.name.startswith("dsa_async_")
        for sample in family.samples:
            for label, label_value in sample.labels.items():
                if label in ("le", "version", "backend"):
                    continue
                assert label_value in allowed_values[label], (sample.name, label)


def test_build_info_is_a_gauge_of_one_named_exactly_build_info(registry, metrics):
    text = generate_latest(registry).decode()
    assert "# TYPE dsa_async_build_info gauge" in text
    assert 'dsa_async_build_info{backend="cpu",version="9.8.7"} 1.0' in text.splitlines()
    assert "dsa_async_build_info_info" not in text


def test_exposition_passes_promtool_check_metrics(registry, metrics):
    promtool = require_tool("promtool")
    metrics.record_batch(Direction.H2D, bytes_moved=8448 * 16, pages_moved=16, duration_s=3e-4)
    metrics.record_request(Direction.H2D, Outcome.DONE, latency_s=1e-3, padding_bytes=0)
    proc = run_tool([promtool, "check", "metrics"], stdin=generate_latest(registry))
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_two_instances_on_one_registry_are_refused(registry, metrics, budget):
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        ServiceMetrics(registry, version="1", backend=Backend.CPU, budget_reader=budget)


# --- budget at scrape time ----------------------------------------------------------------------


def test_budget_is_read_at_scrape_time(registry, metrics, budget):
    calls_before = budget.calls
    assert value(registry, "dsa_async_host_budget_bytes", kind="available") == 12 << 30
    budget.figures = BudgetFigures(limit_bytes=8 << 30, reserved_bytes=7 << 30, available_bytes=0,
                                   reserve_bytes=400 << 20, free_bytes=300 << 20)
    assert value(registry, "dsa_async_host_budget_bytes", kind="limit") == 8 << 30
    assert value(registry, "dsa_async_host_budget_bytes", kind="reserved") == 7 << 30
    assert value(registry, "dsa_async_host_budget_bytes", kind="available") == 0
    assert value(registry, "dsa_async_host_budget_bytes", kind="reserve") == 400 << 20
    assert value(registry, "dsa_async_host_budget_bytes", kind="free") == 300 << 20
    assert budget.calls > calls_before


def test_a_failing_budget_reader_drops_only_that_family(registry, caplog):
    def broken() -> BudgetFigures:
        raise OSError("cgroup file vanished")

    metrics = ServiceMetrics(registry, version="1", backend=Backend.CUDA, budget_reader=broken)
    metrics.set_queue_depth(Direction.D2H, 3)
    with caplog.at_level(logging.ERROR, logger="dsa_async.metrics"):
        text = generate_latest(registry).decode()
    assert "dsa_async_host_budget_bytes{" not in text
    assert 'dsa_async_queue_depth{direction="d2h"} 3.0' in text
    assert "cgroup file vanished" in caplog.text


def test_registering_does_not_call_the_budget_reader(registry, budget):
    ServiceMetrics(registry, version="1", backend=Backend.CPU, budget_reader=budget)
    assert budget.calls == 0


# --- recording ----------------------------------------------------------------------------------


def test_record_batch_counts_bytes_pages_and_duration_per_direction(registry, metrics):
    metrics.record_batch(Direction.D2H, bytes_moved=8448 * 4, pages_moved=4, duration_s=2e-4)
    metrics.record_batch(Direction.D2H, bytes_moved=8448, pages_moved=1, duration_s=3e-5)
    assert value(registry, "dsa_async_transfer_bytes_total", direction="d2h") == 8448 * 5
    assert value(registry, "dsa_async_transfer_pages_total", direction="d2h") == 5
    assert value(registry, "dsa_async_transfer_duration_seconds_count", direction="d2h") == 2
    assert value(registry, "dsa_async_transfer_duration_seconds_sum", direction="d2h") == pytest.approx(2.3e-4)
    assert value(registry, "dsa_async_transfer_bytes_total", direction="h2d") == 0


def test_record_batch_error_counts_failed_batches(registry, metrics):
    metrics.record_batch_error(Direction.H2D)
    assert value(registry, "dsa_async_transfer_errors_total", direction="h2d") == 1
    assert value(registry, "dsa_async_transfer_errors_total", direction="d2h") == 0


def test_record_request_counts_outcome_latency_and_padding(registry, metrics):
    metrics.record_request(Direction.H2D, Outcome.CANCELLED, latency_s=0.5, padding_bytes=132 * 10)
    assert value(registry, "dsa_async_requests_total", direction="h2d", outcome="cancelled") == 1
    assert value(registry, "dsa_async_requests_total", direction="h2d", outcome="done") == 0
    assert value(registry, "dsa_async_request_latency_seconds_sum", direction="h2d") == 0.5
    assert value(registry, "dsa_async_padding_bytes_total", direction="h2d") == 1320


def test_gauges_take_the_last_value(registry, metrics):
    metrics.set_queue_depth(Direction.H2D, 7)
    metrics.set_queue_depth(Direction.H2D, 2)
    metrics.set_inflight_bytes(Direction.D2H, 1 << 20)
    metrics.set_inflight_requests(Direction.D2H, 4)
    metrics.set_host_pool(used_bytes=30, free_bytes=60, in_flight_bytes=10, capacity_bytes=100)
    assert value(registry, "dsa_async_queue_depth", direction="h2d") == 2
    assert value(registry, "dsa_async_inflight_bytes", direction="d2h") == 1 << 20
    assert value(registry, "dsa_async_inflight_requests", direction="d2h") == 4
    assert value(registry, "dsa_async_host_pool_bytes", state="used") == 30
    assert value(registry, "dsa_async_host_pool_bytes", state="free") == 60
    assert value(registry, "dsa_async_host_pool_bytes", state="in_flight") == 10
    assert value(registry, "dsa_async_host_pool_capacity_bytes") == 100


def test_pool_allocation_and_loop_lag_are_observed(registry, metrics):
    metrics.observe_pool_allocation(4e-5)
    metrics.observe_loop_lag(0.02)
    assert value(registry, "dsa_async_pool_allocation_seconds_count") == 1
    assert value(registry, "dsa_async_event_loop_lag_seconds_sum") == 0.02


def test_late_prefetch_layers_observe_the_wait(registry, metrics):
    metrics.record_prefetch_layers(Timeliness.ON_TIME, 58)
    metrics.record_prefetch_layers(Timeliness.LATE, 3, waited_s=0.004)
    metrics.record_prefetch_layers(Timeliness.WASTED, 61)
    assert value(registry, "dsa_async_prefetch_layers_total", timeliness="on_time") == 58
    assert value(registry, "dsa_async_prefetch_layers_total", timeliness="late") == 3
    assert value(registry, "dsa_async_prefetch_layers_total", timeliness="wasted") == 61
    assert value(registry, "dsa_async_prefetch_wait_seconds_count") == 1
    assert value(registry, "dsa_async_prefetch_wait_seconds_sum") == 0.004


def test_a_wait_on_a_layer_that_was_not_late_is_refused(registry, metrics):
    with pytest.raises(ConfigError, match="LATE"):
        metrics.record_prefetch_layers(Timeliness.ON_TIME, 1, waited_s=0.1)
    assert value(registry, "dsa_async_prefetch_layers_total", timeliness="on_time") == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.record_batch("d2h", bytes_moved=1, pages_moved=1, duration_s=0.0),
        lambda m: m.record_request(Direction.D2H, "done", latency_s=0.0, padding_bytes=0),
        lambda m: m.set_queue_depth("h2d", 1),
        lambda m: m.record_prefetch_layers("late", 1),
        lambda m: m.record_batch(Direction.D2H, bytes_moved=-1, pages_moved=1, duration_s=0.0),
        lambda m: m.set_host_pool(used_bytes=1, free_bytes=-1, in_flight_bytes=0, capacity_bytes=0),
    ],
)
def test_strings_and_negative_amounts_are_refused(metrics, call):
    with pytest.raises(ConfigError):
        call(metrics)


@pytest.mark.parametrize("backend", ["cpu", Backend.AUTO])
def test_backend_must_be_a_resolved_enum_member(registry, budget, backend):
    with pytest.raises(ConfigError, match="backend"):
        ServiceMetrics(registry, version="1", backend=backend, budget_reader=budget)


# --- event-loop lag -----------------------------------------------------------------------------


async def test_loop_lag_monitor_observes_a_blocked_loop(registry, metrics):
    monitor = EventLoopLagMonitor(metrics.observe_loop_lag, interval_s=0.01)
    async with asyncio.timeout(5):
        monitor.start()
        assert monitor.running
        await asyncio.sleep(0)  # let the monitor arm its first timer

        async def block_the_loop() -> None:
            time.sleep(0.2)  # deliberately blocks the loop thread: the lag under test

        await block_the_loop()
        await monitor.stop()
    assert not monitor.running
    assert value(registry, "dsa_async_event_loop_lag_seconds_sum") >= 0.15
    assert value(registry, "dsa_async_event_loop_lag_seconds_count") >= 1


async def test_loop_lag_monitor_stop_is_idempotent_and_restart_is_refused(metrics):
    monitor = EventLoopLagMonitor(metrics.observe_loop_lag)
    async with asyncio.timeout(5):
        await monitor.stop()  # never started: nothing to do
        monitor.start()
        with pytest.raises(RuntimeError, match="already started"):
            monitor.start()
        await monitor.stop()
        await monitor.stop()
    assert not monitor.running


async def test_cancelling_the_caller_of_stop_still_stops_the_monitor(metrics):
    monitor = EventLoopLagMonitor(metrics.observe_loop_lag, interval_s=0.01)
    async with asyncio.timeout(5):
        monitor.start()
        task = monitor._task
        stopper = asyncio.ensure_future(monitor.stop())
        await asyncio.sleep(0)  # stop() runs up to its wait for the monitor task
        stopper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopper
        await asyncio.wait({task})
    assert task.cancelled()


def test_interval_must_be_positive(metrics):
    with pytest.raises(ConfigError, match="interval_s"):
        EventLoopLagMonitor(metrics.observe_loop_lag, interval_s=0)
