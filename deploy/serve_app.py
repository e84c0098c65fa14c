"""The Ray Serve application builder that `deploy/rayservice.yaml` names in `serveConfigV2`.

    import_path: deploy.serve_app:app_builder
    args: {model: ..., draft: ..., device: cuda, tensor_parallel_size: 2, ...}   # ClusterConfig fields

Ray Serve calls an application builder with exactly one argument, the `args` mapping of the config.
`cluster.serving.app.build_app(config, engine_builder=None)` takes two parameters and a `ClusterConfig`, so
it cannot be named directly; this adapter validates `args` as a `ClusterConfig` (the same
validation and error messages as `specserve up --config FILE`) and binds the same graph.

Under KubeRay, Ray and the proxies are started by the RayService, not by `specserve up`: the
fields that only configure those (`host`, ports, `ray_address`, ...) have their place elsewhere in
the manifest and are refused here rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from cluster.serving.app import build_app
from cluster.serving.config import ClusterConfig, ConfigError, load_config

__all__ = ["NOT_APP_ARGS", "app_builder", "cluster_config"]

# ClusterConfig fields `specserve up` uses to start Ray and the proxies -> where a RayService sets them.
NOT_APP_ARGS: dict[str, str] = {
    "host": "serveConfigV2 http_options.host",
    "http_port": "serveConfigV2 http_options.port (and the head container's 'serve' port)",
    "grpc_port": "serveConfigV2 grpc_options.port (and the head container's 'grpc' port)",
    "request_timeout_s": "serveConfigV2 http_options.request_timeout_s / grpc_options.request_timeout_s",
    "dashboard_port": "the head container's 'dashboard' port (rayStartParams dashboard-port)",
    "ray_address": "nothing: KubeRay deploys the application into its own Ray cluster",
    "ray_num_cpus": "rayStartParams num-cpus / the container's CPU limit",
}


def cluster_config(args: dict[str, Any]) -> ClusterConfig:
    """`args` of serveConfigV2 -> a validated ClusterConfig (ConfigError on any problem)."""
    if not isinstance(args, dict):
        raise ConfigError(f"serveConfigV2 args must be a mapping, got {type(args).__name__}")
    misplaced = sorted(set(args) & set(NOT_APP_ARGS))
    if misplaced:
        where = "; ".join(f"{name}: set it in {NOT_APP_ARGS[name]}" for name in misplaced)
        raise ConfigError(f"not an application argument under KubeRay: {where}")
    return load_config(None, **args)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Ray Serve application builder: serveConfigV2 `args` (ClusterConfig fields) -> the bound graph."""
    return build_app(cluster_config(args))
