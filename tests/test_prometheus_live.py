"""Every dashboard query, evaluated by a real Prometheus that scrapes a live metrics endpoint.

The metrics source is the ``metrics_target`` fixture: a real ``OffloadService`` on the CPU
backend under a small workload (see ``live_service.py``), serving ``/metrics`` on loopback.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterator

import pytest

from dsa_async.kinds import Direction
from live_service import live_service
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


@pytest.fixture
def metrics_target(tmp_path) -> Iterator[str]:
    """``host:port`` of a real OffloadService's ``/metrics`` under a CPU workload."""
    with live_service(tmp_path) as target:
        yield target


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
