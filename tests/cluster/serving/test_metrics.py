"""The metrics reconcile exactly with the per-request figures: the real engine over fake workers (model and
n-gram drafts, stops cutting accepted runs, an abort), SpecMetrics as its observer, the Prometheus text parsed
back with prometheus_client's own parser."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.request_span import summed_speculation
from cluster.serving.metrics import SpecMetrics
from tests.cluster.engine.engine_helpers import fake_engine, request


def scrape(metrics: SpecMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@pytest.mark.parametrize("overlap", [False, True])
def test_vllm_counters_equal_the_sums_of_the_per_request_figures(overlap: bool) -> None:
    metrics = SpecMetrics(ray_metrics=False)
    engine = fake_engine(max_batch=4, overlap=overlap, observer=metrics)
    requests = [request(f"m{i}", [3 + i, 5, 7, 11] * 3, max_tokens=9 + 5 * i, k=1 + i % 4) for i in range(6)]
    requests += [request(f"n{i}", [2, 4, 6, 8] * 4, max_tokens=12, k=3, draft="ngram") for i in range(2)]
    requests += [request("plain", [9, 9, 9], max_tokens=5, k=0)]
    for r in requests:
        engine.submit(r)
    first = engine.step()
    engine.abort("m5")
    chunks = engine.run_to_completion()
    for chunk in reversed(first):
        chunks[chunk.request_id].insert(0, chunk)
    finals = {}
    for rid, items in chunks.items():
        finals[rid] = items[-1]
        metrics.finished(items[-1].stats, items[-1].finish_reason)

    samples = scrape(metrics)
    spec = summed_speculation([c.stats for c in finals.values()])
    assert spec["num_draft_tokens"] > spec["num_accepted_draft_tokens"] > 0
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == spec["num_spec_steps"]
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == spec["num_draft_tokens"]
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == spec["num_accepted_draft_tokens"]
    per_position = {int(dict(labels)["position"]): value for (name, labels), value in samples.items()
                    if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    histogram = spec["acceptance_histogram"]  # steps that accepted exactly i drafts
    want = {p: sum(histogram[p + 1:]) for p in range(len(histogram) - 1)}
    assert per_position == {p: n for p, n in want.items() if n}
    assert sum(per_position.values()) == spec["num_accepted_draft_tokens"]
    emitted = sum(len(c.token_ids) for items in chunks.values() for c in items)
    assert samples[("specserve_generation_tokens_total", ())] == emitted
    reasons = Counter(c.finish_reason for c in finals.values())
    for reason, count in reasons.items():
        assert samples[("specserve_requests_total", (("finish_reason", reason),))] == count
    assert samples[("specserve_time_to_first_token_seconds_count", ())] == sum(
        1 for c in finals.values() if c.stats and c.stats["ttft_seconds"] is not None)
    assert {labels for name, labels in samples if name == "specserve_round_phase_seconds_total"} == {
        (("phase", p),) for p in ("draft", "verify", "kv", "other")}
    engine.check_ledger()


def test_gauges_take_the_engine_and_pool_figures() -> None:
    metrics = SpecMetrics(ray_metrics=False)
    metrics.set_gauges({"waiting": 3, "running": 2, "drafter_busy_fraction": 0.25, "verifier_busy_fraction": 0.5},
                       {"verifier/target": {"capacity": 10, "free": 6, "reserved": 1, "committed": 3, "cached": 0}})
    samples = scrape(metrics)
    assert samples[("specserve_queue_depth", ())] == 3 and samples[("specserve_running_requests", ())] == 2
    assert samples[("specserve_kv_blocks", (("namespace", "verifier/target"), ("state", "free")))] == 6
    assert samples[("specserve_worker_busy_fraction", (("worker", "verifier"),))] == 0.5


def test_tree_counters_equal_the_engines_tree_statistics() -> None:
    """Suffix trees: the nodes verified and the accepted nodes per sibling rank, as the engine counted them."""
    from tests.cluster.engine.test_trees import PROMPTS, walk_next

    metrics = SpecMetrics(ray_metrics=False)
    engine = fake_engine(max_batch=4, observer=metrics, target_rule=walk_next, tree_nodes=12)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(request(f"t{i}", prompt, max_tokens=40, k=4, draft="suffix"))
    engine.run_to_completion()
    samples = scrape(metrics)
    stats = engine.acceptance
    assert stats.tree_rounds > 0 and sum(stats.accepted_by_rank[1:]) > 0
    assert samples[("specserve_spec_decode_tree_nodes_total", ())] == stats.tree_nodes
    per_rank = {int(dict(labels)["rank"]): value for (name, labels), value in samples.items()
                if name == "specserve_spec_decode_tree_accepted_tokens_per_rank_total"}
    assert per_rank == {rank: n for rank, n in enumerate(stats.accepted_by_rank) if n}
    engine.check_ledger()
