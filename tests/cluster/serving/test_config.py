"""ClusterConfig: defaults, file loading (YAML/JSON), flag overrides, and field-named refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE, EngineConfig
from cluster.serving.config import ClusterConfig, ConfigError, load_config, make_config


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


def test_engine_options_in_a_file_set_the_typed_fields(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("model: smollm2-135m\ndraft: ngram\nengine_options: {k_max: 2, overlap: true}\n")
    config = load_config(path)
    assert (config.k_max, config.overlap) == (2, True)
    assert "engine_options" not in config.model_dump()  # lifted, not kept as a dict
    assert (config.engine_config().k_max, config.engine_config().overlap) == (2, True)
    assert config.with_overrides(max_batch=4).k_max == 2  # flags over the file keep it


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"k_maximum": 2}, "unknown engine option"),
        ({"max_batch": 2}, "unknown engine option"),  # a first-class field
        ({"target_namespace": "x"}, "unknown engine option"),  # a constant now, not configurable
        ({"k_max": -1}, "k_max"),
        ({"pressure_free_fraction": 2.0}, "pressure_free_fraction"),
        ([1, 2], "engine_options must be a mapping"),
    ],
)
def test_engine_options_are_checked(options: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(engine_options=options)


def test_engine_option_set_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\['k_max'\] set both"):
        load_config(engine_options={"k_max": 2}, k_max=3)


def test_engine_config_derives_from_the_cluster_config() -> None:
    config = load_config(max_batch=4, queue_capacity=32, max_context=512, probe_every=8)
    assert config.engine_config() == EngineConfig(constrain_drafts=True,
        max_batch=4, max_waiting=32, max_context=512, k_max=4, probe_every=8, pressure_free_fraction=0.1,
        drafter_retry_seconds=5.0, max_verifier_failures=20, overlap=False,
        overlap_reason=config.overlap_decision(in_process=True).reason, predraft=False, tree_nodes=16,
        model_tree_nodes=0, draft_stop_below=0.5, reservation_windows=True, draft_lookup=True, exact_rule="block")
    assert config.overlap == "auto" and config.engine_config().overlap_reason.startswith("auto: in process")


def test_engine_config_has_no_defaults_and_refuses_bad_values() -> None:
    with pytest.raises(TypeError):
        EngineConfig()  # type: ignore[call-arg]
    good = load_config().engine_config()
    assert (TARGET_NAMESPACE, DRAFT_NAMESPACE) == ("verifier/target", "drafter/draft")  # constants, not settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.k_max = 2  # type: ignore[misc]
    for field, bad in [("max_batch", 0), ("max_waiting", 0), ("max_context", 0), ("k_max", -1), ("probe_every", 0),
                       ("pressure_free_fraction", 1.5), ("drafter_retry_seconds", -1.0),
                       ("max_verifier_failures", -1), ("overlap", 1), ("predraft", 1), ("draft_stop_below", 1.5)]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(good, **{field: bad})


def test_kv_blocks_none_sizes_the_pools_for_max_batch_full_contexts() -> None:
    assert load_config().kv_pool_blocks == 1024  # `specserve up`'s default is unchanged
    config = make_config(model="smollm2-135m", draft="ngram", max_batch=3, max_context=100, kv_blocks=None)
    assert config.kv_pool_blocks == 3 * (7 + 1) + 16  # ceil(100 / 16) blocks and one spare per request
    assert config.with_overrides(max_batch=5).kv_pool_blocks == 5 * (7 + 1) + 16
    runtime = config.local_runtime()
    assert (runtime.num_blocks, runtime.block_size, runtime.device, runtime.draft_dtype, runtime.warm_up) == (
        40, 16, "cpu", "auto", True)


@pytest.mark.parametrize(("fields", "in_process", "enabled", "words"), [
    ({}, True, False, "in process"),  # generate, bench spec: one process for both
    ({"worker_threads": 2, "tensor_parallel_size": 1}, False, None, "CPU"),  # depends on this machine's CPUs
    ({"draft": "ngram"}, False, False, "no draft model"),
    ({"device": "cuda"}, False, True, "a GPU of their own"),
    ({"device": "cuda", "gpus_per_worker": 0.5}, False, False, "may place the drafter"),
    ({"overlap": True}, True, True, "overlap: true in the config"),
    ({"overlap": "false", "device": "cuda"}, False, False, "auto would be on"),  # a string from a flag is a bool
])
def test_overlap_is_decided_from_where_the_drafter_and_verifier_run(fields: dict, in_process: bool,
                                                                     enabled: bool | None, words: str) -> None:
    config = make_config(**{"model": "smollm2-135m", "draft": "smollm2-135m", **fields})
    decision = config.overlap_decision(in_process=in_process)
    if enabled is None:  # (ranks + drafter) * threads + 1 <= CPUs
        from cluster.serving.cpu_quota import available_cpus

        enabled = 2 * 2 + 1 <= available_cpus()
        words = "no core is shared" if enabled else "would share cores"
    assert decision.enabled is enabled and words in decision.reason, decision
    engine = config.engine_config(in_process=in_process)
    assert (engine.overlap, engine.overlap_reason) == (decision.enabled, decision.reason)


def test_engine_options_accept_predraft() -> None:
    config = load_config(model="smollm2-135m", draft="smollm2-135m", engine_options={"overlap": True, "predraft": True})
    assert (config.overlap, config.predraft) == (True, True)
    assert config.engine_config().predraft and config.engine_config().overlap
