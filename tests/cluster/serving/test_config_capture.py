"""ClusterConfig's `capture`: auto by default (off on the CPU), carried to the in-process runtime and to the
deployments; a mode a worker cannot run is refused when the config is made, the field named."""

from __future__ import annotations

from typing import get_args

import pytest

from cluster.engine.factory import LocalRuntime
from cluster.serving.config import ClusterConfig, ConfigError, make_config
from model_runtime.graph.modes import CAPTURE_SETTINGS, CaptureUnsupportedError


def test_auto_by_default_and_carried() -> None:
    config = make_config(model="smollm2-135m", draft="ngram")
    assert config.capture == "auto"
    assert config.local_runtime().capture == "auto"
    settings = make_config(capture="eager", max_batch=4, k_max=3, max_context=512).capture_settings()
    assert (settings.setting, settings.max_batch, settings.k_max, settings.max_context) == ("eager", 4, 3, 512)
    assert get_args(ClusterConfig.model_fields["capture"].annotation) == CAPTURE_SETTINGS


@pytest.mark.parametrize("fields", [
    {"capture": "off"}, {"capture": "auto", "dtype": "q4"}, {"capture": "eager", "dtype": "float32"},
    {"capture": "auto", "device": "cuda", "tensor_parallel_size": 2},
    {"capture": "compile", "draft": "ngram", "draft_dtype": "int8"},  # no draft model: its precision is unused
    {"capture": "cuda-graph", "device": "cuda", "dtype": "bfloat16", "draft_dtype": "bfloat16"},
])
def test_accepted(fields: dict[str, object]) -> None:
    assert make_config(**fields).capture == fields["capture"]


@pytest.mark.parametrize(("fields", "match"), [
    ({"capture": "cuda-graph"}, "'cuda-graph' needs a CUDA device, not 'cpu'"),
    ({"capture": "compile+cuda-graph", "device": "cpu"}, "needs a CUDA device"),
    ({"capture": "eager", "tensor_parallel_size": 2}, "runs one rank, not tensor_parallel_size 2"),
    ({"capture": "eager", "dtype": "q4"}, "not q4"),
    ({"capture": "eager", "draft_dtype": "int8"}, "not int8"),
    ({"capture": "cuda-graph", "device": "cuda", "draft_dtype": "float16"}, "not float16"),
    ({"capture": "graphs"}, "capture"),
])
def test_refused_at_config_time(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_config(**fields)


def test_local_runtime_refuses_a_cuda_mode_on_the_cpu() -> None:
    with pytest.raises(CaptureUnsupportedError, match="needs a CUDA device"):
        LocalRuntime(block_size=16, num_blocks=64, device="cpu", dtype="float32", draft_dtype="float32",
                     warm_up=False, capture="cuda-graph")
    assert LocalRuntime(16, 64, "cpu", "float32", "float32", False, capture="eager").capture == "eager"
