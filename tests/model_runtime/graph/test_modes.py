"""The config's `capture` per worker: off and auto (off on the CPU, at TP > 1, for weights the captured forward
does not run) never refuse; a named mode is refused, typed, where it cannot run; the plan's buckets follow the
engine's sizes."""

from __future__ import annotations

import pytest

from model_runtime.graph.buckets import Buckets
from model_runtime.graph.modes import (
    CAPTURE_MODES,
    CAPTURE_SETTINGS,
    CaptureSettings,
    CaptureUnsupportedError,
    capture_mode,
)


@pytest.mark.parametrize(("setting", "device", "tp", "dtype", "want"), [
    ("off", "cuda:0", 1, "bfloat16", None),
    ("auto", "cpu", 1, "float32", None),  # the CPU's default path never changes
    ("auto", "cpu", 1, "q4", None),
    ("auto", "cuda:0", 1, "auto", "cuda-graph"),
    ("auto", "cuda:0", 1, "bfloat16", "cuda-graph"),
    ("auto", "cuda:0", 2, "bfloat16", None),  # TP > 1: the eager forward over the ranks
    ("auto", "cuda:0", 1, "float16", None),
    ("eager", "cpu", 1, "float32", "eager"),
    ("compile", "cpu", 1, "bfloat16", "compile"),
    ("compile+cuda-graph", "cuda", 1, "float32", "compile+cuda-graph"),
])
def test_capture_mode_resolves_per_worker(setting: str, device: str, tp: int, dtype: str, want: str | None) -> None:
    assert capture_mode(setting, device, tp, dtype) == want


@pytest.mark.parametrize(("setting", "device", "tp", "dtype", "match"), [
    ("cuda-graph", "cpu", 1, "float32", "needs a CUDA device"),
    ("reduce-overhead", "cpu", 1, "float32", "needs a CUDA device"),
    ("eager", "cpu", 2, "float32", "runs one rank"),
    ("cuda-graph", "cuda:0", 4, "bfloat16", "runs one rank"),
    ("eager", "cpu", 1, "q4", "not q4"),
    ("compile", "cpu", 1, "int8", "not int8"),
    ("cuda-graph", "cuda:0", 1, "float16", "not float16"),
    ("graphs", "cuda:0", 1, "float32", "unknown setting"),
])
def test_a_named_mode_that_cannot_run_is_refused(setting: str, device: str, tp: int, dtype: str, match: str) -> None:
    with pytest.raises(CaptureUnsupportedError, match=match):
        capture_mode(setting, device, tp, dtype)


def test_settings_name_every_mode() -> None:
    assert set(CAPTURE_SETTINGS) == {"off", "auto", *CAPTURE_MODES}
    assert len(CAPTURE_MODES) == 5
    with pytest.raises(CaptureUnsupportedError):
        CaptureSettings("on")


def test_plan_buckets_follow_the_engine() -> None:
    settings = CaptureSettings("eager", max_batch=8, k_max=4, max_context=1024, backend="aot_eager")
    plan = settings.plan("cpu", 1, "float32", 16)
    assert plan is not None and plan.mode == "eager" and plan.backend == "aot_eager"
    assert plan.buckets == Buckets.up_to(8, 5, 1024, 16)
    assert plan.buckets.batches == (1, 2, 4, 8) and plan.buckets.rows == (1, 2, 3, 5)
    assert plan.buckets.blocks == (16, 64)
    assert CaptureSettings("auto", 8, 4).plan("cpu", 1, "float32", 16) is None
    auto = CaptureSettings("auto", 8, 4).plan("cuda:0", 1, "bfloat16", 16)
    assert auto is not None and auto.mode == "cuda-graph" and auto.fallback  # auto falls back; a named mode not
    assert not plan.fallback
    capped = settings.plan("cpu", 1, "float32", 16, max_positions=256)  # the model's own limit, as the engine's
    assert capped is not None and capped.buckets == Buckets.up_to(8, 5, 256, 16)
    assert CaptureSettings().plan("cuda:0", 1, "bfloat16", 16) is None  # off
    with pytest.raises(CaptureUnsupportedError, match="not int8"):
        CaptureSettings("eager").plan("cpu", 1, "int8", 16)
