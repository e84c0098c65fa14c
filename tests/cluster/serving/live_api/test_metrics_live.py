"""Metrics of the live cluster: `GET /metrics` parsed with prometheus_client's parser; the vLLM counters move by
exactly the sums of the per-request figures of known requests (gRPC and HTTP); Ray's own metrics endpoint
lists the application's metric names."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.client import SpecServeClient
from cluster.engine.request_span import summed_speculation
from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import BASE_URL, wait_idle

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
         "def fibonacci(n):"
VLLM = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total")


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = requests.get(f"{BASE_URL}/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def delta(after: dict, before: dict, name: str, labels: tuple = ()) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def test_vllm_counters_move_by_the_per_request_figures(cluster: ClusterConfig, client: SpecServeClient) -> None:
    wait_idle()
    before = scrape()
    finals: list[dict[str, Any]] = []
    for k, draft in ((3, "ngram"), (2, "model"), (None, "model")):
        chunks = list(client.generate(PROMPT, max_tokens=24, k=k, draft=draft, ignore_eos=True))
        finals.append(chunks[-1].chunk.stats)
    body = requests.post(f"{BASE_URL}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 12, "k": 4, "draft": "ngram", "n": 2}).json()
    finals.extend(body["specserve"]["stats"])
    assert body["metrics"]["speculative_decoding"] == summed_speculation(body["specserve"]["stats"])
    wait_idle()
    after = scrape()

    spec = summed_speculation(finals)
    assert spec["num_accepted_draft_tokens"] > 0
    assert delta(after, before, VLLM[0]) == spec["num_spec_steps"]
    assert delta(after, before, VLLM[1]) == spec["num_draft_tokens"]
    assert delta(after, before, VLLM[2]) == spec["num_accepted_draft_tokens"]
    positions = sum(delta(after, before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))
                    for p in range(8))
    assert positions == spec["num_accepted_draft_tokens"]
    assert delta(after, before, "specserve_requests_total", (("finish_reason", "length"),)) == len(finals)
    assert delta(after, before, "specserve_generation_tokens_total") == sum(s["output_tokens"] for s in finals)
    assert delta(after, before, "specserve_time_to_first_token_seconds_count") == len(finals)
    assert after[("specserve_running_requests", ())] == 0
    assert ("specserve_kv_blocks", (("namespace", "verifier/target"), ("state", "free"))) in after


def test_ray_metrics_endpoint_lists_the_application_metrics(cluster: ClusterConfig) -> None:
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = {"ray_specserve_spec_decode_num_drafts", "ray_specserve_spec_decode_num_accepted_tokens_per_pos",
              "ray_specserve_requests", "ray_specserve_kv_blocks"}
    deadline, names = time.monotonic() + 60, set()
    while time.monotonic() < deadline:  # Ray's agents export on their own period
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        names = {family.name for family in text_string_to_metric_families(text)}
        if wanted <= names:
            return
        time.sleep(2)
    raise AssertionError(f"missing from Ray's metrics: {sorted(wanted - names)}; "
                         f"specserve ones seen: {sorted(n for n in names if 'specserve' in n)}")
