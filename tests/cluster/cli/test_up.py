"""`specserve up` as a user runs it: a subprocess with its own embedded Ray, the three address lines,
a working gRPC + HTTP + dashboard, and a clean exit on SIGTERM (Serve, then Ray shut down);
`up --once` streams one generation, prints its statistics and exits 0 after the same shutdown.

Run inside the loopback-only namespace (scripts/in-netns.sh); everything binds 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from cluster.client import SpecServeClient, collect
from model_runtime.prepare import cached_path
from model_runtime.registry import KNOWN_MODELS

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
QWEN_DRAFT_CACHED = cached_path(KNOWN_MODELS["qwen2.5-coder-0.5b"]) is not None
GRPC_PORT, HTTP_PORT, DASHBOARD_PORT = 19410, 18410, 18265
ONCE_PORTS = (19420, 18420, 18275)  # `up --once` runs (the ports of a run just ended may linger)
ONCE_PROMPT = "def add(a, b):"
ONCE_TOKENS = 16


def config_text(grpc_port: int = GRPC_PORT, http_port: int = HTTP_PORT, dashboard_port: int = DASHBOARD_PORT) -> str:
    return f"""\
model: qwen2.5-coder-1.5b   # overridden by --model on the command line
draft: qwen2.5-coder-0.5b   # overridden by --draft
dtype: bfloat16             # pinned: auto may run q4 where AMX does not (model_runtime/precision.py)
draft_dtype: bfloat16       # a model drafting for itself in its own precision: every greedy draft survives
worker_threads: 1
kv_blocks: 256
max_context: 256
queue_capacity: 32
grpc_port: {grpc_port}
http_port: {http_port}
dashboard_port: {dashboard_port}
ray_num_cpus: 4
health_check_period_s: 1
health_check_timeout_s: 10
graceful_shutdown_wait_loop_s: 0.2
graceful_shutdown_timeout_s: 2
"""


CONFIG = config_text()


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


def free_ports(count: int) -> list[int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def port_flags() -> list[str]:
    grpc_port, http_port, dashboard_port = free_ports(3)
    return ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--dashboard-port", str(dashboard_port)]


def test_a_short_api_key_is_one_line_and_exit_2_before_ray_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A key the ingress would refuse at start (under 16 characters) once crash-looped the ingress replica after
    Ray and Serve had started; `up` now reads the keys first. In process, with ray.init a spy."""
    import ray

    from cluster.cli import up
    from cluster.cli.main import main

    monkeypatch.delenv("SPECSERVE_API_KEYS", raising=False)
    started: list[Any] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a) or pytest.fail("ray.init was called"))
    monkeypatch.setattr(up, "preflight", lambda config: pytest.fail("up went on to the models"))
    key_file = tmp_path / "keys"
    key_file.write_text("short-key-1234\n")
    assert main(["up", "--model", "smollm2-135m", "--draft", "ngram", "--api-key-file", str(key_file),
                 *port_flags()]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and not started
    assert err.startswith("error: API keys must have at least 16 characters") and str(key_file) in err
    assert "short-key-1234" not in err


def test_a_bad_config_is_refused_in_one_line_before_ray_starts(tmp_path: Path) -> None:
    """As a user runs it: a short key and a certificate with another's key are one line naming both, exit 2, and no
    Ray session was made (RAY_TMPDIR stays empty)."""
    from tests.cluster.serving.tls_certs import self_signed

    key_file = tmp_path / "keys"
    key_file.write_text("short-key-1234\n")
    ours, theirs = self_signed(tmp_path / "ours", "ours"), self_signed(tmp_path / "theirs", "theirs")
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "SPECSERVE_API_KEYS"}
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--model", "smollm2-135m", "--draft", "ngram", "--api-key-file",
         str(key_file), "--tls-cert-file", str(ours.cert), "--tls-key-file", str(theirs.key), *port_flags()],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**env, "RAY_TMPDIR": str(ray_tmp)})
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: API keys must have at least 16")
    assert f"tls_key_file {theirs.key} is not the key of tls_cert_file {ours.cert}" in result.stderr
    assert not list(ray_tmp.iterdir())


