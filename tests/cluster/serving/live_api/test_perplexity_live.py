"""`specserve bench perplexity --server` against the live cluster (live_api/conftest.py: SmolLM2-135M, bfloat16, one
verifier rank): the bench reads the server's model and dtype from /v1/stats, scores the shipped text's windows
(llama-perplexity's cut, n_ctx 128: 2 windows) through /v1/completions (echo, logprobs 0, max_tokens 0) and in
process, and the two agree bit for bit (the batch-invariant bfloat16 kernels on both sides; the server writes each
float32 as its shortest decimal, which reads back to the same bits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.bench import perplexity as ppl
from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import BASE_URL, MAX_CONTEXT, assert_no_leaks

pytestmark = pytest.mark.timeout(300)

N_CTX = 128


def test_server_perplexity_equals_in_process_bit_for_bit(cluster: ClusterConfig, smollm2_dir: Path,
                                                          tmp_path: Path) -> None:
    assert cluster.dtype == "bfloat16" and cluster.tensor_parallel_size == 1 and N_CTX <= MAX_CONTEXT
    text = tmp_path / "short.txt"
    text.write_text(ppl.read_text()[:1400] + "\n", encoding="utf-8")  # ~300 SmolLM2 tokens: 2 windows of 128
    result = ppl.run_perplexity_bench(ppl.PerplexitySettings(model="smollm2-135m", dtypes=("bfloat16",),
                                                             n_ctx=N_CTX, text=text, server=BASE_URL))
    print(ppl.format_perplexity(result))
    assert result["server"] == {"url": BASE_URL, "model": "smollm2-135m", "dtype": "bfloat16"}
    assert result["windows"] == 2 and result["notes"] == []
    (row,) = result["rows"]
    assert row["dtype"] == "bfloat16"
    assert row[ppl.IN_PROCESS]["tokens"] == row[ppl.SERVER]["tokens"] == 2 * (N_CTX - 1 - N_CTX // 2)
    assert row["server_vs_in_process"] == {"bitwise_equal": True, "max_abs_diff": 0.0, "ppl_diff": 0.0}
    assert 1.0 < row[ppl.SERVER]["ppl"] < 100.0


def test_nothing_leaked(cluster: ClusterConfig) -> None:
    assert_no_leaks()
