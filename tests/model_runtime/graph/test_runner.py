"""Greedy speculative decoding through the captured steps equals plain decoding: a draft's greedy chain of k tokens
(one program: catch-up rows, then k - 1 one-row steps fed their argmax) and the target's verify with the verdict
decided on the device (accepted drafts, next token: one read), against one-token decode steps through the same
runner and through the eager forward (model_runtime/graph/local_loop.py's loops; no block leaked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime.graph.buckets import Buckets
from model_runtime.graph.local_loop import plain_greedy, speculative_greedy
from model_runtime.graph.runner import CapturedRunner
from model_runtime.model import CausalLM
from tests.model_runtime.graph.scenarios import BLOCK, NUM_BLOCKS, PROMPTS
from tests.model_runtime.random_checkpoint import make_random_checkpoint

K = 4
NEW_TOKENS = 24
TARGET_BUCKETS = Buckets(batches=(1,), rows=(1, K + 1), blocks=(16,))
DRAFT_BUCKETS = Buckets(batches=(1,), rows=(1, 2), blocks=(16,))  # catch-up: 1 row, or 2 after a full accept


@pytest.mark.parametrize("draft_seed", [3, 9], ids=["draft-is-target", "other-draft"])
def test_greedy_speculative_equals_plain_through_the_captured_steps(draft_seed: int, tmp_path: Path) -> None:
    target_model = CausalLM.load(make_random_checkpoint(tmp_path / "target", seed=3))
    draft_model = CausalLM.load(make_random_checkpoint(tmp_path / "draft", seed=draft_seed, num_layers=1)
                                if draft_seed != 3 else make_random_checkpoint(tmp_path / "draft", seed=3))
    target = CapturedRunner(target_model, NUM_BLOCKS, BLOCK, TARGET_BUCKETS)
    draft = CapturedRunner(draft_model, NUM_BLOCKS, BLOCK, DRAFT_BUCKETS, chain=K)
    target.warm_up()
    draft.warm_up(verify=[], draft=DRAFT_BUCKETS.all())
    eager_kv = target_model.allocate_kv(NUM_BLOCKS, BLOCK)
    for prompt in PROMPTS:
        want = plain_greedy(lambda seqs: target_model.forward_seqs(seqs, eager_kv), prompt, NEW_TOKENS, NUM_BLOCKS,
                            BLOCK)
        assert plain_greedy(target.forward_seqs, prompt, NEW_TOKENS, NUM_BLOCKS, BLOCK) == want
        got, accepted = speculative_greedy(target, draft, prompt, NEW_TOKENS, NUM_BLOCKS)
        assert got == want, (prompt, accepted)
        if draft_seed == 3:
            assert set(accepted) == {K}  # its own drafts: every one accepted, the bonus token each round
        else:
            assert min(accepted) < K  # rejections: the correction token and the rollback ran
    assert all(torch.isfinite(t).all() for t in target.kv.k)