def test_up_once_leaves_max_tokens_unset_unless_given() -> None:
    from cluster.cli.main import build_parser

    assert build_parser().parse_args(["up", "--once", "hi"]).max_tokens is None


@pytest.fixture(scope="module")
def once_reference() -> dict[str, Any]:
    """Plain greedy decoding of ONCE_PROMPT in process: what `up --once` must print."""
    from specserve_types.api import GenerationRequest, SamplingParams, SpecParams
    from tests.cluster.engine.engine_helpers import local_engine

    engine = local_engine("smollm2-135m", "none", max_batch=1, max_context=256, dtype="bfloat16")
    ids = tuple(engine.tokenizer(ONCE_PROMPT)["input_ids"])
    engine.submit(GenerationRequest("ref", ids, SamplingParams(max_tokens=ONCE_TOKENS), SpecParams(k=0, draft="none")))
    chunks = engine.run_to_completion()["ref"]
    return {"token_ids": [t for c in chunks for t in c.token_ids], "text": "".join(c.text_delta for c in chunks),
            "finish_reason": chunks[-1].finish_reason}


def run_once(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    config = tmp_path / "cluster.yaml"
    config.write_text(config_text(*ONCE_PORTS))
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--config", str(config), "--model", "smollm2-135m",
         "--once", ONCE_PROMPT, "--max-tokens", str(ONCE_TOKENS), *flags],
        cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shutting down Serve" in result.stderr and "shutting down Ray" in result.stderr
    return result


def test_up_once_streams_then_prints_statistics(tmp_path: Path, once_reference: dict[str, Any]) -> None:
    result = run_once(tmp_path, "--draft", "ngram")
    grpc, http_line, dashboard, body = result.stdout.split("\n", 3)
    assert [grpc, http_line, dashboard] == [f"grpc: 127.0.0.1:{ONCE_PORTS[0]}", f"http: http://127.0.0.1:{ONCE_PORTS[1]}",
                                            f"dashboard: http://127.0.0.1:{ONCE_PORTS[2]}"]
    text, _, stats_line = body.rstrip("\n").rpartition("\n")
    assert text == once_reference["text"]  # streamed as it arrived, nothing else in between
    stats = json.loads(stats_line)
    assert stats["model"] == "smollm2-135m" and stats["draft"] == "ngram" and stats["contract"] == "greedy"
    assert stats["finish_reason"] == once_reference["finish_reason"]
    assert stats["output_tokens"] == len(once_reference["token_ids"]) and stats["rounds"] >= 1
    assert stats["expected_tokens_per_round"] >= 1.0 and stats["mean_tokens_per_round"] >= 1.0
    assert set(stats["time_split_seconds"]) == {"draft", "verify", "reconcile", "other"}
    assert stats["time_split_seconds"]["verify"] > 0 and stats["ttft_seconds"] > 0
    assert stats["fallback_events"] == [] and stats["policy_events"]


def test_up_once_json_with_a_draft_model(tmp_path: Path, once_reference: dict[str, Any]) -> None:
    """SmolLM2 drafting for itself through the Drafter deployment: every greedy draft survives."""
    result = run_once(tmp_path, "--draft", "smollm2-135m", "--k", "3", "--json")
    output = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert output["grpc"] == f"127.0.0.1:{ONCE_PORTS[0]}" and output["prompt"] == ONCE_PROMPT
    assert output["token_ids"] == once_reference["token_ids"] and output["text"] == once_reference["text"]
    stats = output["stats"]
    assert stats["draft"] == "smollm2-135m" and stats["fallback_events"] == []
    acceptance = stats["acceptance"]
    assert 0 < acceptance["accepted"] == acceptance["proposed"] and acceptance["survival"] == [1.0, 1.0, 1.0]
    assert stats["expected_tokens_per_round"] == 4.0 and stats["mean_tokens_per_round"] > 2.0
    assert stats["time_split_seconds"]["draft"] > 0
