"""Verifier TP=2 through the whole cluster: greedy gRPC output equals TP=1 and the in-process engine.

SmolLM2 (9 heads) cannot split in two, so the target is a tiny random-weight Qwen2 (4 heads, 2 KV
heads, seeded; weights large enough that greedy output does not just repeat one token) with
SmolLM2's tokenizer, drafting for itself (so TP=2 scores k+1 tokens per round, all accepted under
greedy, output identical either way). Two Serve applications run side by side: "specserve" with
TP=1 and "tp2" with TP=2 (the replica + 2 rank bundles in one placement group), each ingress with
its own gRPC server on its own port (a client naming the other application gets NOT_FOUND).
In float32: TP splits the o and down projections' sums over the ranks and adds the partials in an all-reduce,
so in bfloat16 (each partial rounded to 8 bits of mantissa before the sum) TP=2 and TP=1 are different
computations whose greedy tokens part ways (measured: this test's prompts diverge); greedy output equals
plain decoding of the same dtype *and* TP size (docs/precision.md).
Run inside the loopback-only namespace: scripts/in-netns.sh .venv/bin/python -m pytest -q tests/cluster
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cluster.client import RemoteError, SpecServeClient, collect
from cluster.serving.config import ClusterConfig, load_config
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 19610, 18610
MAX_CONTEXT = 128
MAX_TOKENS = 24
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx ="]
JOBS = [(prompt, k, draft) for prompt in PROMPTS for k, draft in ((4, "model"), (None, "model"), (0, "none"))]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """Random Qwen2 weights over SmolLM2's vocabulary, with SmolLM2's tokenizer files."""
    from tests.model_runtime.random_checkpoint import make_random_checkpoint

    out = make_random_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=7, vocab_size=49152,
                                 hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                 init_std=0.2)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def app_config(model: Path, tensor_parallel_size: int) -> ClusterConfig:
    return load_config(
        model=str(model), draft=str(model), tensor_parallel_size=tensor_parallel_size, worker_threads=1, kv_blocks=64,
        dtype="float32", draft_dtype="float32",
        block_size=16, queue_capacity=16, max_batch=8, max_context=MAX_CONTEXT,
        max_client_completions=16, max_client_tokens=16 * MAX_CONTEXT,  # one client (one channel) fills the batch here
        grpc_port=GRPC_PORT + tensor_parallel_size - 1,
        http_port=HTTP_PORT, health_check_period_s=1.0, health_check_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0,
    )


@pytest.fixture(scope="module")
def clients(ray_session: Any, tiny_qwen2: Path) -> Iterator[dict[int, SpecServeClient]]:
    """TP size -> a client of the application with that verifier."""
    from ray import serve

    from cluster.serving.app import APP_NAME, build_app, start_serve

    tp1, tp2 = app_config(tiny_qwen2, 1), app_config(tiny_qwen2, 2)
    start_serve(tp1)
    try:
        serve.run_many([serve.RunTarget(build_app(tp1), name=APP_NAME, route_prefix="/"),
                        serve.RunTarget(build_app(tp2), name="tp2", route_prefix="/tp2")])
        with SpecServeClient(f"127.0.0.1:{tp1.grpc_port}", 120) as one, \
                SpecServeClient(f"127.0.0.1:{tp2.grpc_port}", 120, application="tp2") as two:
            with SpecServeClient(f"127.0.0.1:{tp2.grpc_port}", 120) as wrong, pytest.raises(RemoteError) as info:
                wrong.list_models()  # the default application name, at tp2's server
            assert info.value.code.name == "NOT_FOUND"
            yield {1: one, 2: two}
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_qwen2: Path) -> dict[tuple[str, int | None, str], list[int]]:
    """The in-process engine (TP=1), one request at a time."""
    from tests.cluster.engine.engine_helpers import local_engine

    engine = local_engine(tiny_qwen2, tiny_qwen2, max_batch=1, max_context=MAX_CONTEXT, dtype="float32",
                          draft_dtype="float32")
    out = {}
    for index, (prompt, k, draft) in enumerate(JOBS):
        ids = tuple(engine.tokenizer(prompt)["input_ids"])
        engine.submit(GenerationRequest(f"ref-{index}", ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                        SpecParams(contract="greedy", k=k, draft=draft)))
        out[(prompt, k, draft)] = [t for c in engine.run_to_completion()[f"ref-{index}"] for t in c.token_ids]
    return out


def run_jobs(client: SpecServeClient) -> list[dict[str, Any]]:
    """Every job at once (one batch through the verifier), greedy."""
    def one(job: tuple[str, int | None, str]) -> dict[str, Any]:
        prompt, k, draft = job
        (sample,) = collect(client.generate(prompt, max_tokens=MAX_TOKENS, k=k, draft=draft, contract="greedy",
                                            ignore_eos=True)).values()
        return sample

    with ThreadPoolExecutor(max_workers=len(JOBS)) as pool:
        return list(pool.map(one, JOBS))


def test_tp2_placement_group_and_models(clients: dict[int, SpecServeClient], tiny_qwen2: Path) -> None:
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert any(len(g["bundles"]) == 3 for g in groups), groups  # the replica + 2 ranks
    for client in clients.values():
        assert client.health() == (True, "ok")
        assert client.list_models()[0]["id"] == str(tiny_qwen2)


def test_tp2_greedy_equals_tp1_and_in_process(clients: dict[int, SpecServeClient], reference: dict) -> None:
    by_tp = {tp: run_jobs(client) for tp, client in clients.items()}
    for index, job in enumerate(JOBS):
        want = reference[job]
        assert len(want) == MAX_TOKENS
        assert by_tp[1][index]["token_ids"] == want, (1, job)
        assert by_tp[2][index]["token_ids"] == want, (2, job)
        assert by_tp[2][index]["text"] == by_tp[1][index]["text"]
    for sample, (_, k, _) in zip(by_tp[2], JOBS, strict=True):
        acceptance = sample["stats"]["acceptance"]
        if k == 4:  # TP=2 scored k+1 tokens per round and accepted every self-draft
            assert acceptance["accepted"] == acceptance["proposed"] > MAX_TOKENS // 2, acceptance
    assert len(set(map(tuple, reference.values()))) == len(PROMPTS)  # varied output, not one repeated token
    assert all(len(set(ids)) > MAX_TOKENS // 2 for ids in reference.values())
    for client in clients.values():
        stats = client.stats()
        assert stats["kv"]["leaked_blocks"] == 0 and stats["scheduler"]["live"] == 0
