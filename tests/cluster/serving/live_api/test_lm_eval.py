"""lm-evaluation-harness (the `lm-eval` package) against the live cluster (live_api/conftest.py), through its
`local-completions` model: the OpenAI completions endpoint, SmolLM2's tokenizer from the local checkpoint, no hub.

The project's own tasks (evals/: specserve_mc, a loglikelihood multiple-choice task, and specserve_gen, a
generate_until task scored by exact match) run through `lm_eval.simple_evaluate` with `log_samples`; then every
log-likelihood lm-eval recorded for the multiple-choice task is recomputed in process: an engine of the same
checkpoint and dtype (bfloat16, as the live cluster) scores the same token ids (lm-eval's own context /
continuation split) with `prompt_logprobs` and `max_tokens` 0, and the continuation's rows are summed as lm-eval
sums what the server sends (each float32 as its shortest decimal, added left to right in float64).

They are asserted equal bit for bit. The live verifier here runs one rank (tensor_parallel_size 1, the package's
config; the TP=3 check in test_serve_cluster.py deploys its own verifier), the same batch-invariant bfloat16
kernels as the in-process engine (docs/precision.md): a prompt's rows do not depend on the batch, the
thread count or whether one more token is generated after them (lm-eval asks `max_tokens` 1 with `echo` and drops
that token's row), and a scored prompt takes no prefix-cache hit. Measured on a 2-vCPU AMD EPYC (avx512 kernels):
max |live - in process| = 0.0 over 40 continuations."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.serving.config import ClusterConfig
from cluster.serving.logprob_format import shortest
from tests.cluster.engine.engine_helpers import local_engine, request
from tests.cluster.serving.live_api.helpers import BASE_URL, MAX_CONTEXT, assert_no_leaks

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[4]
TASKS = ROOT / "evals"
LIMIT = 10  # documents per task: 10 of specserve_mc's 20 (40 scored continuations), all of specserve_gen's 10


@pytest.fixture(scope="module")
def evaluated(cluster: ClusterConfig, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """simple_evaluate's results (with the samples), the LM it ran and its seconds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the tasks' data_files are relative to the repository root (datasets reads them so)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        import lm_eval
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.tasks import TaskManager

        lm = LocalCompletionsAPI(model="smollm2-135m", base_url=f"{BASE_URL}/v1/completions",
                                 tokenizer=str(smollm2_dir), max_length=MAX_CONTEXT, max_retries=1, timeout=120)
        start = time.monotonic()
        results = lm_eval.simple_evaluate(model=lm, tasks=["specserve_mc", "specserve_gen"], limit=LIMIT,
                                          log_samples=True, task_manager=TaskManager(include_path=str(TASKS)))
        seconds = time.monotonic() - start
    assert results is not None
    return {"results": results, "lm": lm, "seconds": seconds}


def test_both_tasks_run_and_report_their_metrics(evaluated: dict[str, Any]) -> None:
    results = evaluated["results"]
    print("LM-EVAL", {task: {k: v for k, v in m.items() if k != "alias"} for task, m in results["results"].items()},
          f"{evaluated['seconds']:.1f} s")
    mc, gen = results["results"]["specserve_mc"], results["results"]["specserve_gen"]
    for metric in ("acc,none", "acc_norm,none"):
        assert 0.0 <= mc[metric] <= 1.0
    assert 0.0 <= gen["exact_match,answer"] <= 1.0
    assert len(results["samples"]["specserve_mc"]) == LIMIT and len(results["samples"]["specserve_gen"]) == LIMIT
    for sample in results["samples"]["specserve_gen"]:
        (answer,) = sample["resps"][0]
        assert isinstance(answer, str) and "\n" not in answer  # stopped at the line's end (`until`), or max_gen_toks
    # measured: 0.7 on the first 10 with SmolLM2-135M (0.55 on all 20); a broken scoring path (wrong rows, wrong
    # offsets) picks answers at about chance, 0.25
    assert mc["acc,none"] >= 0.5


def test_loglikelihoods_equal_the_in_process_engines(evaluated: dict[str, Any], cluster: ClusterConfig,
                                                     smollm2_dir: Path) -> None:
    lm = evaluated["lm"]
    pairs: list[tuple[list[int], list[int], float, bool]] = []
    for sample in evaluated["results"]["samples"]["specserve_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ((loglikelihood, greedy),) = resp
            context_ids, continuation_ids = lm._encode_pair(context, continuation)  # the ids lm-eval sent
            pairs.append((context_ids, continuation_ids, loglikelihood, greedy))
    assert cluster.tensor_parallel_size == 1 and cluster.dtype == "bfloat16"
    engine = local_engine(smollm2_dir, "none", dtype="bfloat16", max_batch=8, kv_blocks=512,
                          block_size=cluster.block_size, max_context=cluster.max_context)
    try:
        for i, (context_ids, continuation_ids, _, _) in enumerate(pairs):
            engine.submit(request(f"d{i}", context_ids + continuation_ids, max_tokens=0, k=0, draft="none",
                                  ignore_eos=True, prompt_logprobs=1))
        chunks = engine.run_to_completion()
        engine.kv.audit().assert_no_leaks()
    finally:
        engine.close()
    live, expected = [], []
    for i, (context_ids, continuation_ids, loglikelihood, greedy) in enumerate(pairs):
        (rows,) = [c.prompt_logprobs for c in chunks[f"d{i}"] if c.prompt_logprobs is not None]
        # row j scores prompt token j + 1: the continuation's tokens are rows len(context) - 1 onwards
        mine = rows.rows(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
        assert len(mine) == len(continuation_ids)
        live.append(loglikelihood)
        expected.append(sum(shortest(v) for v in mine.token_logprobs.tolist()))  # as lm-eval sums the server's
        assert greedy == bool((mine.ranks == 1).all()), i  # lm-eval's is_greedy: each token the likeliest
    difference = float(np.max(np.abs(np.array(live) - np.array(expected))))
    print("LM-EVAL-DIFF", f"max |live - in process| = {difference!r} over {len(pairs)} continuations")
    assert live == expected  # bit for bit

def test_nothing_leaked(cluster: ClusterConfig) -> None:
    assert_no_leaks()
