"""`specserve check exact --server HOST:PORT`: the same check through a running cluster (Ray Serve, gRPC).

SmolLM2-135M with n-gram drafts served on loopback (run under scripts/in-netns.sh). The passing setting and
its power are those of test_exact_models.py (red/green/blue prompt, temperature 0.7, top-p 0.9, k = 3,
n = 240, power >= 0.8 against total variation 0.2). The cluster gives completion m of a call seed + m, so
the check's seeds (seed + j * n + i) are the in-process ones: the same samples come back, up to the rare
token that numerics flip (docs/api.md, seeds).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.check.exact import check_in_process, check_via_server
from cluster.check.settings import CheckSettings
from cluster.cli.main import main
from cluster.serving.config import load_config

GRPC_PORT, HTTP_PORT = 19410, 18410
PROMPT = "red, green, blue, red, green, blue, red,"
SETTINGS = CheckSettings(temperature=0.7, top_p=0.9, k=3, draft="ngram", n=240, positions=(1, 2), tv=0.2)


@pytest.fixture(scope="module")
def server(ray_session: Any) -> Iterator[str]:
    from ray import serve

    from cluster.serving.app import deploy

    deploy(load_config(model="smollm2-135m", draft="ngram", worker_threads=1, kv_blocks=256, block_size=16,
                       queue_capacity=64, max_batch=16, max_context=128, grpc_port=GRPC_PORT, http_port=HTTP_PORT,
                       health_check_period_s=1.0, health_check_timeout_s=10.0, graceful_shutdown_wait_loop_s=0.2,
                       graceful_shutdown_timeout_s=2.0))
    try:
        yield f"127.0.0.1:{GRPC_PORT}"
    finally:
        serve.shutdown()


def test_check_through_the_cluster_passes_with_the_in_process_samples(server: str, smollm2_dir: Path) -> None:
    remote, _ = check_via_server(server, "smollm2-135m", "ngram", [PROMPT], SETTINGS, per_call=16, concurrency=3,
                                 timeout_s=300)
    assert remote.outcome == "pass", remote.render(str)
    assert remote.where == f"server {server}" and remote.prompts[0].proposed > 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local, _ = check_in_process("smollm2-135m", "ngram", [PROMPT], SETTINGS, window=16)
    finally:
        torch.set_num_threads(threads)
    same = sum(a == b for a, b in zip(local.prompts[0].tokens, remote.prompts[0].tokens, strict=True))
    assert same >= 0.98 * SETTINGS.n, f"only {same} of {SETTINGS.n} samples agree: the seeds do not line up"


def test_cli_with_server_refuses_a_model_it_does_not_serve(server: str, smollm2_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "exact", "--server", server, "--model", str(smollm2_dir), "--n", "4"]) == 2
    assert "--model must name that target" in capsys.readouterr().err
    out = tmp_path / "r.json"
    code = main(["check", "exact", "--server", server, "--model", "smollm2-135m", "--prompt", PROMPT, "--temperature",
                 "0", "--positions", "1,2,3", "--n", "24", "--json-out", str(out)])
    assert code == 0 and json.loads(out.read_text())["settings"]["contract"] == "greedy"
