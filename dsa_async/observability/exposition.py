"""Serving a metrics registry over HTTP: a standalone server, or an ASGI app to mount.

Standalone (``dsa-async serve``, or a server without its own HTTP stack)::

    server = start_metrics_server(registry)            # http://127.0.0.1:9464/metrics
    ...
    server.close()

Embedded (the inference server already runs an ASGI app)::

    app.mount("/metrics", make_asgi_app(registry))

The standalone server listens on loopback unless told otherwise: exposing metrics to the network
(``host="0.0.0.0"``, as the container does) is an explicit choice of the caller.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry

__all__ = ["DEFAULT_METRICS_PORT", "MetricsServer", "make_asgi_app", "start_metrics_server"]

#: The port the container publishes and the scrape config targets.
DEFAULT_METRICS_PORT = 9464

_JOIN_TIMEOUT_S = 10.0

AsgiApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


@dataclass(frozen=True)
class MetricsServer:
    """A running standalone metrics server. ``close()`` stops it; usable as a context manager.

    ``host`` is the address it was asked to bind, ``port`` the port it actually bound (the free
    port the OS picked when asked for port 0).
    """

    host: str
    port: int
    _httpd: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        """The scrape URL, e.g. ``http://127.0.0.1:9464/metrics`` (IPv6 hosts in brackets)."""
        host = self.host
        try:
            if ipaddress.ip_address(host).version == 6:
                host = f"[{host}]"
        except ValueError:
            pass  # a host name, used as is
        return f"http://{host}:{self.port}/metrics"

    @property
    def running(self) -> bool:
        """Whether the serving thread is alive."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop serving, close the socket and join the serving thread. Idempotent.

        Blocks for up to about half a second (the serving loop's poll interval); a scrape still
        being answered finishes on its own daemon thread. Do not call it from the event-loop
        thread while the loop must stay responsive; use
        ``await loop.run_in_executor(None, server.close)`` there.
        """
        if self._thread.is_alive():
            self._httpd.shutdown()  # returns once serve_forever() has left its loop
        self._httpd.server_close()
        self._thread.join(_JOIN_TIMEOUT_S)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_metrics_server(
    registry: CollectorRegistry,
    host: str = "127.0.0.1",
    port: int = DEFAULT_METRICS_PORT,
) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    Binds and starts listening before it returns (so a bind error raises ``OSError`` here), then
    returns at once; scrapes are answered on the server's own threads and never touch the event
    loop. ``port=0`` lets the OS pick a free port; read it from the result's ``port``.
    """
    httpd, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    bound_port = int(httpd.server_address[1])
    return MetricsServer(host=host, port=bound_port, _httpd=httpd, _thread=thread)


def make_asgi_app(registry: CollectorRegistry) -> AsgiApp:
    """An ASGI app that answers every HTTP request with ``registry``'s exposition.

    Mount it at ``/metrics`` in the host server. The app renders the exposition inline on the
    event loop (it collects every metric, including the scrape-time budget read), which takes a
    fraction of a millisecond for this registry.
    """
    return prometheus_client.make_asgi_app(registry=registry)
