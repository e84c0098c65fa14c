"""The cluster's one external configuration boundary: `ClusterConfig`, loaded from YAML/JSON or flags.

Everything past this module takes a validated `ClusterConfig` (or plain values taken from it).
Example (`specserve up --config cluster.yaml`):

    model: smollm2-135m
    draft: ngram
    kv_blocks: 512
    queue_capacity: 128
    grpc_port: 9000
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.serving.cpu_binding import AUTO_SERVICE_CPUS, CpuPlan, own_cpus, plan_cpus
from cluster.serving.cpu_quota import available_cpus
from model_runtime.graph.modes import CaptureSetting
from specserve_types.api import DRAFT_AUTO, MAX_TOKENS_LIMIT, TARGET_AUTO, ExactRule
from specserve_types.protocol import MAX_N, RequestLimits
from specserve_types.tracing import ENV_OTLP_ENDPOINT, OTEL_ENDPOINT_VARS, TracingSettings

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from cluster.engine.factory import LocalRuntime
    from cluster.engine.overlap_policy import OverlapDecision
    from cluster.serving.auth import KeySources
    from cluster.serving.client_shares import ClientLimits
    from model_runtime.graph.modes import CaptureSettings

__all__ = ["ENGINE_OPTIONS", "MODEL_FREE_DRAFTS", "NGRAM_DRAFT", "ClusterConfig", "ConfigError", "NodeSelector",
           "Placement", "load_config", "make_config"]

NGRAM_DRAFT = "ngram"  # `draft` value: n-gram (prompt lookup) drafting, no draft model
MODEL_FREE_DRAFTS = (NGRAM_DRAFT, "suffix")  # `draft` values without a draft model ("suffix": token trees)
# The fields a config file may also set under `engine_options:` (the older spelling, still accepted).
ENGINE_OPTIONS = ("k_max", "probe_every", "pressure_free_fraction", "drafter_retry_seconds",
                  "max_verifier_failures", "overlap", "predraft", "tree_nodes",
                  "model_tree_nodes")


class ConfigError(ValueError):
    """The config file or flags do not form a valid ClusterConfig."""


def _check_model_name(value: str) -> str:
    from model_runtime.registry import UnknownModelError, resolve_model

    try:
        resolve_model(value)
    except UnknownModelError as exc:
        raise ValueError(str(exc)) from None
    return value


RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # Ray's own: set from the config's sizes


class NodeSelector(BaseModel):
    """Which Ray nodes may host one part of the application (docs/ARCHITECTURE.md, "Multi-node placement").
    Empty: any node with room. Both kinds may be combined; the part goes only where both hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources the part asks for, e.g. {specserve-verifier: 1}: only a "
        "node that advertises them hosts it (`ray start --resources '{\"specserve-verifier\": 100}'`, a KubeRay "
        "group's `resources`); ask for a small share of what a node advertises")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node label selector, e.g. {specserve.io/role: verifier}: only a node "
        "with these labels hosts the part (`ray start --labels specserve.io/role=verifier`, a KubeRay group's "
        "`labels`; Ray's selector syntax: '!v' not v, 'in(a,b)')")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        reserved = sorted(set(value) & set(RESERVED_RESOURCES))
        if reserved:
            raise ValueError(f"{reserved} are Ray's own resources, set from the config's sizes; name custom ones")
        if any(amount <= 0 for amount in value.values()):
            raise ValueError(f"amounts must be > 0, got {value}")
        return value

    def actor_options(self) -> dict[str, Any]:
        """Ray actor options (Serve's ray_actor_options, an actor's .options): only what is set."""
        return ({"resources": dict(self.resources)} if self.resources else {}) | (
            {"label_selector": dict(self.labels)} if self.labels else {})


