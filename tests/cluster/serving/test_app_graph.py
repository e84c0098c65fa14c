"""The bound deployment graph (no Ray started): which deployments exist, their resources and Serve options."""

from __future__ import annotations

from typing import Any

from ray.serve.deployment import Application

from cluster.serving.app import build_app, serve_options
from cluster.serving.config import ClusterConfig, load_config


def graph(config: ClusterConfig) -> dict[str, Any]:
    """Deployment name -> Deployment, walking the bind arguments from the ingress."""
    found: dict[str, Any] = {}

    def walk(app: Application) -> None:
        deployment = app._bound_deployment
        found[deployment.name] = deployment
        for arg in deployment.init_args:
            if isinstance(arg, Application):
                walk(arg)

    walk(build_app(config))
    return found


def test_graph_with_a_draft_model() -> None:
    config = load_config(model="smollm2-135m", draft="smollm2-135m", queue_capacity=50, max_batch=8,
                         health_check_period_s=1.5, graceful_shutdown_timeout_s=3)
    deployments = graph(config)
    assert set(deployments) == {"Ingress", "Scheduler", "Drafter", "Verifier"}
    for deployment in deployments.values():
        assert deployment._deployment_config.health_check_period_s == 1.5
        assert deployment._deployment_config.graceful_shutdown_timeout_s == 3
        assert deployment.num_replicas == 1
    # Serve never queues streams itself: its limit sits above the scheduler's own admission bound
    assert deployments["Scheduler"]._deployment_config.max_ongoing_requests > config.queue_capacity
    assert deployments["Ingress"]._deployment_config.max_ongoing_requests > config.queue_capacity
    assert deployments["Verifier"]._replica_config.placement_group_bundles is None
    assert deployments["Verifier"].ray_actor_options["num_gpus"] == 0
    assert deployments["Drafter"].init_args[0] == "smollm2-135m"


def test_ngram_cluster_has_no_drafter() -> None:
    assert set(graph(load_config(model="smollm2-135m", draft="ngram"))) == {"Ingress", "Scheduler", "Verifier"}


def test_tensor_parallel_ranks_get_one_bundle_each() -> None:
    verifier = graph(load_config(model="smollm2-135m", draft="ngram", tensor_parallel_size=3))["Verifier"]
    assert verifier._replica_config.placement_group_bundles == [{"CPU": 0.1}] + [{"CPU": 1.0}] * 3
    assert verifier.ray_actor_options["num_cpus"] == 0.1  # the replica drives; it fits its own bundle


def test_cuda_workers_request_gpus() -> None:
    deployments = graph(load_config(device="cuda", tensor_parallel_size=2))  # the Qwen pair
    assert deployments["Verifier"]._replica_config.placement_group_bundles == (
        [{"CPU": 0.1}] + [{"CPU": 1.0, "GPU": 1.0}] * 2)
    assert deployments["Drafter"].ray_actor_options["num_gpus"] == 1.0
    shared = graph(load_config(device="cuda", gpus_per_worker=0.5))
    assert shared["Verifier"].ray_actor_options["num_gpus"] == 0.5
    assert shared["Drafter"].ray_actor_options["num_gpus"] == 0.5


def test_serve_options() -> None:
    """Serve's HTTP proxy on the configured address; no Serve gRPC proxy (the ingress serves gRPC itself)."""
    options = serve_options(load_config(host="127.0.0.1", grpc_port=9100, http_port=8100, request_timeout_s=30))
    assert (options["http_options"].host, options["http_options"].port) == ("127.0.0.1", 8100)
    assert options["http_options"].request_timeout_s == 30
    assert "grpc_options" not in options
