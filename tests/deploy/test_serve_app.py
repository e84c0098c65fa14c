"""deploy/serve_app.py: the builder serveConfigV2 names refuses what KubeRay sets elsewhere and binds gRPC to the
pod's address."""

from __future__ import annotations

import pytest

from cluster.serving.config import ClusterConfig, ConfigError
from deploy.serve_app import NOT_APP_ARGS, POD_HOST, cluster_config


def test_builder_refuses_fields_kuberay_sets_elsewhere() -> None:
    assert set(NOT_APP_ARGS) <= set(ClusterConfig.model_fields)
    with pytest.raises(ConfigError, match="http_options.port"):
        cluster_config({"http_port": 8000})
    with pytest.raises(ConfigError, match="kv_blok"):
        cluster_config({"kv_blok": 64})
    assert cluster_config({"draft": "ngram"}).uses_draft_model is False


def test_grpc_binds_the_pod_address() -> None:
    """gRPC is served by the Ingress replicas on host:grpc_port; under KubeRay the host is the pod's address."""
    assert cluster_config({}).host == POD_HOST == "0.0.0.0"
    assert cluster_config({"host": "::", "grpc_port": 9100}).grpc_port == 9100
    for loopback in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(ConfigError, match="loopback"):
            cluster_config({"host": loopback})


def test_builder_refuses_api_keys_in_the_manifest() -> None:
    """A key in serveConfigV2 would be plain text in the manifest: the builder asks for a mounted key file."""
    with pytest.raises(ConfigError, match="api_key_file") as info:
        cluster_config({"api_keys": ["sk-in-the-manifest-0123456789"]})
    assert "sk-in-the-manifest" not in str(info.value)
    assert cluster_config({"api_key_file": "/etc/specserve/api-keys/keys"}).api_key_file == "/etc/specserve/api-keys/keys"
