"""`specserve up` as a user runs it: a subprocess with its own embedded Ray, the three address lines,
a working gRPC + HTTP + dashboard, and a clean exit on SIGTERM (Serve, then Ray shut down).

Run inside the loopback-only namespace (scripts/in-netns.sh); everything binds 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from cluster.client import SpecServeClient, collect
from model_runtime.prepare import cached_path
from model_runtime.registry import KNOWN_MODELS

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
QWEN_DRAFT_CACHED = cached_path(KNOWN_MODELS["qwen2.5-coder-0.5b"]) is not None
GRPC_PORT, HTTP_PORT, DASHBOARD_PORT = 19410, 18410, 18265

CONFIG = f"""\
model: qwen2.5-coder-1.5b   # overridden by --model on the command line
draft: qwen2.5-coder-0.5b   # overridden by --draft
worker_threads: 1
kv_blocks: 256
max_context: 256
queue_capacity: 32
grpc_port: {GRPC_PORT}
http_port: {HTTP_PORT}
dashboard_port: {DASHBOARD_PORT}
ray_num_cpus: 4
health_check_period_s: 1
health_check_timeout_s: 10
graceful_shutdown_wait_loop_s: 0.2
graceful_shutdown_timeout_s: 2
"""


def read_address_lines(process: subprocess.Popen, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(lines) < 3:
        assert time.monotonic() < deadline, f"no address lines after {timeout_s}s: {lines}"
        line = process.stdout.readline()
        if not line:
            assert process.poll() is None, f"specserve up exited with {process.returncode}: {lines}"
            continue
        lines.append(line.rstrip("\n"))
    return lines


def test_up_serves_then_shuts_down_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG)
    stderr = (tmp_path / "up.err").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "up", "--config", str(config), "--model", "smollm2-135m",
         "--draft", "ngram"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = read_address_lines(process, timeout_s=180)
        assert lines == [f"grpc: 127.0.0.1:{GRPC_PORT}", f"http: http://127.0.0.1:{HTTP_PORT}",
                         f"dashboard: http://127.0.0.1:{DASHBOARD_PORT}"]
        with SpecServeClient(f"127.0.0.1:{GRPC_PORT}", timeout_s=60) as client:
            assert client.health() == (True, "ok")
            assert client.list_models()[0]["id"] == "smollm2-135m"
            (sample,) = collect(client.generate("def add(a, b):", max_tokens=6, ignore_eos=True)).values()
            assert sample["finish_reason"] == "length" and len(sample["token_ids"]) == 6
        assert requests.get(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=30).status_code == 200
        generated = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "generate", "def add(a, b):", "--server", f"127.0.0.1:{GRPC_PORT}",
             "--model", "smollm2-135m", "--max-tokens", "6", "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert generated.returncode == 0, generated.stderr
        result = json.loads(generated.stdout)
        assert result["samples"][0]["token_ids"] == sample["token_ids"] or result["samples"][0]["finish_reason"] == "eos"
        assert requests.get(f"http://127.0.0.1:{DASHBOARD_PORT}/api/version", timeout=30).status_code == 200

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()
    log = (tmp_path / "up.err").read_text()
    assert "received SIGTERM" in log and "shutting down Serve" in log and "shutting down Ray" in log


@pytest.mark.parametrize(
    ("config_text", "message"),
    [
        ("model: smollm2-135m\ndraft: ngram\nkv_blocks: -4\n", "kv_blocks"),
        pytest.param("model: smollm2-135m\ndraft: qwen2.5-coder-0.5b\n", "draft: vocabulary sizes differ",
                     marks=pytest.mark.skipif(not QWEN_DRAFT_CACHED, reason="qwen2.5-coder-0.5b not prepared")),
    ],
)
def test_up_refuses_a_bad_config(tmp_path: Path, config_text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(config_text)
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--config", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Started a local Ray" not in result.stderr
