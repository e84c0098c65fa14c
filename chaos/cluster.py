"""The cluster a chaos run deploys, and what the run asks it through Serve handles.

SmolLM2-135M is its own draft model, so both a Drafter and a Verifier deployment exist (model-drafted
requests) besides n-gram drafting in the scheduler. Short health-check periods and drafter timeouts make
failures visible in seconds (what bounds each recovery: docs/chaos.md). The head advertises HEAD_RESOURCE, so a
node-loss scenario's placement keeps the ingress and the scheduler on it while the workers go to extra nodes
(chaos/nodes.py); Ray's control store checks every raylet each second and counts one dead after 4 missed checks
(its defaults: 3 s, 5 misses), so a lost node is seen in seconds.
"""

from __future__ import annotations

import time
from typing import Any

from chaos.nodes import ExtraNodes
from cluster.serving.config import ClusterConfig, load_config
from cluster.serving.cpu_binding import thread_cpus

APP = "specserve"
GRPC_PORT, HTTP_PORT = 19710, 18710
HEAD_RESOURCE = "specserve-head"
NODE_DEATH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1500, "health_check_failure_threshold": 4}


def chaos_config(**overrides: Any) -> ClusterConfig:
    settings: dict[str, Any] = dict(
        model="smollm2-135m", draft="smollm2-135m", worker_threads=1, kv_blocks=256, block_size=16,
        queue_capacity=32, max_batch=8, max_context=256, grpc_port=GRPC_PORT, http_port=HTTP_PORT,
        drafter_retry_seconds=1.0, drafter_timeout_s=2.0, health_check_period_s=1.0, health_check_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0, warm_up=False,
    )
    settings.update(overrides)
    return load_config(**settings)


def deploy_cluster(config: ClusterConfig, nodes: ExtraNodes | None = None) -> None:
    """Start Ray (once: the head, in this process), then the extra nodes if any, then the application."""
    import ray

    from cluster.serving.app import deploy

    plan = None
    if not ray.is_initialized():  # a Ray of our own: its processes on the service CPUs (cluster/serving/cpu_binding.py)
        plan = config.cpu_plan()
        config.local_ray_env()
        with thread_cpus(plan.service if plan is not None else None):
            ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                     resources={HEAD_RESOURCE: 100}, _system_config=NODE_DEATH)
    if nodes is not None:
        nodes.start()
    deploy(config, cpu_plan=plan)


def gcs_address() -> str:
    import ray

    return str(ray.get_runtime_context().gcs_address)


def shutdown_cluster() -> None:
    from ray import serve

    serve.shutdown()


def handle(deployment: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment, APP)


def call(deployment: str, method: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
    return getattr(handle(deployment), method).remote(*args, **kwargs).result(timeout_s=timeout_s)


def wait_idle(timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until the scheduler has nothing live, running or waiting; returns its stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = call("Scheduler", "stats", timeout_s=30)
            engine, scheduler = stats["engine"], stats["scheduler"]
            if scheduler["live"] == 0 and engine["running"] == 0 and engine["waiting"] == 0:
                return stats
        except Exception:  # a scheduler being replaced
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster not idle after {timeout_s}s")
        time.sleep(0.25)
