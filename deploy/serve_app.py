"""The Ray Serve application builder that serveConfigV2 names (deploy/overlays/*/serve-config.yaml).

    import_path: deploy.serve_app:app_builder
    args: {model: ..., draft: ..., device: cuda, tensor_parallel_size: 2, ...}   # ClusterConfig fields

Ray Serve calls an application builder with exactly one argument, the `args` mapping of the config.
`cluster.serving.app.build_app(config, engine_builder=None, cpu_plan=None)` takes a `ClusterConfig`, so
it cannot be named directly; this adapter validates `args` as a `ClusterConfig` (the same
validation and error messages as `specserve up --config FILE`) and binds the same graph.

Under KubeRay, Ray and Serve's HTTP proxy are started by the RayService, not by `specserve up`: the fields
that only configure those (`http_port`, `ray_address`, ...) have their place elsewhere in the manifest and
are refused here rather than silently ignored. gRPC is different: each Ingress replica serves it with its
own server on `host:grpc_port` (cluster/serving/grpc_server.py), so those two are application arguments.
`host` defaults to 0.0.0.0 here (the Services reach the pod's address, never its loopback) and a loopback
address is refused.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from cluster.serving.app import build_app
from cluster.serving.config import ClusterConfig, ConfigError, load_config

__all__ = ["LOOPBACK_HOSTS", "NOT_APP_ARGS", "POD_HOST", "app_builder", "cluster_config"]

# ClusterConfig fields `specserve up` uses to start Ray and the proxies -> where a RayService sets them.
NOT_APP_ARGS: dict[str, str] = {
    "http_port": "serveConfigV2 http_options.port (and the head container's 'serve' port)",
    "dashboard_port": "the head container's 'dashboard' port (rayStartParams dashboard-port)",
    "ray_address": "nothing: KubeRay deploys the application into its own Ray cluster",
    "ray_num_cpus": "rayStartParams num-cpus / the container's CPU limit",
    "worker_niceness": "the Ray container's env RAY_worker_niceness (read by the raylet)",
    "cpu_binding": "the pods' CPUs (a Guaranteed pod under the kubelet's static CPU manager gets cores of its own)",
    # a key in serveConfigV2 is plain text in the manifest, in git and in `kubectl get rayservice -o yaml`
    "api_keys": "a Secret mounted on the worker, named by api_key_file (deploy/README.md, Access)",
}
POD_HOST = "0.0.0.0"  # default `host` under KubeRay: the gRPC servers listen on the pod's address
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def cluster_config(args: dict[str, Any]) -> ClusterConfig:
    """`args` of serveConfigV2 -> a validated ClusterConfig (ConfigError on any problem)."""
    if not isinstance(args, dict):
        raise ConfigError(f"serveConfigV2 args must be a mapping, got {type(args).__name__}")
    misplaced = sorted(set(args) & set(NOT_APP_ARGS))
    if misplaced:
        where = "; ".join(f"{name}: set it in {NOT_APP_ARGS[name]}" for name in misplaced)
        raise ConfigError(f"not an application argument under KubeRay: {where}")
    if str(args.get("host", POD_HOST)).strip().lower() in LOOPBACK_HOSTS:
        raise ConfigError(f"host: {args['host']!r} is the pod's loopback, which no Service reaches; use {POD_HOST}")
    return load_config(None, **{"host": POD_HOST, **args})


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Ray Serve application builder: serveConfigV2 `args` (ClusterConfig fields) -> the bound graph."""
    return build_app(cluster_config(args))
