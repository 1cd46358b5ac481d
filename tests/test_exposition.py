"""Serving the registry: the standalone HTTP server and the ASGI app."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from dsa_async.kinds import Backend, Direction
from dsa_async.observability.exposition import MetricsServer, make_asgi_app, start_metrics_server
from dsa_async.observability.metrics import BudgetFigures, ServiceMetrics


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(
        registry,
        version="0.0.test",
        backend=Backend.CPU,
        budget_reader=lambda: BudgetFigures(limit_bytes=100, reserved_bytes=40, available_bytes=60,
                                                   reserve_bytes=5, free_bytes=65),
    )
    metrics.set_queue_depth(Direction.H2D, 5)
    return registry


def fetch(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback only
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def test_standalone_server_serves_the_registry_on_a_free_loopback_port(registry):
    server = start_metrics_server(registry, port=0)
    try:
        assert isinstance(server, MetricsServer)
        assert server.host == "127.0.0.1"
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        status, content_type, body = fetch(server.url)
    finally:
        server.close()
    assert status == 200
    assert content_type.startswith("text/plain")
    assert 'dsa_async_queue_depth{direction="h2d"} 5.0' in body
    assert 'dsa_async_host_budget_bytes{kind="available"} 60.0' in body
    assert 'dsa_async_build_info{backend="cpu",version="0.0.test"} 1.0' in body


def test_close_stops_the_server_joins_its_thread_and_frees_the_port(registry):
    with start_metrics_server(registry, port=0) as server:
        assert server.running
        url = server.url
    assert not server.running
    with pytest.raises(OSError):
        fetch(url)
    server.close()  # idempotent
    # The port can be bound again right away.
    again = start_metrics_server(registry, port=server.port)
    again.close()


def test_binding_a_busy_port_raises_at_start(registry):
    with start_metrics_server(registry, port=0) as server:
        with pytest.raises(OSError):
            start_metrics_server(registry, port=server.port)


def test_ipv6_hosts_are_bracketed_in_the_url(registry):
    server = MetricsServer(host="::1", port=9464, _httpd=None, _thread=None)  # type: ignore[arg-type]
    assert server.url == "http://[::1]:9464/metrics"


async def test_asgi_app_answers_with_the_exposition(registry):
    app = make_asgi_app(registry)
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/metrics",
        "query_string": b"",
        "headers": [(b"accept", b"text/plain")],
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    async with asyncio.timeout(5):
        await app(scope, receive, send)

    start, body = sent
    assert start["type"] == "http.response.start"
    assert start["status"] == 200
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    assert headers["content-type"].startswith("text/plain")
    text = body["body"].decode()
    assert body["type"] == "http.response.body"
    assert 'dsa_async_queue_depth{direction="h2d"} 5.0' in text
    assert 'dsa_async_host_budget_bytes{kind="limit"} 100.0' in text
