"""Engine on the real SmolLM2 weights, and draft/target compatibility checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.engine.factory import IncompatibleDraftError
from tests.cluster.engine.engine_helpers import local_engine, plain_greedy, request, run
from tests.model_runtime.random_checkpoint import make_random_checkpoint


def test_smollm2_greedy_batch_mixing_drafts_equals_plain(smollm2_dir: Path) -> None:
    """SmolLM2 drafting for itself (every draft accepted), n-gram (partial) and none, in one batch."""
    engine = local_engine(smollm2_dir, smollm2_dir, max_batch=4, block_size=16, kv_blocks=128)
    tok = engine.tokenizer
    prompts = [tok(t)["input_ids"] for t in
               ["The capital of France is", "def fib(n):\n    if n < 2:\n        return n\n    return",
                "1, 2, 3, 4, 5, 6,", "Once upon a time"]]
    reqs = [request("self", prompts[0], max_tokens=20, k=4, draft="model"),
            request("ngram", prompts[1], max_tokens=24, k=3, draft="ngram"),
            request("none", prompts[2], max_tokens=16, draft="none"),
            request("auto", prompts[3], max_tokens=18, k=None, draft="model")]
    got = run(engine, reqs)
    eos = set(engine.eos_token_ids)
    for r, p in zip(reqs, prompts, strict=True):
        assert got[r.request_id] == plain_greedy(smollm2_dir, p, r.sampling.max_tokens, eos), r.request_id
    stats = engine.stats()["acceptance"]
    assert stats["accepted"] > 0
    engine.kv.audit().assert_no_leaks()


def test_incompatible_draft_refused_before_any_request(tmp_path: Path) -> None:
    target = make_random_checkpoint(tmp_path / "t", vocab_size=64)
    draft = make_random_checkpoint(tmp_path / "d", vocab_size=80)
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        local_engine(target, draft, tokenizer=None, max_batch=8, kv_blocks=32, block_size=4)


EIGHT_PROMPTS = ["The capital of France is", "def fib(n):\n    if n < 2:\n        return n\n    return",
                 "1, 2, 3, 4, 5, 6,", "Once upon a time", "The three primary colours are",
                 "import numpy as np\nx = np.", "Water boils at", "My favourite fruit is the"]


@pytest.mark.model
def test_smollm2_batch_8_k_4_equals_each_request_alone(smollm2_dir: Path) -> None:
    """Loads SmolLM2 (model test). 8 requests drafting for themselves with k=4: every verify after the
    first scores 8 x 5 = 40 rows in one forward, and each request's tokens equal plain greedy decoding of
    that request alone (1 row per forward): a row's logits do not depend on how many rows share the call."""
    engine = local_engine(smollm2_dir, smollm2_dir, max_batch=8, block_size=16, kv_blocks=128)
    prompts = [engine.tokenizer(t)["input_ids"] for t in EIGHT_PROMPTS]
    reqs = [request(f"r{i}", p, max_tokens=16, k=4, draft="model") for i, p in enumerate(prompts)]
    got = run(engine, reqs)
    # a wide verify ran: 5 rows for each request still running after the first round (one that met EOS within
    # its first 5 tokens has left; which ones do depends on the kernels' rounding, not on the batch)
    running = sum(len(got[r.request_id]) > 4 + 1 for r in reqs)
    assert running >= 6 and running * (4 + 1) in engine.stats()["cost_model"]["verify_seconds_by_tokens"]
    eos = set(engine.eos_token_ids)
    for r, p in zip(reqs, prompts, strict=True):
        assert got[r.request_id] == plain_greedy(smollm2_dir, p, r.sampling.max_tokens, eos), r.request_id
    engine.kv.audit().assert_no_leaks()
