"""API keys and TLS on the real application (Serve's HTTP proxy with its ssl options, the Ingress replica's
gRPC server with ssl_server_credentials), asked from outside: requests and the openai SDK over HTTPS,
SpecServeClient over TLS, and `specserve generate --server` as a subprocess. The certificate is made here; the
keys come from a key file, as `specserve up --api-key-file` passes them. Refusals reach no scheduler: its
counters do not move. SmolLM2-135M with n-gram drafts; one deployment for the module, on the session's Ray.
Run inside the loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
import requests

from cluster.client import Credentials, RemoteError, SpecServeClient, collect
from cluster.serving.config import ClusterConfig, load_config
from tests.cluster.serving.tls_certs import TlsFiles, self_signed

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[3]
GRPC_PORT, HTTP_PORT = 19510, 18510
MODEL = "smollm2-135m"
KEY = "sk-live-0123456789abcdef0123"
OLD_KEY = "sk-old-0123456789abcdef0123"  # still listed: a rotation in progress
WRONG = "sk-live-0123456789abcdef012X"
BODY = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def served(ray_session: Any, tls: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterConfig]:
    from ray import serve

    from cluster.serving.app import deploy

    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# current\n{KEY}\n{OLD_KEY}\n")
    config = load_config(model=MODEL, draft="ngram", worker_threads=1, kv_blocks=128, max_batch=4,
                         queue_capacity=8, max_context=256, warm_up=False, grpc_port=GRPC_PORT, http_port=HTTP_PORT,
                         api_key_file=str(key_file), tls_cert_file=str(tls.cert), tls_key_file=str(tls.key),
                         health_check_period_s=1.0, graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0)
    deploy(config)
    try:
        yield config
    finally:
        serve.shutdown()


def scheduler_counters() -> dict[str, int]:
    from ray import serve

    stats = serve.get_deployment_handle("Scheduler", "specserve").stats.remote().result(timeout_s=60)
    return {key: stats["scheduler"][key] for key in ("admitted", "rejected_invalid", "rejected_capacity")}


def https(path: str, key: str | None, tls: TlsFiles, body: dict | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    url = f"https://127.0.0.1:{HTTP_PORT}{path}"
    if body is None:
        return requests.get(url, headers=headers, verify=str(tls.cert), timeout=60)
    return requests.post(url, json=body, headers=headers, verify=str(tls.cert), timeout=120)


def test_http_refuses_without_or_with_a_wrong_key_and_serves_the_right_ones(served: ClusterConfig,
                                                                             tls: TlsFiles) -> None:
    before = scheduler_counters()
    for key in (None, WRONG, ""):
        answer = https("/v1/completions", key, tls, BODY)
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["code"] == "invalid_api_key" and KEY not in answer.text
    assert https("/v1/models", WRONG, tls).status_code == 401
    assert scheduler_counters() == before  # nothing reached the scheduler
    assert https("/health", None, tls).status_code == 200  # open by design (probes)
    assert https("/metrics", None, tls).status_code == 200  # open unless metrics_require_api_key
    for key in (KEY, OLD_KEY):
        answer = https("/v1/completions", key, tls, BODY)
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    assert scheduler_counters()["admitted"] == before["admitted"] + 2


def test_https_only_and_the_openai_sdk(served: ClusterConfig, tls: TlsFiles) -> None:
    with pytest.raises(requests.ConnectionError):  # plaintext HTTP to the HTTPS port
        requests.get(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=10)
    with pytest.raises(requests.exceptions.SSLError):  # our certificate is not in the system's roots
        requests.get(f"https://127.0.0.1:{HTTP_PORT}/health", timeout=10)
    trust = ssl.create_default_context(cafile=str(tls.cert))
    base = f"https://127.0.0.1:{HTTP_PORT}/v1"
    with openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120,
                       http_client=httpx.Client(verify=trust)) as sdk:
        completion = sdk.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
        assert completion.choices[0].text and completion.usage.completion_tokens >= 1
        chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.role == "assistant"
    with openai.OpenAI(base_url=base, api_key=WRONG, max_retries=0, timeout=60,
                       http_client=httpx.Client(verify=trust)) as sdk, pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_grpc_over_tls_with_keys(served: ClusterConfig, tls: TlsFiles) -> None:
    address = f"127.0.0.1:{GRPC_PORT}"
    before = scheduler_counters()
    for key in (None, WRONG):
        with SpecServeClient(address, timeout_s=60, credentials=Credentials(key, True, str(tls.cert))) as client:
            with pytest.raises(RemoteError) as info:
                collect(client.generate("def add(a, b):", max_tokens=4))
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and KEY not in info.value.details
            assert client.health()[0]  # SpecServe.Health: open
    with SpecServeClient(address, timeout_s=20, credentials=Credentials(KEY)) as client:  # plaintext to TLS
        with pytest.raises(RemoteError) as info:
            collect(client.generate("def add(a, b):", max_tokens=4))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert scheduler_counters() == before
    with SpecServeClient(address, timeout_s=120, credentials=Credentials(KEY, True, str(tls.cert))) as client:
        (sample,) = collect(client.generate("def add(a, b):", max_tokens=4, temperature=0.0, ignore_eos=True)).values()
        assert sample["finish_reason"] == "length" and len(sample["token_ids"]) == 4


def test_generate_server_subprocess_passes_the_key_file_and_roots(served: ClusterConfig, tls: TlsFiles,
                                                                  tmp_path: Path) -> None:
    key_file = tmp_path / "my-key"
    key_file.write_text(KEY + "\n")
    argv = [sys.executable, "-m", "cluster.cli", "generate", "def add(a, b):", "--max-tokens", "4",
            "--temperature", "0", "--json", "--server", f"127.0.0.1:{GRPC_PORT}", "--tls-ca-file", str(tls.cert)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_API_KEY")}
    refused = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr + refused.stdout
    done = subprocess.run([*argv, "--api-key-file", str(key_file)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"finish_reason"' in done.stdout and KEY not in done.stdout + done.stderr
