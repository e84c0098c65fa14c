"""Fixtures shared across the test tree, and the unit/model/ray markers (registered in pyproject.toml)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

TESTS_DIR = Path(__file__).resolve().parent
# fixtures that load real model weights / start Ray
MODEL_FIXTURES = frozenset({"smollm2_dir", "smollm2_fresh", "once_reference"})
RAY_FIXTURES = frozenset({"ray_session"})
# tests that do so without those fixtures: path under tests/ (a folder ends in "/") -> test-name prefixes
RAY_TESTS: dict[str, tuple[str, ...]] = {
    "deploy/": ("",),  # builds the Serve application the RayService runs
    "cluster/multinode/": ("",),  # several Ray nodes in network namespaces of their own (opt-in)
    "cluster/serving/live_api/": ("",),  # one live deployment for the package (live_api/conftest.py)
    "cluster/cli/test_up.py": ("test_up_serves", "test_up_once"),  # `specserve up` subprocesses: Ray + servers
}
# end-to-end statistical tests of the exact contract (many engine runs on tiny models: minutes, not seconds)
STATISTICAL_TESTS: dict[str, tuple[str, ...]] = {
    "cluster/engine/test_engine_exact.py": ("",),
    "cluster/check/test_exact_models.py": ("test_smollm2", "test_injected", "test_too_few", "test_greedy"),
    "cluster/check/test_exact_server.py": ("test_check_through",),
}
MODEL_TESTS: dict[str, tuple[str, ...]] = {
    "cluster/cli/test_up.py": ("test_up_serves",),  # its server serves SmolLM2
}


def listed(table: dict[str, tuple[str, ...]], path: str, name: str) -> bool:
    return any((path == where or (where.endswith("/") and path.startswith(where)))
               and name.startswith(prefixes) for where, prefixes in table.items())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test `model`, `ray` and/or `statistical` by what it uses; a test with none is `unit`."""
    for item in items:
        try:
            path = item.path.resolve().relative_to(TESTS_DIR).as_posix()
        except ValueError:
            path = item.path.as_posix()
        name = getattr(item, "originalname", item.name)
        fixtures = set(getattr(item, "fixturenames", ()))
        marks = {m for m in ("model", "ray", "statistical") if item.get_closest_marker(m) is not None}
        if fixtures & MODEL_FIXTURES or listed(MODEL_TESTS, path, name):
            marks.add("model")
        if fixtures & RAY_FIXTURES or listed(RAY_TESTS, path, name):
            marks.add("ray")
        if listed(STATISTICAL_TESTS, path, name):
            marks.add("statistical")
        for mark in sorted(marks or {"unit"}):
            item.add_marker(mark)


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
    from cluster.serving.config import ClusterConfig

    ClusterConfig().local_ray_env()  # workers at the niceness `specserve up` gives them
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()
