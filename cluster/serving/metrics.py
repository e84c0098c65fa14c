"""The application's metrics: recorded once per engine step and per finished request, exposed twice.

    Prometheus text  `GET /metrics` on the HTTP ingress (prometheus_client, this registry), including vLLM's
                     speculative-decoding counters under vLLM's exact names, so `vllm bench serve` and vLLM
                     dashboards read our acceptance unchanged
    Ray metrics      ray.util.metrics (the Ray dashboard's metrics view and Ray's Prometheus endpoint), the
                     same figures under `specserve_*` names (Ray prefixes `ray_`)

The counters come from the same values as the per-request figures (RoundRecord = the round's chunk:
`proposed`, `accepted`), so `vllm:spec_decode_num_accepted_tokens_total` equals the sum of every request's
`num_accepted_draft_tokens`. A spec step (`num_drafts`) is a round whose drafter proposed at least one draft,
as the per-request `num_spec_steps`. `position` counts from 0 (vLLM's convention).

Owner: the Scheduler replica. `step` runs on the engine thread, `finished`/`set_gauges`/`text` on the event
loop; prometheus_client's metrics are thread-safe and Ray's record calls are too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.engine.step_record import Carrier, StepRecord

# GenAI semantic-convention bucket boundaries (gen_ai.server.* histograms), seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
PHASE_SPLIT = {"draft.propose": "draft", "verify.forward": "verify", "kv.reserve": "kv", "kv.commit": "kv"}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CLIENT_LABELS = 1024  # clients with refusal series of their own; the rest count as OTHER_CLIENTS
OTHER_CLIENTS = "other"

# name -> (kind, help, labels, buckets); prometheus name = key, Ray name = RAY_NAMES.get(key, key)
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...] | None]] = {
    "vllm:spec_decode_num_drafts": ("counter", "speculative steps (rounds that proposed drafts)", (), None),
    "vllm:spec_decode_num_draft_tokens": ("counter", "draft tokens proposed", (), None),
    "vllm:spec_decode_num_accepted_tokens": ("counter", "draft tokens accepted", (), None),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", "draft tokens accepted at each draft position "
                                                     "(0 = the first)", ("position",), None),
    "specserve_spec_decode_tree_nodes": ("counter", "token-tree nodes verified (suffix drafts; their depth counts "
                                         "as draft tokens)", (), None),
    "specserve_spec_decode_tree_accepted_tokens_per_rank": ("counter", "tree nodes accepted by sibling rank (0 = "
                                                            "the proposer's first choice)", ("rank",), None),
    "specserve_requests": ("counter", "finished completions by finish reason", ("finish_reason",), None),
    "specserve_prompt_tokens": ("counter", "prompt tokens of finished completions", (), None),
    "specserve_generation_tokens": ("counter", "tokens emitted", (), None),
    "specserve_fallback_events": ("counter", "engine fallback events by kind", ("reason",), None),
    "specserve_preemptions": ("counter", "requests preempted: for KV memory, or a slot yielded to another client",
                              (), None),
    "specserve_round_phase_seconds": ("counter", "time of the rounds' phases: draft, verify, kv, other",
                                      ("phase",), None),
    "specserve_rounds": ("counter", "engine steps that verified something", (), None),
    "specserve_queue_depth": ("gauge", "requests waiting for admission", (), None),
    "specserve_running_requests": ("gauge", "requests in the running batch", (), None),
    "specserve_speculation_k": ("gauge", "mean k of the last step's rounds", (), None),
    "specserve_kv_blocks": ("gauge", "KV blocks by namespace and state", ("namespace", "state"), None),
    "specserve_worker_busy_fraction": ("gauge", "share of round time the worker computed", ("worker",), None),
    # per client (cluster/serving/client_shares.py): the label is an API key's id or a connection's, never a key
    "specserve_client_completions": ("gauge", "completions in flight per client", ("client",), None),
    "specserve_client_tokens": ("gauge", "tokens in flight per client (prompt + n x max_tokens of its live "
                                "requests)", ("client",), None),
    "specserve_client_refusals": ("counter", "requests refused past a client's limit, by client and limit "
                                  "(completions, tokens)", ("client", "limit"), None),
    "specserve_time_to_first_token_seconds": ("histogram", "time to first token", (), TTFT_BUCKETS),
    "specserve_time_per_output_token_seconds": ("histogram", "time per output token after the first", (),
                                                TPOT_BUCKETS),
    "specserve_request_duration_seconds": ("histogram", "request duration, arrival to last token", (),
                                           DURATION_BUCKETS),
}
RAY_NAMES = {name: "specserve_" + name.removeprefix("vllm:") for name in DEFINITIONS if name.startswith("vllm:")}


class _Both:
    """One metric in the prometheus_client registry and, optionally, in Ray's metrics."""

    def __init__(self, name: str, registry: CollectorRegistry, ray_metrics: bool) -> None:
        kind, help_text, labels, buckets = DEFINITIONS[name]
        self.labels = labels
        if kind == "counter":
            self.prom: Any = Counter(name, help_text, labels, registry=registry)
        elif kind == "gauge":
            self.prom = Gauge(name, help_text, labels, registry=registry)
        else:
            self.prom = Histogram(name, help_text, labels, registry=registry, buckets=buckets)
        self.ray: Any = None
        if ray_metrics:
            from ray.util import metrics as ray_metrics_api

            ray_name = RAY_NAMES.get(name, name)
            if kind == "counter":
                self.ray = ray_metrics_api.Counter(ray_name, help_text, tag_keys=labels)
            elif kind == "gauge":
                self.ray = ray_metrics_api.Gauge(ray_name, help_text, tag_keys=labels)
            else:
                self.ray = ray_metrics_api.Histogram(ray_name, help_text, boundaries=list(buckets or ()),
                                                     tag_keys=labels)
        self.kind = kind

    def forget(self, **labels: str) -> None:
        """A gauge's series goes (Prometheus; Ray's is set to 0): labels of clients that come and go stay bounded."""
        try:
            self.prom.remove(*(labels[name] for name in self.labels))
        except KeyError:  # never set
            pass
        if self.ray is not None:
            self.ray.set(0, tags=labels)

    def add(self, value: float, **labels: str) -> None:
        if value == 0 and self.kind == "counter":
            return
        metric = self.prom.labels(**labels) if labels else self.prom
        if self.kind == "counter":
            metric.inc(value)
        elif self.kind == "gauge":
            metric.set(value)
        else:
            metric.observe(value)
        if self.ray is not None:
            if self.kind == "counter":
                self.ray.inc(value, tags=labels or None)
            elif self.kind == "gauge":
                self.ray.set(value, tags=labels or None)
            else:
                self.ray.observe(value, tags=labels or None)


