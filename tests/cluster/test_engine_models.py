"""Engine on the real SmolLM2 weights, and draft/target compatibility checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.engine_factory import EngineOptions, IncompatibleDraftError, build_local_engine
from model_runtime.testing import make_random_checkpoint
from tests.cluster.engine_helpers import plain_greedy, request, run


def test_smollm2_greedy_batch_mixing_drafts_equals_plain(smollm2_dir: Path) -> None:
    """SmolLM2 drafting for itself (every draft accepted), n-gram (partial) and none, in one batch."""
    engine = build_local_engine(str(smollm2_dir), str(smollm2_dir),
                                EngineOptions(max_batch=4, block_size=16, num_blocks=128))
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
        build_local_engine(str(target), str(draft), EngineOptions(num_blocks=32, block_size=4), tokenizer=None)
