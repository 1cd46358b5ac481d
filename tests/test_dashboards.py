"""Static checks of dashboards/: the Grafana dashboard, the scrape config and the alert rules."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_harness import (
    DASHBOARDS_DIR,
    dashboard_files,
    iter_panels,
    panel_queries,
    require_tool,
    run_tool,
)

from dsa_async.kinds import Backend
from dsa_async.observability.metrics import BudgetFigures, ServiceMetrics

DATASOURCE_PROVISIONING = DASHBOARDS_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
GRID_WIDTH = 24
METRIC_NAME = re.compile(r"\bdsa_async_[a-z0-9_]+\b")
#: A metric selector: the name followed by its label matchers.
SELECTOR = re.compile(r"\b(dsa_async_[a-z0-9_]+)(\{[^}]*\})?")
RANGE = re.compile(r"\[([^\]]+)\]")
ALLOWED_RANGES = {"$__rate_interval", "$__range"}


def provisioned_datasource_uid() -> str:
    uids = re.findall(r"^\s*uid:\s*['\"]?([\w-]+)['\"]?\s*$", DATASOURCE_PROVISIONING.read_text(), re.M)
    assert len(uids) == 1, f"expected one datasource uid in {DATASOURCE_PROVISIONING}, found {uids}"
    return uids[0]


def exported_sample_names() -> set[str]:
    registry = CollectorRegistry()
    ServiceMetrics(
        registry,
        version="0",
        backend=Backend.CPU,
        budget_reader=lambda: BudgetFigures(limit_bytes=1, reserved_bytes=0, available_bytes=1,
                                                   reserve_bytes=0, free_bytes=1),
    )
    names = set()
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def load(path: Path) -> dict:
    return json.loads(path.read_text())


DASHBOARDS = dashboard_files()
QUERIES = [q for path in DASHBOARDS for q in panel_queries(path)]


def test_the_repository_has_dashboards_with_queries():
    assert DASHBOARDS, f"no dashboards in {DASHBOARDS_DIR}"
    assert QUERIES


# --- dashboard structure --------------------------------------------------------------------------


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_json_file_is_a_plain_dashboard_model(path):
    dashboard = load(path)
    assert isinstance(dashboard, dict)
    assert "dashboard" not in dashboard, "store the dashboard model itself, not an API envelope"
    assert isinstance(dashboard.get("title"), str) and dashboard["title"]
    assert isinstance(dashboard.get("uid"), str) and re.fullmatch(r"[\w-]{1,40}", dashboard["uid"])
    assert isinstance(dashboard.get("schemaVersion"), int) and dashboard["schemaVersion"] >= 36
    assert dashboard.get("panels"), "a dashboard without panels"


def test_dashboard_uids_are_unique():
    uids = [load(path)["uid"] for path in DASHBOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panel_ids_are_unique(path):
    ids = [panel["id"] for panel in iter_panels(load(path))]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), sorted(ids)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_fit_the_grid_and_do_not_overlap(path):
    cells: dict[tuple[int, int], int] = {}
    for panel in iter_panels(load(path)):
        grid = panel["gridPos"]
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        assert w > 0 and h > 0 and x >= 0 and y >= 0, panel["title"]
        assert x + w <= GRID_WIDTH, f"{panel['title']!r} is wider than the grid"
        for cx in range(x, x + w):
            for cy in range(y, y + h):
                other = cells.setdefault((cx, cy), panel["id"])
                assert other == panel["id"], f"panels {other} and {panel['id']} overlap at {(cx, cy)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_and_target_uses_the_provisioned_datasource(path):
    uid = provisioned_datasource_uid()
    dashboard = load(path)
    for panel in iter_panels(dashboard):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no queries"
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == uid, variable["name"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_job_and_instance_variables_come_from_build_info(path):
    variables = {v["name"]: v for v in load(path)["templating"]["list"]}
    assert variables["job"]["type"] == "query"
    assert variables["job"]["query"] == "label_values(dsa_async_build_info, job)"
    assert variables["instance"]["type"] == "query"
    assert variables["instance"]["query"] == 'label_values(dsa_async_build_info{job=~"$job"}, instance)'
    for variable in (variables["job"], variables["instance"]):
        assert variable["includeAll"] and variable["allValue"] == ".*"


def expected_unit(exprs: list[str]) -> set[str]:
    """The units a panel showing ``exprs`` may use."""
    joined = " ".join(exprs)
    if "histogram_quantile(" in joined:
        return {"s"}
    if "/ 1e9" in joined:
        return {"GBs"}
    names = set(METRIC_NAME.findall(joined))
    if names and all("_seconds_" in name for name in names):  # a mean: seconds sum / count
        return {"s"}
    if re.search(r"\)\s*/\s*\(?sum|\}\s*/\s*ignoring", joined):  # a ratio (the divisor may be
        # filtered to > 0, so that an idle pool or direction reads no value instead of NaN)
        return {"percentunit"}
    if "rate(" in joined:
        return {"reqps", "cps", "ops", "short"}
    if names and all("bytes" in name for name in names):
        return {"bytes", "decbytes"}
    return {"short", "none"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_time_byte_throughput_and_ratio_panels_carry_units(path):
    for panel in iter_panels(load(path)):
        if panel.get("type") == "row":
            continue
        exprs = [t["expr"] for t in panel["targets"]]
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit in expected_unit(exprs), f"{panel['title']!r}: unit {unit!r}"


# --- queries --------------------------------------------------------------------------------------


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_queries_use_only_metrics_the_service_exports(query):
    exported = exported_sample_names()
    names = set(METRIC_NAME.findall(query.expr))
    assert names, "a panel query that reads no dsa_async metric"
    assert names <= exported, sorted(names - exported)


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_every_selector_is_filtered_by_job_and_instance(query):
    for match in SELECTOR.finditer(query.expr):
        matchers = match.group(2) or ""
        assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, match.group(0)


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_range_vectors_follow_the_dashboard(query):
    ranges = set(RANGE.findall(query.expr))
    assert ranges <= ALLOWED_RANGES, ranges


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_queries_do_not_paper_over_missing_data(query):
    compact = re.sub(r"\s+", "", query.expr)
    assert "vector(" not in compact
    assert "oron(" not in compact
    assert not re.search(r"\bor\b", query.expr), "`or` fills gaps with other series"


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_aggregations_keep_job_and_instance(query):
    for grouping in re.findall(r"\bby\s*\(([^)]*)\)", query.expr):
        labels = {label.strip() for label in grouping.split(",")}
        assert {"job", "instance"} <= labels, grouping
    assert "without" not in query.expr


# --- Prometheus config and rules ------------------------------------------------------------------


def test_scrape_config_is_valid_and_finds_the_rules():
    promtool = require_tool("promtool")
    proc = run_tool([promtool, "check", "config", str(DASHBOARDS_DIR / "prometheus.yml")])
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, out
    assert "1 rule files found" in out, out


def test_scrape_config_targets_the_compose_service():
    text = (DASHBOARDS_DIR / "prometheus.yml").read_text()
    assert re.search(r"job_name:\s*dsa-async\s*$", text, re.M)
    assert '"dsa-async:9464"' in text
    assert re.search(r"^\s+scrape_interval:\s*5s\s*$", text, re.M)
    assert re.search(r"^rule_files:\s*\n\s*-\s*alerts\.yaml\s*$", text, re.M)


def test_alert_rules_are_valid():
    promtool = require_tool("promtool")
    proc = run_tool([promtool, "check", "rules", str(DASHBOARDS_DIR / "alerts.yaml")])
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_alert_rule_unit_tests_pass():
    promtool = require_tool("promtool")
    proc = run_tool([promtool, "test", "rules", str(DASHBOARDS_DIR / "alerts_test.yaml")])
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


@pytest.mark.parametrize(
    "original, broken",
    [
        # Rules that never fire on the firing cases.
        ("0.5 * dsa_async_host_budget_bytes", "0.2 * dsa_async_host_budget_bytes"),
        ("> 0.20", "> 0.50"),
        ("[5m:30s]) > 0", "[5m:30s]) > 5"),
        # ... or that miss requests the engine holds (only the loop's queue)
        ("(dsa_async_queue_depth + dsa_async_inflight_requests)", "(dsa_async_queue_depth)"),
        # ... or requests moving between the two (the sum's minimum, not the minimums' sum)
        ("min_over_time((dsa_async_queue_depth + dsa_async_inflight_requests)[5m:30s])",
         "(min_over_time(dsa_async_queue_depth[5m]) + min_over_time(dsa_async_inflight_requests[5m]))"),
        ("increase(dsa_async_transfer_errors_total[5m]) > 0", "increase(dsa_async_transfer_errors_total[5m]) > 5"),
        # Rules that also fire on the quiet cases.
        ("0.5 * dsa_async_host_budget_bytes", "0.99 * dsa_async_host_budget_bytes"),
        ("> 0.20", "> 0.05"),
        ("increase(dsa_async_requests_total[5m])) == 0", "increase(dsa_async_requests_total[5m])) >= 0"),
        ("increase(dsa_async_transfer_errors_total[5m]) > 0", "increase(dsa_async_transfer_errors_total[5m]) >= 0"),
    ],
)
def test_alert_rule_unit_tests_catch_a_changed_threshold(tmp_path, original, broken):
    promtool = require_tool("promtool")
    rules = (DASHBOARDS_DIR / "alerts.yaml").read_text()
    assert rules.count(original) == 1, original
    (tmp_path / "alerts.yaml").write_text(rules.replace(original, broken))
    shutil.copy(DASHBOARDS_DIR / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    proc = run_tool([promtool, "test", "rules", str(tmp_path / "alerts_test.yaml")])
    assert proc.returncode != 0, proc.stdout.decode()


def test_alert_rules_use_only_metrics_the_service_exports():
    rules = (DASHBOARDS_DIR / "alerts.yaml").read_text()
    exprs = "\n".join(re.findall(r"expr:\s*\|?\s*\n?((?:.+\n)+?)\s*(?:for|labels):", rules))
    names = set(METRIC_NAME.findall(exprs))
    assert len(names) >= 5, names
    assert names <= exported_sample_names(), sorted(names - exported_sample_names())


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_a_division_by_a_sum_reads_no_value_instead_of_nan_when_the_sum_is_zero(query):
    """An idle direction, a closed pool or a service with no prefetch yet divides 0 by 0: the
    divisor is filtered to > 0 so the panel shows no value, not a NaN line."""
    assert not re.search(r"/\s*sum\b", query.expr), query.expr