class SpecMetrics:
    """An EngineObserver (`step`) plus the request- and pool-level figures the scheduler reports."""

    def __init__(self, ray_metrics: bool = True) -> None:
        self.registry = CollectorRegistry()
        self._m = {name: _Both(name, self.registry, ray_metrics) for name in DEFINITIONS}
        self._refused_clients: set[str] = set()  # the clients with a refusals series of their own

    def begin(self, record: StepRecord, traced: list[tuple[str, Carrier]]) -> None:
        """Metrics begin nothing (EngineObserver)."""

    def step(self, record: StepRecord) -> None:
        m = self._m
        drafted = [r for r in record.rounds if r.drafts_made > 0]
        m["vllm:spec_decode_num_drafts"].add(len(drafted))
        m["vllm:spec_decode_num_draft_tokens"].add(sum(r.proposed for r in drafted))
        m["vllm:spec_decode_num_accepted_tokens"].add(sum(r.accepted for r in drafted))
        for round_ in drafted:
            for position in range(round_.accepted):
                m["vllm:spec_decode_num_accepted_tokens_per_pos"].add(1, position=str(position))
            if round_.tree_nodes:  # a tree's position is its depth
                m["specserve_spec_decode_tree_nodes"].add(round_.tree_nodes)
                for rank in round_.accepted_ranks:
                    m["specserve_spec_decode_tree_accepted_tokens_per_rank"].add(1, rank=str(rank))
        m["specserve_generation_tokens"].add(sum(r.emitted for r in record.rounds))
        for kind in record.fallbacks:
            m["specserve_fallback_events"].add(1, reason=kind)
        m["specserve_preemptions"].add(sum(1 for r in record.rollbacks if r.reason.startswith("preempted")))
        if record.rounds:
            m["specserve_rounds"].add(1)
            m["specserve_speculation_k"].add(sum(r.k for r in record.rounds) / len(record.rounds))
            split = {"draft": 0.0, "verify": 0.0, "kv": 0.0}
            for phase in record.phases:
                if phase.name in PHASE_SPLIT and not phase.attributes.get("overlapped"):
                    split[PHASE_SPLIT[phase.name]] += (phase.end_ns - phase.start_ns) / 1e9
            split["other"] = max(0.0, (record.end_ns - record.start_ns) / 1e9 - sum(split.values()))
            for phase, seconds in split.items():
                m["specserve_round_phase_seconds"].add(seconds, phase=phase)

    def finished(self, stats: Mapping[str, Any] | None, finish_reason: str | None) -> None:
        """One completion's final chunk."""
        m = self._m
        m["specserve_requests"].add(1, finish_reason=finish_reason or "unknown")
        if not stats:
            return
        m["specserve_prompt_tokens"].add(int(stats.get("prompt_tokens", 0)))
        ttft, e2e, outputs = stats.get("ttft_seconds"), stats.get("e2e_seconds"), int(stats.get("output_tokens", 0))
        if ttft is not None:
            m["specserve_time_to_first_token_seconds"].add(float(ttft))
            if e2e is not None and outputs > 1:
                m["specserve_time_per_output_token_seconds"].add((float(e2e) - float(ttft)) / (outputs - 1))
        if e2e is not None:
            m["specserve_request_duration_seconds"].add(float(e2e))

    def set_gauges(self, engine_stats: Mapping[str, Any], kv_counts: Mapping[str, Mapping[str, int]]) -> None:
        m = self._m
        m["specserve_queue_depth"].add(int(engine_stats.get("waiting", 0)))
        m["specserve_running_requests"].add(int(engine_stats.get("running", 0)))
        for worker in ("drafter", "verifier"):
            m["specserve_worker_busy_fraction"].add(float(engine_stats.get(f"{worker}_busy_fraction", 0.0)),
                                                     worker=worker)
        for namespace, counts in kv_counts.items():
            for state in ("free", "reserved", "committed"):
                if state in counts:
                    m["specserve_kv_blocks"].add(int(counts[state]), namespace=namespace, state=state)

    def client_share(self, client: str, completions: int, tokens: int) -> None:
        """A client's completions and tokens in flight (its series go when it holds nothing)."""
        for name, value in (("specserve_client_completions", completions), ("specserve_client_tokens", tokens)):
            if completions or tokens:
                self._m[name].add(value, client=client)
            else:
                self._m[name].forget(client=client)

    def client_refused(self, client: str, limit: str) -> None:
        """A request refused past `limit` of its client's; at most MAX_CLIENT_LABELS clients get a series of their
        own (a connection's id is cheap to change), the rest count under "other"."""
        if client not in self._refused_clients:
            if len(self._refused_clients) >= MAX_CLIENT_LABELS:
                client = OTHER_CLIENTS
            else:
                self._refused_clients.add(client)
        self._m["specserve_client_refusals"].add(1, client=client, limit=limit)

    def text(self) -> bytes:
        """The registry in Prometheus text format (what `GET /metrics` answers)."""
        return generate_latest(self.registry)
