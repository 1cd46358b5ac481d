"""The host-memory alert on a real service's figures: an auto-sized pool, which takes all the
budget a new pool could have, is the healthy steady state and must not alert; the rest of the
machine growing into the reserve must.

The service runs on a fake ``/proc`` (its pool's allocation is written into MemAvailable by hand,
as the kernel would), its budget figures are scraped from its registry, and ``promtool test
rules`` evaluates ``dashboards/alerts.yaml`` on them held for ten minutes.
"""

from __future__ import annotations

import shutil

import pytest
from fake_roots import GIB, MIB, make_root, write_meminfo
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_harness import DASHBOARDS_DIR, require_tool, run_tool
from service_fixtures import make_buffers

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer

MEM_TOTAL_BYTES = 2 * GIB
MEM_AVAILABLE_BYTES = 256 * MIB
RESERVE_BYTES = 32 * MIB
ALERT = "DsaAsyncHostReserveLow"


def budget_figures(service: OffloadService) -> dict[str, float]:
    text = generate_latest(service.registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name == "dsa_async_host_budget_bytes":
            return {s.labels["kind"]: s.value for s in family.samples}
    raise AssertionError(f"no dsa_async_host_budget_bytes in the scrape:\n{text}")


def alert_fires(tmp_path, figures: dict[str, float]) -> bool:
    """Whether the alert rules fire on ``figures`` held for ten minutes (promtool decides)."""
    promtool = require_tool("promtool")
    shutil.copy(DASHBOARDS_DIR / "alerts.yaml", tmp_path / "alerts.yaml")
    series = "\n".join(
        f"      - series: 'dsa_async_host_budget_bytes{{job=\"dsa-async\", instance=\"x:9464\", "
        f"kind=\"{kind}\"}}'\n        values: \"{value:.0f}x15\"" for kind, value in figures.items())
    (tmp_path / "case.yaml").write_text(
        "rule_files:\n  - alerts.yaml\nevaluation_interval: 1m\ntests:\n"
        "  - interval: 1m\n    input_series:\n" + series + "\n"
        f"    alert_rule_test:\n      - eval_time: 10m\n        alertname: {ALERT}\n"
        "        exp_alerts: []\n")
    proc = run_tool([promtool, "test", "rules", str(tmp_path / "case.yaml")])
    out = proc.stdout.decode() + proc.stderr.decode()
    if proc.returncode == 0:
        return False  # quiet, as the case expects
    assert f'alertname="{ALERT}"' in out, out  # failed for another reason than a firing alert
    return True


@pytest.mark.asyncio
async def test_an_auto_sized_pool_is_quiet_and_the_reserve_eaten_alerts(tmp_path):
    root = make_root(tmp_path, mem_total_bytes=MEM_TOTAL_BYTES, mem_available_bytes=MEM_AVAILABLE_BYTES)
    geometry = dsa_indexer(num_layers=2)
    config = ServiceConfig(geometries=(geometry,), backend="cpu", host_pool=PoolSize.auto(),
                           budget_root=str(root), ledger_directory=str(tmp_path / "ledger"),
                           reserve_bytes=RESERVE_BYTES)
    async with OffloadService(config, make_buffers(geometry, 4)) as service:
        taken = service.host_pool.capacity_bytes
        assert MEM_AVAILABLE_BYTES - RESERVE_BYTES - taken < geometry.bytes_per_page  # took it all
        write_meminfo(root, mem_total_bytes=MEM_TOTAL_BYTES,  # the kernel's view once allocated
                      mem_available_bytes=(MEM_AVAILABLE_BYTES - taken) // 1024 * 1024)
        steady = budget_figures(service)
        assert steady["reserve"] == RESERVE_BYTES
        assert steady["available"] == max(0, steady["free"] - steady["reserve"]) < geometry.bytes_per_page
        assert RESERVE_BYTES - 1024 <= steady["free"] < RESERVE_BYTES + geometry.bytes_per_page
        assert not alert_fires(tmp_path, steady)

        # Something else on the machine takes three quarters of the reserve.
        write_meminfo(root, mem_total_bytes=MEM_TOTAL_BYTES,
                      mem_available_bytes=(MEM_AVAILABLE_BYTES - taken - RESERVE_BYTES * 3 // 4)
                      // 1024 * 1024)
        squeezed = budget_figures(service)
        assert squeezed["available"] == 0 and squeezed["free"] < RESERVE_BYTES / 2
        assert alert_fires(tmp_path, squeezed)
