"""scripts/gpu-check.sh without CUDA: the preflight exits 0, names every step it would run (the captured step's
among them), runs the CUDA tests here (they skip) and writes a summary saying so. And the captured step's script
runs end to end on the CPU (eager mode, --quick: the figures mean nothing here; on a GPU it is the measurement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")


def test_the_preflight_says_what_it_would_run_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu-check.sh", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for step in ("parity:", "tp-nccl:", "serve-fractional:", "step-times:", "captured-parity:", "captured:"):
        assert f"gpu-check:   {step}" in done.stderr, step
    assert "gpu_captured_steps.py" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False
    steps = {s["step"]: s["exit"] for s in summary["steps"]}
    assert steps == {"preflight-skips": "0", "preflight-captured": "0"}
    assert "skipped" in (tmp_path / "preflight-captured.log").read_text()


def test_the_captured_steps_script_runs_on_the_cpu(tmp_path: Path) -> None:
    from tests.model_runtime.random_checkpoint import make_random_checkpoint

    config_only = tmp_path / "tiny"
    config_only.mkdir()
    (config_only / "config.json").write_text((make_random_checkpoint(tmp_path / "ckpt") / "config.json").read_text())
    out = tmp_path / "captured.json"
    done = subprocess.run([sys.executable, "scripts/gpu_captured_steps.py", str(config_only), "--device", "cpu",
                           "--quick", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (model,) = json.loads(out.read_text())["models"]
    assert model["random_weights"] is True and model["mode"] == "eager"
    assert model["capture"]["verify"]["buckets"] == 4 and model["capture"]["draft"]["buckets"] == 2
    assert len(model["steps"]) == 4 and all(s["captured_ms"] > 0 and s["eager_ms"] > 0 for s in model["steps"])
    assert model["greedy"]["speculative_equals_plain"] is True and model["greedy"]["captured_plain_equals_eager"]
    assert model["peer"]["new_tokens"] == 16 and model["peer"]["ms_per_token"] > 0
