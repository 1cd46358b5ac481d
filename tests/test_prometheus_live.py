"""Every dashboard query, evaluated by a real Prometheus that scrapes a live metrics endpoint.

The metrics source is the ``metrics_target`` fixture: any ``host:port`` serving ``/metrics`` with
data flowing. Today it drives ``ServiceMetrics`` from a background thread; the queries and checks
do not depend on where the data comes from.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from dsa_async.exposition import start_metrics_server
from dsa_async.kinds import Backend, Direction, Outcome, Timeliness
from dsa_async.metrics import BudgetFigures, ServiceMetrics
from prometheus_harness import (
    SCRAPE_INTERVAL_S,
    PanelQuery,
    PrometheusHarness,
    dashboard_files,
    panel_queries,
    require_tool,
    run_tool,
    substitute_grafana_variables,
)

#: Grafana's $__rate_interval for a 1 s scrape interval: max(interval + scrape, 4 * scrape).
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"
DASHBOARD_RANGE = "1m"
TEST_BUDGET_S = 40.0
FEED_PERIOD_S = 0.01
PAGE_BYTES = 8448 * 61


def _feed(metrics: ServiceMetrics, stop: threading.Event) -> None:
    """Record a little of everything every FEED_PERIOD_S, so every panel has data."""
    tick = 0
    outcomes = list(Outcome)
    budget_used = 0
    while not stop.wait(FEED_PERIOD_S):  # the feed's pace, not a wait for a condition
        tick += 1
        for direction in Direction:
            pages = 1 + tick % 16
            metrics.record_batch(
                direction, bytes_moved=pages * PAGE_BYTES, pages_moved=pages, duration_s=pages * 2e-5
            )
            metrics.record_request(
                direction,
                outcomes[tick % len(outcomes)],
                latency_s=1e-4 * (1 + tick % 50),
                padding_bytes=(tick % 4) * 132 * 61,
            )
            metrics.set_queue_depth(direction, tick % 7)
            metrics.set_inflight_bytes(direction, (tick % 5) * PAGE_BYTES)
            if tick % 25 == 0:
                metrics.record_batch_error(direction)
        budget_used = (budget_used + PAGE_BYTES) % (64 * PAGE_BYTES)
        metrics.set_host_pool(
            used_bytes=budget_used,
            free_bytes=64 * PAGE_BYTES - budget_used,
            in_flight_bytes=PAGE_BYTES,
            capacity_bytes=64 * PAGE_BYTES,
        )
        metrics.observe_pool_allocation(3e-5)
        metrics.record_prefetch_layers(Timeliness.ON_TIME, 55)
        metrics.record_prefetch_layers(Timeliness.LATE, 4, waited_s=2e-4 * (1 + tick % 10))
        metrics.record_prefetch_layers(Timeliness.WASTED, 2)
        metrics.observe_loop_lag(1e-4 * (1 + tick % 30))


@pytest.fixture
def metrics_target() -> Iterator[str]:
    """``host:port`` of a live ``/metrics`` endpoint whose every series keeps moving."""
    registry = CollectorRegistry()
    metrics = ServiceMetrics(
        registry,
        version="0.0.live",
        backend=Backend.CPU,
        budget_reader=lambda: BudgetFigures(
            limit_bytes=16 << 30, reserved_bytes=6 << 30, available_bytes=10 << 30
        ),
    )
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(metrics, stop), name="metrics-feed", daemon=True)
    server = start_metrics_server(registry, host="127.0.0.1", port=0)
    try:
        feeder.start()
        yield f"127.0.0.1:{server.port}"
    finally:
        stop.set()
        feeder.join(5)
        server.close()


QUERIES = [q for path in dashboard_files() for q in panel_queries(path)]


def concrete(expr: str, prom: PrometheusHarness) -> str:
    """``expr`` with the dashboard variables set to the scraped target and the test's intervals."""
    return substitute_grafana_variables(
        expr,
        job=prom.target.job,
        instance=prom.target.instance,
        rate_interval=RATE_INTERVAL,
        range_=DASHBOARD_RANGE,
    )


def problems_with(prom: PrometheusHarness, queries: list[PanelQuery]) -> list[str]:
    """Why each query fails the dashboard contract: no data, or series without job/instance."""
    problems = []
    for query in queries:
        expr = concrete(query.expr, prom)
        result = prom.query(expr)
        if not result:
            problems.append(f"{query}: empty result for {expr}")
        for series in result:
            labels = series["metric"]
            if labels.get("job") != prom.target.job or labels.get("instance") != prom.target.instance:
                problems.append(f"{query}: series {labels} lost the job/instance labels")
    return problems


def test_every_dashboard_query_returns_series_of_the_scraped_job(metrics_target):
    require_tool("prometheus")
    started = time.monotonic()
    with PrometheusHarness(metrics_target) as prom:
        job = prom.target.job
        # Rates need two samples inside the window: wait (bounded) until one is positive.
        prom.wait_until(
            f'rate(dsa_async_transfer_bytes_total{{job="{job}"}}[{RATE_INTERVAL}]) > 0', timeout_s=15
        )

        # What the $job and $instance variables would offer.
        assert job in prom.api("label/job/values", **{"match[]": "dsa_async_build_info"})
        instances = prom.api(
            "label/instance/values", **{"match[]": f'dsa_async_build_info{{job="{job}"}}'}
        )
        assert prom.target.instance in instances

        problems = problems_with(prom, QUERIES)
        assert not problems, "\n".join(problems)

        # The checks above do catch a query that drops the labels or reads nothing.
        controls = [
            PanelQuery("control", 0, "drops job", "A", "sum by (direction) (dsa_async_queue_depth{job=~\"$job\"})"),
            PanelQuery("control", 0, "no such metric", "A", "dsa_async_no_such_metric{job=~\"$job\"}"),
        ]
        assert len(problems_with(prom, controls)) == 3  # two label-less series, one empty result

        # Data is flowing: both directions move bytes at a finite, positive rate.
        (throughput,) = [q for q in QUERIES if q.panel_title == "Transfer throughput (GB/s)"]
        result = prom.query(concrete(throughput.expr, prom))
        assert {s["metric"]["direction"] for s in result} == {d.value for d in Direction}
        assert all(0 < float(s["value"][1]) < math.inf for s in result)
    assert time.monotonic() - started < TEST_BUDGET_S


def test_scraped_exposition_passes_promtool(metrics_target):
    promtool = require_tool("promtool")
    with urllib.request.urlopen(f"http://{metrics_target}/metrics", timeout=5) as resp:  # noqa: S310
        exposition = resp.read()
    proc = run_tool([promtool, "check", "metrics"], stdin=exposition)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