class Placement(BaseModel):
    """Where each part runs, by Ray node labels or custom resources (in production, KubeRay worker groups that
    advertise them). Unset parts go wherever Ray finds room."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ingress: NodeSelector = Field(default_factory=NodeSelector, description="the Ingress replicas (gRPC, HTTP): "
                                  "Serve's HTTP proxy runs on every node, the gRPC servers only where these are")
    scheduler: NodeSelector = Field(default_factory=NodeSelector, description="the Scheduler replica (the engine "
                                    "loop; n-gram and suffix drafts are made here)")
    kv_manager: NodeSelector = Field(default_factory=NodeSelector, description="the KV-manager actor (the block "
                                     "ledger), created by the scheduler")
    drafter: NodeSelector = Field(default_factory=NodeSelector, description="the Drafter replica (a draft model)")
    verifier: NodeSelector = Field(default_factory=NodeSelector, description="the Verifier replica; with TP > 1 its "
                                   "placement group's first bundle (the replica) and every rank without an entry "
                                   "in verifier_ranks")
    verifier_ranks: tuple[NodeSelector, ...] = Field((), description="TP > 1: one per rank (rank r's bundle), "
                                                     "or empty: every rank as `verifier`")

    def rank(self, index: int) -> NodeSelector:
        return self.verifier_ranks[index] if self.verifier_ranks else self.verifier


class ClusterConfig(BaseModel):
    """The whole Serve application: models, replicas, KV memory, admission, Serve health, ports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # models
    model: str = Field("qwen2.5-coder-1.5b", description="target model: registry name or HF checkpoint dir")
    draft: str = Field("qwen2.5-coder-0.5b", description="draft model name/dir, 'ngram' or 'suffix' (token trees)")
    device: str = Field("cpu", description="torch device of the drafter and verifier workers")
    dtype: Literal["auto", "float32", "bfloat16", "q4"] = Field(
        "auto", description=f"target model precision (auto: {TARGET_AUTO}); greedy output equals plain greedy "
                            "decoding of the same dtype")
    draft_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8", "q4"] = Field(
        "auto", description=f"draft model precision (auto: {DRAFT_AUTO}); changes acceptance, never the output")
    capture: CaptureSetting = Field(
        "auto", description="the workers' forward: off = the eager forward (the CPU's kernels); auto = CUDA graphs "
        "(cuda-graph) on a CUDA device for a one-rank float32/bfloat16 model, off elsewhere (the CPU's path never "
        "changes); or a mode of model_runtime/graph/capture.py, refused where it cannot run (a CUDA mode off CUDA, "
        "tensor_parallel_size > 1, q4/int8/float16 weights): each step padded to a bucket of max_batch x k_max + 1 "
        "rows x max_context, captured at the worker's start-up; a longer step (a prefill) runs the eager forward")

    # deployments
    ingress_replicas: int = Field(1, ge=1, le=64)
    scheduler_replicas: int = Field(1, ge=1, le=1, description="one engine loop owns the KV pools")
    drafter_replicas: int = Field(1, ge=1, le=1, description="draft KV pool lives in the replica")
    verifier_replicas: int = Field(1, ge=1, le=1, description="target KV pool lives in the replica")
    tensor_parallel_size: int = Field(1, ge=1, le=8, description="verifier TP ranks (gloo on CPU)")
    worker_threads: int = Field(0, ge=0, le=256,
                                description="torch threads per model process; 0 = the CPUs this process may use "
                                            "(affinity, capped by the cgroup CPU limit: a pod's limits.cpu) "
                                            "shared evenly among the model processes (TP ranks + drafter)")
    cpu_binding: Literal["auto", "on", "off"] = Field(
        "auto", description="on a local Ray node (started by specserve): each model process's compute thread on CPUs "
        "of its own, everything else on the rest (cluster/serving/cpu_binding.py). auto: the rest on CPUs of its own "
        f"only where at least {AUTO_SERVICE_CPUS} are left (a replacement replica then still starts on more than one "
        "core), else the compute threads pinned and the rest on every CPU; on: the rest kept off the compute CPUs "
        "wherever one CPU is left for it; off: nothing pinned")
    gpus_per_worker: float = Field(1.0, gt=0, le=1, description="CUDA only: GPUs per drafter replica and per "
                                   "verifier TP rank (0.5 lets a drafter share a TP=1 verifier's GPU)")

    # KV memory and admission
    kv_blocks: int | None = Field(1024, ge=8, le=1 << 22, description="blocks per KV pool (target and draft); "
                                  "null = enough for max_batch full contexts (see kv_pool_blocks)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    queue_capacity: int = Field(256, ge=1, le=100_000, description="requests admitted (waiting+running)")
    max_batch: int = Field(16, ge=1, le=4096, description="requests per engine round")
    max_context: int = Field(2048, ge=16, le=1 << 20, description="prompt + max_tokens limit (capped by the model)")
    # each client's share (an API key, or a connection where there are no keys; cluster/serving/client_shares.py):
    # past it a capacity refusal (429); a client holding nothing is always within it
    max_client_completions: int | None = Field(None, ge=1, le=100_000, description="completions one client may have "
                                               "in flight (null: half of queue_capacity)")
    max_client_tokens: int | None = Field(None, ge=1, le=1 << 40, description="prompt + n x max_tokens summed over "
                                          "one client's live requests (null: half of max_batch x max_context)")
    # what one request may ask (docs/api.md, "Limits"): more is refused at the front doors, the field named, before
    # anything is reserved or tokenized (specserve_types.protocol.RequestLimits)
    max_stop_strings: int = Field(64, ge=0, le=4096, description="stop strings a request (OpenAI allows 4)")
    max_stop_string_chars: int = Field(256, ge=1, le=1 << 16, description="characters of each stop string")
    max_stop_chars: int = Field(4096, ge=1, le=1 << 20, description="characters of a request's stop strings in all")
    max_messages: int = Field(2048, ge=1, le=1 << 20, description="messages of a chat request")
    max_request_tokens: int = Field(16384, ge=1, le=MAX_N * MAX_TOKENS_LIMIT, description="tokens a request may "
                                    "generate in all: n x max_tokens")
    tokenizer_threads: int = Field(1, ge=1, le=64, description="the scheduler's threads that tokenize prompts "
                                   "longer than a few KiB, the longest last (the shorter ones have a thread of "
                                   "their own): off its event loop")
    warm_up: bool = Field(True, description="before serving, time verify for k = 0..k_max and the draft step "
                                            "through the real round path, so auto speculation starts from measured "
                                            "costs (cluster/engine/warmup.py)")
    drafter_timeout_s: float = Field(5.0, gt=0, le=3600, description="a propose call unanswered this long counts "
                                     "as a drafter failure: plain decoding until the engine retries the drafter")
    kv_recovery_timeout_s: float = Field(120.0, gt=0, le=3600, description="how long a ledger call waits for a "
                                         "restarted KV-manager actor (its node lost: until Ray places it again) "
                                         "before the round fails; the new instance rebuilds the ledger from the "
                                         "scheduler's live state and the requests go on (docs/ARCHITECTURE.md §6)")
    round_transport: Literal["channel", "ray"] = Field(
        "channel", description="how the engine reaches the verifier, the drafter and the KV actor each round: "
        "'channel' = a direct socket per worker, endpoint and secret handed out through Ray "
        "(specserve_types/round_channel.py), and each request's chunks pushed from the scheduler to the ingress over a "
        "socket (cluster/serving/chunk_push.py); 'ray' = Serve handles and actor calls (1-10 ms more per hop) and "
        "every chunk through Serve's streaming call")

    # the engine's round (cluster/engine/engine.py); a config file may also set these under `engine_options:`
    k_max: int = Field(4, ge=0, le=64, description="largest k auto may pick (0: auto never speculates)")
    probe_every: int = Field(32, ge=1, le=1 << 20,
                             description="rounds of plain decoding before auto re-measures acceptance")
    pressure_free_fraction: float = Field(0.1, ge=0, le=1, description="while the target KV pool has less than this "
                                          "fraction free, auto caps k at 1 (and no reservation windows are held)")
    reservation_windows: bool = Field(True, description="serial rounds: the ledger call (last round's commit, next "
                                      "round's grant) runs beside the verify instead of before it "
                                      "(cluster/engine/held_commit.py)")
    drafter_retry_seconds: float = Field(5.0, ge=0, le=3600, description="wait before a failed drafter is tried "
                                         "again (doubling per consecutive failure, up to 32x)")
    max_verifier_failures: int = Field(20, ge=0, le=1 << 20,
                                       description="consecutive failed verify calls before the engine gives up")
    overlap: Literal["auto"] | bool = Field(
        "auto", description="run the drafter beside the verifier: auto = on where the two have devices of their own "
                            "(distinct GPUs, or CPU threads that fit the CPUs without sharing), off elsewhere; "
                            "true/false force it (cluster/engine/overlap_policy.py; the reason is in the stats)")
    predraft: bool = Field(False, description="under overlap, draft each request's next round during its verify "
                                              "(assuming its drafts are accepted) instead of ping-ponging two "
                                              "groups (cluster/engine/predraft.py)")
    tree_nodes: int = Field(16, ge=0, le=64, description="most nodes of a token tree drafted by `suffix` (0: chains "
                                                         "only); auto sizes each tree from the measured verify cost "
                                                         "and side-branch acceptance (cluster/engine/tree_policy.py)")
    draft_stop_below: float = Field(0.5, ge=0.0, le=1.0, description="auto, greedy, a draft model's chain: stop drafting "
                                    "after a token the draft gives less than this probability (its later drafts "
                                    "rarely survive; 0: always draft k); its tree: feed no level whose best path "
                                    "the draft gives less")
    model_tree_nodes: int = Field(0, ge=0, le=64, description="most nodes of a token tree drafted by the draft model "
                                  "(the likeliest continuations where it is unsure; 0: chains, the default until "
                                  "trees are measured to pay; serial step mode only)")
    draft_lookup: bool = Field(True, description="auto, a draft model's requests: a round whose n-gram lookup (the "
                               "latest match of its last tokens in its own prompt and output) is expected to give "
                               "more tokens a second than the draft model drafts the lookup's chain instead, at no "
                               "draft cost (each source's acceptance measured apart; cluster/engine/planner.py)")
    constrain_drafts: bool = Field(True, description="a draft model drafts a constrained request's chain under the "
                                   "request's constraint (its q masked along its own drafts, as the target's p is), "
                                   "so that it proposes no draft the constraint forbids; off: it drafts freely and "
                                   "the engine cuts what the constraint forbids (both exact: docs/exactness.md)")
    exact_rule: ExactRule = Field("block", description="the exact contract's rule for a sampled "
                                                  "chain: block verification (Sun et al. 2024: the same output "
                                                  "distribution, at least as many accepted drafts in expectation) "
                                                  "or token-by-token speculative sampling "
                                                  "(verifier_service/contracts.py)")

    # where each part runs (several Ray nodes; docs/ARCHITECTURE.md, "Multi-node placement")
    placement: Placement = Field(default_factory=Placement, description="Ray node labels / custom resources that "
                                 "place the ingress, scheduler, KV manager, drafter and each verifier TP rank")

    # Serve health checks and graceful shutdown (applied to every deployment)
    health_check_period_s: float = Field(10.0, gt=0, le=3600)
    health_check_timeout_s: float = Field(30.0, gt=0, le=3600)
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0, le=3600)
    graceful_shutdown_timeout_s: float = Field(20.0, gt=0, le=3600)
    request_timeout_s: float | None = Field(None, gt=0, description="end-to-end limit per request")
    retry_after_s: int = Field(1, ge=0, le=3600, description="the retry hint of a refusal for capacity "
                                                             "(HTTP Retry-After, gRPC retry-after metadata)")

    # traces (off unless an exporter is named; OTEL_EXPORTER_OTLP_* variables are honoured too)
    otlp_traces_endpoint: str | None = Field(None, description="OTLP collector: host:port (gRPC) or an "
                                                               "http(s)://.../v1/traces URL (HTTP/protobuf)")
    trace_file: str | None = Field(None, description="append every span as one JSON line to this file")
    trace_sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces sampled (parent-based: "
                                                                   "a caller's sampled traceparent decides)")

    # network
    # Serve's HTTP proxy and the ingress replicas' own gRPC servers (cluster/serving/grpc_server.py) bind `host`
    host: str = Field("127.0.0.1", description="address the HTTP proxy and the gRPC servers bind")
    grpc_port: int = Field(9000, ge=1, le=65535, description="the ingress replicas' gRPC port (SO_REUSEPORT)")
    http_port: int = Field(8000, ge=1, le=65535)
    dashboard_port: int = Field(8265, ge=1, le=65535)
    ray_address: str | None = Field(None, description="join this Ray cluster; None = start a local one")
    ray_num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local Ray (None = detect)")
    # Ray starts workers at niceness 15 so its own daemons stay responsive; our replicas are compute-bound
    # and, on a small machine, share the cores with those daemons: a local Ray's workers run at 0.
    worker_niceness: int = Field(0, ge=0, le=19, description="niceness of a local Ray's worker processes")

    # access (docs/security.md): API keys of both front doors, TLS of both front doors
    api_keys: tuple[SecretStr, ...] = Field((), description="API keys the front doors accept (HTTP Authorization: "
                                            "Bearer, gRPC authorization metadata); prefer api_key_file or the "
                                            "SPECSERVE_API_KEYS environment variable; none anywhere = open")
    api_key_file: str | None = Field(None, description="file of API keys, one a line (# comments); re-read when "
                                     "it changes (rotation); read by the ingress replicas")
    metrics_require_api_key: bool = Field(False, description="GET /metrics asks for a key too (else open, like "
                                          "/health and the gRPC health service)")
    tls_cert_file: str | None = Field(None, description="PEM certificate (chain) of both front doors: gRPC and "
                                      "Serve's HTTP proxy serve TLS only (with tls_key_file)")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")

    def request_limits(self) -> RequestLimits:
        """What one request may ask (the front doors refuse more, naming the field)."""
        return RequestLimits(max_context=self.max_context, max_stop_strings=self.max_stop_strings,
                             max_stop_string_chars=self.max_stop_string_chars, max_stop_chars=self.max_stop_chars,
                             max_messages=self.max_messages, max_request_tokens=self.max_request_tokens)

    def client_limits(self) -> ClientLimits:
        """What one client may hold at once (cluster/serving/client_shares.py), the defaults filled in."""
        from cluster.serving.client_shares import ClientLimits

        default = ClientLimits.defaults(self.queue_capacity, self.max_batch, self.max_context)
        return ClientLimits(self.max_client_completions or default.completions, self.max_client_tokens or default.tokens)

    def key_sources(self) -> KeySources:
        from cluster.serving.auth import KeySources

        return KeySources(tuple(key.get_secret_value() for key in self.api_keys), self.api_key_file)

    @property
    def uses_tls(self) -> bool:
        return self.tls_cert_file is not None

    def local_ray_env(self) -> None:
        """Environment a local Ray must see before it starts (read by its raylet)."""
        os.environ["RAY_worker_niceness"] = str(self.worker_niceness)

    @field_validator("model")
    @classmethod
    def _known_target(cls, value: str) -> str:
        if value in MODEL_FREE_DRAFTS:
            raise ValueError(f"{value!r} is a drafting mode, not a target model")
        return _check_model_name(value)

    @field_validator("draft")
    @classmethod
    def _known_draft(cls, value: str) -> str:
        return value if value in MODEL_FREE_DRAFTS else _check_model_name(value)

    @model_validator(mode="before")
    @classmethod
    def _lift_engine_options(cls, data: Any) -> Any:
        """`engine_options: {k_max: 2, overlap: true}` (the older spelling) sets the typed fields of those names."""
        if not isinstance(data, dict) or "engine_options" not in data:
            return data
        data = dict(data)
        options = data.pop("engine_options")
        if not isinstance(options, dict):
            raise ValueError(f"engine_options must be a mapping, got {type(options).__name__}")
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown} in engine_options; known: {sorted(ENGINE_OPTIONS)}")
        twice = sorted(set(options) & set(data))
        if twice:
            raise ValueError(f"{twice} set both as field(s) and in engine_options; set each once")
        return {**data, **options}

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError(f"must be 'cpu' or 'cuda' (one GPU per worker, assigned by Ray), got {value!r}")
        return value

    @field_validator("host")
    @classmethod
    def _nonempty_host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be non-empty")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        ports = {"grpc_port": self.grpc_port, "http_port": self.http_port, "dashboard_port": self.dashboard_port}
        if len(set(ports.values())) != len(ports):
            raise ValueError(f"ports must differ: {ports}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        ranks = len(self.placement.verifier_ranks)
        if ranks not in (0, self.tensor_parallel_size):
            raise ValueError(f"placement.verifier_ranks names {ranks} ranks; tensor_parallel_size is "
                             f"{self.tensor_parallel_size} (one entry per rank, or none)")
        if self.max_batch > self.queue_capacity:
            raise ValueError(f"max_batch ({self.max_batch}) must be <= queue_capacity ({self.queue_capacity})")
        self._check_capture()
        return self

    def _check_capture(self) -> None:
        """A capture mode each worker can run (model_runtime/graph/modes.py); an auto precision is checked once the
        worker resolves it."""
        from model_runtime.graph.modes import capture_mode

        capture_mode(self.capture, self.device, self.tensor_parallel_size, self.dtype)
        if self.uses_draft_model:
            capture_mode(self.capture, self.device, 1, self.draft_dtype)

    @property
    def uses_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def threads_per_worker(self) -> int:
        """Torch threads per model process (each verifier TP rank, the drafter). Oversubscribing a CPU with
        several 'all cores' torch processes collapses throughput, so the cores are shared among the processes
        that compute at the same time: the ranks, plus the drafter only under overlap (otherwise it drafts
        while the verifier waits for its drafts). The CPUs are this process's: its affinity capped by the cgroup
        quota (cluster/serving/cpu_quota.py), not os.cpu_count()'s node cores; evaluated where the app is built."""
        if self.worker_threads > 0:
            return self.worker_threads
        drafting_beside = self.uses_draft_model and self.overlap_decision(in_process=False).enabled
        concurrent = self.tensor_parallel_size + (1 if drafting_beside else 0)
        return max(1, available_cpus() // concurrent)

    def cpu_plan(self) -> CpuPlan | None:
        """The CPUs of a local Ray node this process starts (cluster/serving/cpu_binding.py): None when binding is
        off, on GPUs, where the CPUs are not this process's to give, or when the model threads need them all."""
        cpus = own_cpus() if self.cpu_binding != "off" and not self.uses_gpu else None
        if cpus is None:
            return None
        threads = self.threads_per_worker
        beside = self.uses_draft_model and self.overlap_decision(in_process=False).enabled
        plan = plan_cpus(cpus, threads, self.tensor_parallel_size, threads if self.uses_draft_model else None,
                         beside)
        if plan is not None and self.cpu_binding == "auto" and len(plan.service) < AUTO_SERVICE_CPUS:
            return plan.sharing()
        return plan

    @property
    def uses_draft_model(self) -> bool:
        return self.draft not in MODEL_FREE_DRAFTS

    @property
    def kv_pool_blocks(self) -> int:
        """Blocks per KV pool: `kv_blocks`, or (None) enough for max_batch full contexts plus a margin."""
        if self.kv_blocks is not None:
            return self.kv_blocks
        return self.max_batch * (-(-self.max_context // self.block_size) + 1) + 16

    def overlap_decision(self, in_process: bool) -> OverlapDecision:
        """Whether the drafter runs beside the verifier, and why (cluster/engine/overlap_policy.py): in process
        (generate, bench spec) both share one process; in the cluster each model process has its own threads
        or GPU."""
        from cluster.engine.overlap_policy import Placement, decide_overlap

        return decide_overlap(self.overlap, Placement(
            in_process=in_process, draft_model=self.uses_draft_model, device=self.device,
            gpus_per_worker=self.gpus_per_worker, tensor_parallel_size=self.tensor_parallel_size,
            worker_threads=self.worker_threads, cpus=available_cpus()))

    def engine_config(self, in_process: bool = True) -> EngineConfig:
        """The engine's settings: in process (generate, bench, check), or the scheduler's (`in_process=False`)."""
        from cluster.engine.config import EngineConfig

        overlap = self.overlap_decision(in_process)

        return EngineConfig(
            max_batch=self.max_batch, max_waiting=self.queue_capacity, max_context=self.max_context,
            k_max=self.k_max, probe_every=self.probe_every, pressure_free_fraction=self.pressure_free_fraction,
            drafter_retry_seconds=self.drafter_retry_seconds, max_verifier_failures=self.max_verifier_failures,
            overlap=overlap.enabled, overlap_reason=overlap.reason, predraft=self.predraft,
            tree_nodes=self.tree_nodes, model_tree_nodes=self.model_tree_nodes,
            draft_stop_below=self.draft_stop_below, reservation_windows=self.reservation_windows,
            draft_lookup=self.draft_lookup, exact_rule=self.exact_rule, constrain_drafts=self.constrain_drafts,
        )

    def local_runtime(self) -> LocalRuntime:
        """What `build_local_engine` needs beyond engine_config(): KV pools, device, draft precision, warm-up."""
        from cluster.engine.factory import LocalRuntime

        return LocalRuntime(block_size=self.block_size, num_blocks=self.kv_pool_blocks, device=self.device,
                            dtype=self.dtype, draft_dtype=self.draft_dtype, warm_up=self.warm_up,
                            capture=self.capture)

    def capture_settings(self) -> CaptureSettings:
        """The Serve deployments' `capture`: each worker resolves it against its device, ranks and precision."""
        from model_runtime.graph.modes import CaptureSettings

        return CaptureSettings(self.capture, self.max_batch, self.k_max, self.max_context)

    def tracing_settings(self) -> TracingSettings:
        endpoint = self.otlp_traces_endpoint or next(
            (os.environ[v] for v in (ENV_OTLP_ENDPOINT, *OTEL_ENDPOINT_VARS) if os.environ.get(v)), None)
        return TracingSettings(endpoint, self.trace_file, self.trace_sample_ratio)

    def with_overrides(self, **overrides: Any) -> ClusterConfig:
        """A validated copy with the non-None `overrides` applied (command-line flags over the file)."""
        updates = {key: value for key, value in overrides.items() if value is not None}
        return _validate({**self.model_dump(), **updates}, source="flags")


def _validate(data: dict[str, Any], source: str) -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()
        )
        raise ConfigError(f"invalid cluster config ({source}): {problems}") from None


def make_config(source: str = "flags", **fields: Any) -> ClusterConfig:
    """Defaults, then exactly `fields` (a None sets None, e.g. kv_blocks=None); ConfigError names the field."""
    return _validate(fields, source)


def load_config(path: str | Path | None = None, **overrides: Any) -> ClusterConfig:
    """Defaults, then the YAML/JSON file at `path` (if any), then the non-None `overrides`."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        data = _parse(text, path)
    data.update({key: value for key, value in overrides.items() if value is not None})
    return _validate(data, source=str(path) if path is not None else "flags")


def _parse(text: str, path: Path) -> dict[str, Any]:
    import yaml  # YAML 1.2 is a superset of JSON: one parser for both

    try:
        parsed = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    if parsed is None:
        return {}
    if not isinstance(parsed, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(parsed).__name__}")
    return parsed
