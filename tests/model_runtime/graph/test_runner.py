"""Greedy speculative decoding through the captured steps equals plain decoding: a draft's greedy chain of k tokens
(one program: catch-up rows, then k - 1 one-row steps fed their argmax) and the target's verify with the verdict
decided on the device (accepted drafts, next token: one read), against one-token decode steps through the same
runner and through the eager forward. Rollback moves a length: a rejected row's slots are written again next round.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime.graph.buckets import Buckets
from model_runtime.graph.runner import CapturedRunner
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from tests.model_runtime.graph.scenarios import BLOCK, NUM_BLOCKS, PROMPTS, chain_step
from tests.model_runtime.random_checkpoint import make_random_checkpoint

K = 4
NEW_TOKENS = 24
TARGET_BUCKETS = Buckets(batches=(1,), rows=(1, K + 1), blocks=(16,))
DRAFT_BUCKETS = Buckets(batches=(1,), rows=(1, 2), blocks=(16,))  # catch-up: 1 row, or 2 after a full accept


def speculative(target: CapturedRunner, draft: CapturedRunner, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(the greedy output, accepted drafts per round)."""
    t_alloc, d_alloc = LocalAllocator(NUM_BLOCKS, BLOCK), LocalAllocator(NUM_BLOCKS, BLOCK)
    t_seq, d_seq = LocalSequence(), LocalSequence()
    (logits,) = target.forward_seqs([t_alloc.extend(t_seq, prompt, "last")])  # prefill: the eager forward
    draft.forward_seqs([d_alloc.extend(d_seq, prompt, "none")])
    tokens, accepted = [*prompt, int(logits[-1].argmax())], []
    while len(tokens) - len(prompt) < NEW_TOKENS:
        t_cached, d_cached = t_seq.length, d_seq.length
        d_pending = tokens[d_cached:]
        catch_up, slots = chain_step(d_alloc, [d_seq], [d_pending], K)
        (drafted,) = draft.draft_greedy(catch_up, slots)
        pending = tokens[t_cached:]
        (verdict,) = target.verify_greedy([t_alloc.extend(t_seq, pending + drafted)], [K])
        tokens += [*drafted[:verdict.accepted], verdict.next_token]
        accepted.append(verdict.accepted)
        t_seq.length = t_cached + len(pending) + verdict.accepted  # rollback: the rejected rows' slots reused
        d_seq.length = d_cached + len(d_pending) + min(verdict.accepted, K - 1)
    for alloc, seq in ((t_alloc, t_seq), (d_alloc, d_seq)):
        alloc.free(seq)
        assert sorted(alloc.free_blocks) == list(range(NUM_BLOCKS))  # no block leaked
    return tokens[len(prompt):len(prompt) + NEW_TOKENS], accepted


def plain(forward: object, prompt: list[int]) -> list[int]:
    """One token a step; `forward`: a runner's or (seqs, kv) -> the eager model's forward_seqs."""
    alloc, seq = LocalAllocator(NUM_BLOCKS, BLOCK), LocalSequence()
    step = alloc.extend(seq, prompt, "last")
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        (logits,) = forward([step])  # type: ignore[operator]
        out.append(int(logits[-1].argmax()))
        step = alloc.extend(seq, [out[-1]], "last")
    alloc.free(seq)
    assert sorted(alloc.free_blocks) == list(range(NUM_BLOCKS))
    return out


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
        want = plain(lambda seqs: target_model.forward_seqs(seqs, eager_kv), prompt)
        assert plain(target.forward_seqs, prompt) == want
        got, accepted = speculative(target, draft, prompt)
        assert got == want, (prompt, accepted)
        if draft_seed == 3:
            assert set(accepted) == {K}  # its own drafts: every one accepted, the bonus token each round
        else:
            assert min(accepted) < K  # rejections: the correction token and the rollback ran
    assert all(torch.isfinite(t).all() for t in target.kv.k)
