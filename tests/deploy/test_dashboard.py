"""deploy/helm/tandem/dashboards/tandem.json: valid JSON, every query names metrics the
services export, and the chart ships it as a ConfigMap Grafana's sidecar picks up.

(tests/services/test_prometheus.py also runs every query against a real Prometheus.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.services.common.observe.metrics import metric_names
from tandem.services.controller.metrics import ControllerMetrics
from tests.deploy.helm import CHART, Helm, find, one

DASHBOARD = CHART / "dashboards" / "tandem.json"
METRIC = re.compile(r"\btandem_[a-z0-9_]+\b")


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text(encoding="utf-8")))


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's panels, rows left out (and a collapsed row's panels included)."""
    out = []
    for p in board["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the template variables' queries."""
    exprs = [t["expr"] for p in panels(board) for t in p["targets"]]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def exported_names() -> set[str]:
    """Every sample name the router, workers and controller expose, as in the exposition
    (histograms as _bucket/_sum/_count, counters with _total)."""
    names: set[str] = set()
    for component in ("router", "prefill", "decode"):
        names |= metric_names(component)
    return names | controller_names()


def controller_names() -> set[str]:
    """The controller's metrics, read from the registry services/controller/metrics.py builds
    (tandem.services.common.observe.metrics lists them too: the two must agree)."""
    metrics = ControllerMetrics("127.0.0.1", 0)
    try:
        names = {
            f"{family.name}_total" if family.type == "counter" else family.name
            for family in metrics.registry.collect()
        }
    finally:
        metrics.close()
    assert names == metric_names("controller")
    return names


def test_dashboard_is_valid_json_with_unique_ids_and_a_datasource_variable() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] == "Tandem"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels(board):
        assert p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        for target in p["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            # Every query is scoped to the chosen namespaces.
            for selector in re.findall(r"tandem_[a-z0-9_]+(\{[^}]*\})?", target["expr"]):
                assert selector.startswith('{namespace=~"$namespace"'), target["expr"]


def test_every_query_names_metrics_the_services_export() -> None:
    exported = exported_names()
    board = dashboard()
    used: set[str] = set()
    for expr in queries(board):
        names = set(METRIC.findall(expr))
        assert names, f"no tandem metric in {expr!r}"
        missing = sorted(names - exported)
        assert not missing, f"{expr!r} names metrics no service exports: {missing}"
        used |= names
        # Quantiles come from the rate of histogram buckets.
        if "histogram_quantile" in expr:
            assert re.search(r"rate\(tandem_[a-z0-9_]+_bucket\{", expr), expr

    # The panels the operators asked for are all there.
    for name in (
        "tandem_router_time_to_first_token_seconds_bucket",
        "tandem_router_inter_token_latency_seconds_bucket",
        "tandem_router_requests_total",
        "tandem_router_generation_tokens_total",
        "tandem_worker_kv_blocks_used",
        "tandem_worker_kv_blocks_capacity",
        "tandem_worker_prefix_cache_hit_tokens_total",
        "tandem_worker_prefix_cache_queried_tokens_total",
        "tandem_worker_kv_transfer_bytes_total",
        "tandem_worker_kv_transfers_total",
        "tandem_router_recoveries_total",
        "tandem_router_routing_decisions_total",
        "tandem_controller_replicas",
        "tandem_controller_decisions_total",
    ):
        assert name in used, name


@pytest.mark.parametrize("metric", ["time_to_first_token", "inter_token_latency"])
def test_latency_panels_show_p50_p90_p99_by_path(metric: str) -> None:
    (panel,) = [p for p in panels(dashboard()) if any(metric in t["expr"] for t in p["targets"])]
    assert [t["expr"].split(",")[0] for t in panel["targets"]] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.9",
        "histogram_quantile(0.99",
    ]
    for target in panel["targets"]:
        assert "sum by (le, path)" in target["expr"]
        assert "{{path}}" in target["legendFormat"]
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_the_chart_ships_the_dashboard_as_a_labelled_config_map(helm: Helm, tmp_path: Path) -> None:
    objects = helm.render()
    config_map = one(objects, "ConfigMap", "tandem-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in config_map["metadata"]
    (key,) = config_map["data"]
    assert key.endswith(".json")
    assert json.loads(config_map["data"][key]) == dashboard()

    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "grafanaDashboard": {
                    "labels": {"grafana_dashboard": "tandem"},
                    "annotations": {"grafana_folder": "Serving"},
                }
            }
        )
    )
    config_map = one(helm.render("-f", str(values)), "ConfigMap", "tandem-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "tandem"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Serving"}

    objects = helm.render("--set", "grafanaDashboard.enabled=false")
    assert [o for o in find(objects, "ConfigMap") if "dashboard" in o["metadata"]["name"]] == []
