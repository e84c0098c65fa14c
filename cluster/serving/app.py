"""The specserve Ray Serve application.

Graph: ingress(own gRPC server + HTTP via Serve's proxy) -> scheduler -> {drafter, verifier(TP ranks)}; scheduler <-> kv_manager actor

    Ingress    stateless front end: gRPC specserve.v1.SpecServe (through Serve's gRPC proxy) and the
               OpenAI-compatible HTTP API (FastAPI); validates, streams from the scheduler
    Scheduler  one engine loop (continuous batching, admission, cancellation); owns the KV manager
               actor (block ledger) and calls the workers once per round
    Drafter    the draft model and its KV pool (absent with `draft: ngram`: n-gram drafts in process)
    Verifier   the target model; TP > 1 = rank actors in the replica's placement group, rank 0 answers

`ClusterConfig` (cluster/serving/config.py) is the only configuration; everything here derives from it, where each
part runs included (`placement`: Ray node labels / custom resources; docs/ARCHITECTURE.md, "Multi-node placement").
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import HTTPOptions

from cluster.serving.config import ClusterConfig
from cluster.serving.cpu_binding import CpuPlan
from cluster.serving.ingress import IngressDeployment
from cluster.serving.scheduler import EngineBuilder, SchedulerDeployment
from drafter_service.deployment import DrafterDeployment
from verifier_service.deployment import VerifierDeployment, placement_bundles

__all__ = ["APP_NAME", "bind_drafter", "bind_verifier", "build_app", "deploy", "serve_options",
           "start_serve"]

APP_NAME = "specserve"
CONTROL_CALLS = 16  # stats / health calls a replica accepts on top of its generation streams
CONSTRUCTOR_RETRIES = 3  # a replica that cannot load its model fails the deploy soon, not after 20 tries


def _common_options(config: ClusterConfig) -> dict[str, Any]:
    return {
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": config.health_check_timeout_s,
        "graceful_shutdown_wait_loop_s": config.graceful_shutdown_wait_loop_s,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
    }


def _tracing_env(config: ClusterConfig) -> dict[str, Any]:
    """The workers' tracing settings (they get no ClusterConfig): environment variables of their processes."""
    env = config.tracing_settings().env()
    return {"runtime_env": {"env_vars": env}} if env else {}


def bind_verifier(config: ClusterConfig, cpu_plan: CpuPlan | None = None) -> serve.Application:
    """The Verifier; with TP > 1 its replica's placement group holds one bundle per rank. `cpu_plan`: its ranks'
    compute CPUs on a local node (cluster/serving/cpu_binding.py)."""
    options: dict[str, Any] = {"num_replicas": config.verifier_replicas, "max_ongoing_requests": 4,
                               **_common_options(config)}
    gpus = config.gpus_per_worker if config.uses_gpu else 0.0
    bundles = placement_bundles(config.tensor_parallel_size, gpus)
    placement = config.placement
    if bundles is None:  # TP = 1: the replica holds the model (and its GPU)
        options["ray_actor_options"] = {"num_cpus": 0, "num_gpus": gpus, **placement.verifier.actor_options(),
                                        **_tracing_env(config)}
    else:  # the replica only drives; rank r runs in bundle 1 + r, on the nodes placement.rank(r) names
        selectors = [placement.verifier] + [placement.rank(r) for r in range(config.tensor_parallel_size)]
        bundles = [bundle | dict(selector.resources) for bundle, selector in zip(bundles, selectors, strict=True)]
        options |= {"placement_group_bundles": bundles, "placement_group_strategy": "PACK",
                    "ray_actor_options": {"num_cpus": bundles[0]["CPU"], **_tracing_env(config)}}
        if placement.verifier.resources:  # the replica's own resources must fit its bundle (bundle 0)
            options["ray_actor_options"]["resources"] = dict(placement.verifier.resources)
        if any(selector.labels for selector in selectors):
            options["placement_group_bundle_label_selector"] = [dict(selector.labels) for selector in selectors]
    return VerifierDeployment.options(**options).bind(
        config.model, config.kv_pool_blocks, config.block_size, config.device, config.tensor_parallel_size,
        config.threads_per_worker, gpus, config.dtype, config.round_transport,
        cpu_plan.ranks if cpu_plan is not None else None, config.max_batch, config.capture_settings())


def bind_drafter(config: ClusterConfig, cpu_plan: CpuPlan | None = None) -> serve.Application | None:
    """The Drafter, or None with n-gram drafting (the engine drafts in the scheduler's process)."""
    if not config.uses_draft_model:
        return None
    return DrafterDeployment.options(
        num_replicas=config.drafter_replicas, max_ongoing_requests=4,
        ray_actor_options={"num_cpus": 0, "num_gpus": config.gpus_per_worker if config.uses_gpu else 0.0,
                           **config.placement.drafter.actor_options(), **_tracing_env(config)},
        **_common_options(config),
    ).bind(config.draft, config.kv_pool_blocks, config.block_size, config.device, config.threads_per_worker,
           config.draft_dtype, cpu_plan.drafter if cpu_plan is not None else None, config.capture_settings())


def build_app(config: ClusterConfig, engine_builder: EngineBuilder | None = None,
              cpu_plan: CpuPlan | None = None) -> serve.Application:
    """Bind the deployment graph (nothing starts until `serve.run`). `cpu_plan`: only for a local node this
    process started (`ClusterConfig.cpu_plan()`); None elsewhere (KubeRay: the workers' CPUs are not ours)."""
    common = _common_options(config)
    # Serve must never queue generation streams on its own: the scheduler refuses beyond
    # queue_capacity at once (RESOURCE_EXHAUSTED / 429), so Serve's limits sit above it.
    streams = config.queue_capacity + CONTROL_CALLS
    scheduler = SchedulerDeployment.options(
        num_replicas=config.scheduler_replicas, max_ongoing_requests=streams,
        ray_actor_options={"num_cpus": 0, **config.placement.scheduler.actor_options()}, **common,
    ).bind(config, bind_drafter(config, cpu_plan), bind_verifier(config, cpu_plan), engine_builder)
    return IngressDeployment.options(
        num_replicas=config.ingress_replicas, max_ongoing_requests=streams,
        ray_actor_options={"num_cpus": 0, **config.placement.ingress.actor_options()}, **common,
    ).bind(config, scheduler)


def serve_options(config: ClusterConfig) -> dict[str, Any]:
    """`serve.start` arguments: the HTTP proxy on `config.host`, HTTPS only with the config's certificate and
    key (uvicorn's ssl options, which Serve's proxy passes on). Serve's gRPC proxy stays off: the ingress replicas
    serve gRPC themselves (cluster/serving/grpc_service.py says why)."""
    return {"http_options": HTTPOptions(host=config.host, port=config.http_port,
                                        request_timeout_s=config.request_timeout_s,
                                        ssl_certfile=config.tls_cert_file, ssl_keyfile=config.tls_key_file)}


def start_serve(config: ClusterConfig) -> None:
    serve.start(**serve_options(config))


def deploy(config: ClusterConfig, engine_builder: EngineBuilder | None = None,
           cpu_plan: CpuPlan | None = None) -> serve.handle.DeploymentHandle:
    """Start Serve (proxies) and run the application; returns once every replica is up."""
    start_serve(config)
    return serve.run(build_app(config, engine_builder, cpu_plan), name=APP_NAME, route_prefix="/")
