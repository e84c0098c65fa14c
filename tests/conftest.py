"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF checkpoint dir of SmolLM2-135M-Instruct in the default cache (`make setup` prepares it)."""
    from model_runtime.prepare import prepare_model

    return prepare_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[ModuleType]:
    """One local Ray for the whole test session, bound to loopback.

    Run Ray tests only inside the loopback-only namespace: scripts/in-netns.sh (sets RAY_TMPDIR and
    RAY_AUTH_MODE=disabled). Never `ray stop`: shutdown happens here, once, at the session's end.
    """
    import ray

    if ray.is_initialized():
        yield ray
        return
    from cluster.config import ClusterConfig

    ClusterConfig().local_ray_env()  # workers at the niceness `specserve up` gives them
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()
