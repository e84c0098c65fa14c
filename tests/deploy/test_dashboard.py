"""The Grafana dashboard (deploy/components/monitoring/grafana-dashboard.json): valid, laid out, and querying only
metrics the application exports (cluster/serving/metrics.py, as its /metrics names them) and deploy/README.md lists."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.deploy.rendering import DEPLOY

DASHBOARD = DEPLOY / "components" / "monitoring" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
METRIC_NAME = re.compile(r"\b((?:vllm:|specserve_)[a-zA-Z0-9_:]*)")


def exported() -> set[str]:
    """The series names the application's /metrics carries (prometheus_client's suffixes per kind)."""
    from cluster.serving.metrics import DEFINITIONS

    return {name + suffix for name, (kind, *_rest) in DEFINITIONS.items() for suffix in SUFFIXES[kind]}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(board: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def test_dashboard_reads_exported_metrics() -> None:
    board = dashboard()
    used = {name for expr in expressions(board) for name in METRIC_NAME.findall(expr)}
    assert used and used <= exported(), used - exported()
    readme = (DEPLOY / "README.md").read_text()
    for name in used:
        assert name.removesuffix("_bucket") in readme, name
    assert {"vllm:spec_decode_num_accepted_tokens_per_pos_total", "specserve_kv_blocks",
            "specserve_fallback_events_total", "specserve_time_to_first_token_seconds_bucket",
            "specserve_time_per_output_token_seconds_bucket", "specserve_generation_tokens_total"} <= used
    for expr in expressions(board):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert 'ray_io_cluster=~"$cluster"' in expr, expr  # every panel follows the cluster picker
        assert not re.search(r"[^{]\bnamespace\b", expr.replace("kv_namespace", "")), expr  # see the PodMonitor


def test_dashboard_variables_and_layout() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["cluster"]["includeAll"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, panel["title"]  # no two panels overlap
        cells |= area
        assert panel["datasource"]["uid"] == "${datasource}"
    titles = " ".join(panel["title"] for panel in board["panels"]).lower()
    for topic in ("acceptance rate per draft position", "throughput", "time to first token", "inter-token latency",
                  "kv", "fallback"):
        assert topic in titles, topic
