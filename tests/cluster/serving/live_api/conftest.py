"""One deployment of the application for every test module of this package (see helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.client import SpecServeClient
from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import cluster_config


@pytest.fixture(scope="package")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the cluster's ingress and scheduler append their spans (tracing on, every trace sampled)."""
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="package")
def cluster(ray_session: Any, trace_file: Path) -> Iterator[ClusterConfig]:
    from ray import serve

    from cluster.serving.app import deploy

    config = cluster_config(trace_file=str(trace_file))
    deploy(config)
    try:
        yield config
    finally:
        serve.shutdown()


@pytest.fixture(scope="package")
def client(cluster: ClusterConfig) -> Iterator[SpecServeClient]:
    with SpecServeClient(f"127.0.0.1:{cluster.grpc_port}", timeout_s=120) as c:
        yield c
