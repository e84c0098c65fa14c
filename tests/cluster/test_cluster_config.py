"""ClusterConfig: defaults, file loading (YAML/JSON), flag overrides, and field-named refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, load_config


def test_defaults_are_the_bundled_qwen_pair() -> None:
    config = load_config()
    assert (config.model, config.draft) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert config.uses_draft_model
    assert (config.host, config.grpc_port, config.http_port, config.dashboard_port) == ("127.0.0.1", 9000, 8000, 8265)
    assert config.ray_address is None and config.tensor_parallel_size == 1


def test_yaml_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("model: smollm2-135m\ndraft: ngram\nkv_blocks: 256\ngrpc_port: 9100\nqueue_capacity: 32\n")
    config = load_config(path, grpc_port=9200, draft=None)  # None = flag not given
    assert (config.model, config.draft, config.kv_blocks, config.grpc_port) == ("smollm2-135m", "ngram", 256, 9200)
    assert not config.uses_draft_model
    assert config.with_overrides(max_batch=4).max_batch == 4


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "draft": "ngram", "tensor_parallel_size": 2}))
    assert load_config(path).tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"model": "no-such-model"}, "model"),
        ({"model": "ngram"}, "model"),
        ({"draft": "no-such-draft"}, "draft"),
        ({"kv_blocks": 0}, "kv_blocks"),
        ({"block_size": -1}, "block_size"),
        ({"tensor_parallel_size": 9}, "tensor_parallel_size"),
        ({"scheduler_replicas": 2}, "scheduler_replicas"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"grpc_port": 8000}, "ports must differ"),
        ({"max_batch": 64, "queue_capacity": 8}, "max_batch"),
        ({"health_check_timeout_s": 0}, "health_check_timeout_s"),
        ({"graceful_shutdown_timeout_s": -1}, "graceful_shutdown_timeout_s"),
        ({"unknown_key": 1}, "unknown_key"),
        ({"device": "tpu"}, "device"),
        ({"gpus_per_worker": 0}, "gpus_per_worker"),
    ],
)
def test_invalid_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(**data)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listing)


def test_config_is_frozen_and_picklable() -> None:
    import pickle

    config = load_config(model="smollm2-135m", draft="ngram")
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        config.kv_blocks = 1  # type: ignore[misc]
    assert isinstance(config, ClusterConfig)


def test_engine_options_are_checked_against_engine_config() -> None:
    assert load_config(engine_options={"k_max": 2}).engine_options == {"k_max": 2}
    with pytest.raises(ConfigError, match="unknown engine option"):
        load_config(engine_options={"k_maximum": 2})
    with pytest.raises(ConfigError, match="unknown engine option"):
        load_config(engine_options={"max_batch": 2})  # a first-class field
