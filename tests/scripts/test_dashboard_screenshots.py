"""scripts/dashboard_screenshots.py's checks on canned answers (no servers): the dashboard's REST answer
(`serve_applications.json`: GET /api/serve/applications/ from a `specserve up` with n-gram drafts, trimmed
of addresses and ids), Ray's Prometheus text, and the blank-screenshot test."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent.parent / "scripts" / "dashboard_screenshots.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard_screenshots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


script = load_script()
NGRAM_DEPLOYMENTS = script.expected_deployments("ngram")


@pytest.fixture
def answer() -> dict[str, Any]:
    return json.loads((HERE / "serve_applications.json").read_text())


def failed(findings: list[Any]) -> dict[str, str]:
    return {f.what: f.seen for f in findings if not f.ok}


def test_expected_deployments_follow_the_draft() -> None:
    assert NGRAM_DEPLOYMENTS == ["Ingress", "Scheduler", "Verifier"]
    assert script.expected_deployments("qwen2.5-coder-0.5b") == ["Ingress", "Scheduler", "Verifier", "Drafter"]


def test_a_running_application_passes(answer: dict[str, Any]) -> None:
    findings = script.check_serve_applications(answer, "specserve", NGRAM_DEPLOYMENTS)
    assert failed(findings) == {}
    assert [f.what for f in findings] == ["application specserve", *(f"deployment {n}" for n in NGRAM_DEPLOYMENTS)]
    assert findings[1].seen == "HEALTHY, 1/1 replicas RUNNING (states: ['RUNNING'])"


def test_an_application_still_deploying_fails(answer: dict[str, Any]) -> None:
    answer["applications"]["specserve"]["status"] = "DEPLOYING"
    assert failed(script.check_serve_applications(answer, "specserve", NGRAM_DEPLOYMENTS)) == {
        "application specserve": "DEPLOYING"}


def test_no_application_fails(answer: dict[str, Any]) -> None:
    assert failed(script.check_serve_applications(answer, "other", NGRAM_DEPLOYMENTS)) == {
        "application other": "not listed (applications: ['specserve'])"}
    assert failed(script.check_serve_applications({"applications": {}}, "specserve", NGRAM_DEPLOYMENTS)) == {
        "application specserve": "not listed (applications: none)"}


def test_a_missing_deployment_fails(answer: dict[str, Any]) -> None:
    findings = script.check_serve_applications(answer, "specserve", script.expected_deployments("a-draft-model"))
    assert list(failed(findings)) == ["deployment Drafter"]
    del answer["applications"]["specserve"]["deployments"]["Verifier"]
    assert list(failed(script.check_serve_applications(answer, "specserve", NGRAM_DEPLOYMENTS))) == [
        "deployment Verifier"]


@pytest.mark.parametrize("change", ["status", "replica_state", "no_replicas", "too_few_replicas"])
def test_an_unhealthy_deployment_fails(answer: dict[str, Any], change: str) -> None:
    scheduler = answer["applications"]["specserve"]["deployments"]["Scheduler"]
    if change == "status":
        scheduler["status"] = "UNHEALTHY"
    elif change == "replica_state":
        scheduler["replicas"][0]["state"] = "STARTING"
    elif change == "no_replicas":
        scheduler["replicas"] = []
    else:
        scheduler["target_num_replicas"] = 2
    assert list(failed(script.check_serve_applications(answer, "specserve", NGRAM_DEPLOYMENTS))) == [
        "deployment Scheduler"]


def test_an_unexpected_deployment_fails(answer: dict[str, Any]) -> None:
    deployments = answer["applications"]["specserve"]["deployments"]
    deployments["Drafter"] = copy.deepcopy(deployments["Verifier"]) | {"name": "Drafter"}
    assert failed(script.check_serve_applications(answer, "specserve", NGRAM_DEPLOYMENTS)) == {
        "unexpected deployments": "Drafter"}


RAY_TEXT = """\
# HELP ray_specserve_requests_total finished completions by finish reason
# TYPE ray_specserve_requests_total counter
ray_specserve_requests_total{Component="core_worker",finish_reason="length"} 4.0
ray_specserve_generation_tokens_total{Component="core_worker"} 136.0
ray_specserve_time_to_first_token_seconds_bucket{le="0.1"} 2.0
ray_specserve_time_to_first_token_seconds_sum 0.4
ray_specserve_time_to_first_token_seconds_count 5.0
ray_specserve_kv_blocks{namespace="target",state="free"} 1000.0
ray_node_cpu_utilization{instance="127.0.0.1"} 50.0
"""


def test_prometheus_metric_names_are_families() -> None:
    assert script.prometheus_metric_names(RAY_TEXT) == {
        "ray_specserve_requests", "ray_specserve_generation_tokens", "ray_specserve_time_to_first_token_seconds",
        "ray_specserve_kv_blocks", "ray_node_cpu_utilization"}


def test_ray_metrics_check_needs_every_required_family() -> None:
    names = script.prometheus_metric_names(RAY_TEXT)
    assert failed(script.check_ray_metrics(names)) == {}
    without_ttft = "\n".join(line for line in RAY_TEXT.splitlines() if "first_token" not in line)
    findings = script.check_ray_metrics(script.prometheus_metric_names(without_ttft))
    assert "missing ['ray_specserve_time_to_first_token_seconds']" in failed(findings)[findings[0].what]
    assert not script.check_ray_metrics({"ray_node_cpu_utilization"})[0].ok


def test_a_blank_screenshot_fails_and_a_drawn_one_passes(tmp_path: Path) -> None:
    from PIL import Image, ImageDraw

    blank = tmp_path / "blank.png"
    Image.new("RGB", (400, 300), "white").save(blank)
    assert not script.png_finding(blank, "blank").ok
    drawn = tmp_path / "drawn.png"
    image = Image.new("RGB", (400, 300), "white")
    draw = ImageDraw.Draw(image)
    for row in range(0, 300, 20):
        draw.text((10, row), "specserve Ingress HEALTHY 1/1", fill=(row % 256, 60, 120))
        draw.rectangle((300, row, 390, row + 12), fill=(20, 160, 60))
    image.save(drawn)
    finding = script.png_finding(drawn, "drawn")
    assert finding.ok, finding.seen
    assert not script.png_finding(tmp_path / "absent.png", "absent").ok
