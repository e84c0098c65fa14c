"""Token trees in the round: suffix drafts verified in one forward, only the accepted path committed.

The fake target below continues a walk whose next token depends on the last token and on the parity of the
whole sequence's sum: its outputs repeat (so the suffix trie proposes), a token has two successors (so side
branches get accepted), and a slot holding a stale token (a rejected sibling left where the accepted path
should have been moved) flips the parity and shows as a wrong token against plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from cluster.engine.accept import accept_round
from cluster.engine.request_state import RequestState, new_request_state
from cluster.engine.round_plan import RoundPlan
from kv_manager.schema import Holder
from model_runtime.batch import SeqInput
from specserve_types.api import SamplingParams
from specserve_types.round_messages import VerifyBatch, VerifyItem, VerifyOutput
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, FakeRunner, fake_engine, request, run
from verifier_service.worker import VerifierWorker

WALK = np.random.default_rng(5).permutation(12)  # a token's successor: one cycle through 12 tokens or another


def walk_next(sequence: list[int]) -> int:
    return int(WALK[(sequence[-1] + 5 * (sum(sequence) % 2)) % 12])


def walk_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(walk_next(sequence))
    return sequence[len(prompt):]


PROMPTS = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [7, 7, 7], [4, 9, 4, 9, 11, 4], [0], [5, 3, 5, 3, 5, 3, 5, 10]]


@pytest.mark.parametrize("k", [None, 2, 4], ids=["auto", "k2", "k4"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_suffix_trees_equal_plain_decoding_and_commit_only_the_path(k: int | None, max_batch: int) -> None:
    engine = fake_engine(max_batch=max_batch, block_size=4, target_rule=walk_next, k_max=4, tree_nodes=12)
    requests = [request(f"r{i}", p, max_tokens=40 + 3 * i, k=k, draft="suffix") for i, p in enumerate(PROMPTS)]
    got = run(engine, requests)  # checks the ledger is empty and nothing leaked
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"] == walk_greedy(p, 40 + 3 * i), f"r{i}"
    stats = engine.acceptance
    if k is not None:  # auto sizes trees by the fake's verify times (tree_policy.py): chains, mostly
        assert stats.tree_rounds > 0
        assert sum(stats.accepted_by_rank[1:]) > 0, "no side branch was ever accepted: the test tests chains only"
    assert engine.suffix.live() == 0 and engine.suffix.cache.global_trie.paths()  # outputs kept globally


def test_tree_limit_zero_gives_chains() -> None:
    engine = fake_engine(max_batch=2, target_rule=walk_next, tree_nodes=0)
    got = run(engine, [request(f"r{i}", p, max_tokens=30, k=3, draft="suffix") for i, p in enumerate(PROMPTS[:2])])
    assert got["r0"] == walk_greedy(PROMPTS[0], 30) and got["r1"] == walk_greedy(PROMPTS[1], 30)
    assert engine.acceptance.tree_rounds == 0 and engine.acceptance.accepted > 0


def test_the_commit_keeps_the_accepted_path_only() -> None:
    state = new_request_state(request("t", [5, 6, 7], max_tokens=10, draft="suffix"), None, (), FAKE_VOCAB, 1024,
                              has_drafter=False)
    state.target_cached = 2  # token 7 is the round's input (the root)
    #   root -> 10 (0) -> 11 (2) ; root -> 20 (1) -> 21 (3) -> 22 (4)
    plan = RoundPlan(state=state, k=5, target_pending=[7], drafts=[10, 20, 11, 21, 22], draft_parents=(-1, -1, 0, 1, 3))
    out = VerifyOutput("t", 3, [20, 21, 22, 30], True, accepted_path=[1, 3, 4])
    outcome = accept_round([plan], [out], Holder("v", 0), None)
    (commit,) = outcome.commits
    assert commit.accepted_len == 4 and list(commit.token_ids) == [7, 20, 21, 22] and commit.accepted_path is None
    assert state.output_ids == [20, 21, 22, 30] and state.target_cached == 6
    (record,) = outcome.acceptance
    assert (record.accepted, record.proposed, record.ranks, record.tree_nodes) == (3, 3, (1, 0, 0), 5)


def test_the_verifier_moves_the_path_to_the_first_draft_slots_before_its_next_forward() -> None:
    runner = FakeRunner(walk_next, block_size=4)
    worker = VerifierWorker(runner)
    prompt = [1, 2, 3, 1, 2]  # positions 0..4 in slots 0..4 (block table [0, 1, 2]: slot = position)
    runner.forward([SeqInput(prompt, 0, [0, 1], list(range(5)), logits="none")], [])
    sequence = prompt + [walk_next(prompt)]  # the round's root, position 5
    a1 = walk_next(sequence)
    a2 = walk_next(sequence + [a1])
    #   root -> wrong (slot 6) ; root -> a1 (slot 7) -> wrong (slot 8) ; a1 -> a2 (slot 9): the path is [1, 3]
    drafts = [(a1 + 1) % 12, a1, (a2 + 1) % 12, a2]
    item = VerifyItem("t", input_ids=sequence[5:], draft_ids=drafts, draft_probs=None, past_len=5,
                      block_table=[0, 1, 2], slot_mapping=[5, 6, 7, 8, 9], sampling=SamplingParams(max_tokens=9),
                      contract="greedy", seed=0, position=6, draft_parents=[-1, -1, 1, 1])
    (out,) = worker.verify(VerifyBatch([item])).outputs
    assert out.accepted_path == [1, 3] and out.tokens == walk_greedy(sequence, 3) and out.bonus
    assert runner.pool[6] == drafts[0] and runner.pool[7] == a1  # not moved yet
    # the next round reads positions 0..7 through the table: the moves (7 -> 6, 9 -> 7) run first
    nxt = VerifyItem("t", input_ids=out.tokens[-1:], draft_ids=[], draft_probs=None, past_len=8,
                     block_table=[0, 1, 2], slot_mapping=[8], sampling=SamplingParams(max_tokens=9),
                     contract="greedy", seed=0, position=9)
    (after,) = worker.verify(VerifyBatch([nxt])).outputs
    assert [runner.pool[s] for s in range(9)] == sequence + out.tokens
    assert after.tokens == walk_greedy(sequence + out.tokens, 1)


def test_trees_refuse_rootless_or_penalized_items() -> None:
    worker = VerifierWorker(FakeRunner(walk_next, block_size=4))
    base = dict(draft_ids=[1, 2], draft_probs=None, past_len=0, block_table=[0], slot_mapping=[0, 1, 2],
                contract="greedy", seed=0, position=1, draft_parents=[-1, -1])
    with pytest.raises(ValueError, match="root"):
        worker.verify(VerifyBatch([VerifyItem("a", input_ids=[], sampling=SamplingParams(), **base)]))
    with pytest.raises(ValueError, match="penalties"):
        worker.verify(VerifyBatch([VerifyItem("b", input_ids=[3], sampling=SamplingParams(repetition_penalty=1.2),
                                              **base)]))


def second_guess(sequence: list[int]) -> list[int]:
    """A draft model that ranks a wrong token first at every third position and the right one second: its trees
    branch there, and the side branch is the one the target accepts."""
    right = walk_next(sequence)
    return [(right + 1) % 12, right] if len(sequence) % 3 == 0 else [right, (right + 1) % 12]


@pytest.mark.parametrize("max_batch", [1, 4])
def test_draft_model_trees_equal_plain_decoding(max_batch: int) -> None:
    engine = fake_engine(max_batch=max_batch, block_size=4, target_rule=walk_next, draft_rule=second_guess,
                         k_max=4, model_tree_nodes=10)
    requests = [request(f"r{i}", p, max_tokens=30 + 3 * i, k=3, draft="model") for i, p in enumerate(PROMPTS)]
    got = run(engine, requests)
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"] == walk_greedy(p, 30 + 3 * i), f"r{i}"
    stats = engine.acceptance
    assert stats.tree_rounds == stats.rounds  # every drafting round drafted a tree
    assert stats.accepted_by_rank[1] > 0 and stats.accepted == stats.proposed  # the second guesses were accepted


def test_draft_model_trees_stay_chains_in_two_group_overlap() -> None:
    engine = fake_engine(max_batch=4, overlap=True, target_rule=walk_next, draft_rule=second_guess,
                         model_tree_nodes=10)
    got = run(engine, [request(f"r{i}", p, max_tokens=20, k=3, draft="model") for i, p in enumerate(PROMPTS[:4])])
    assert all(got[f"r{i}"] == walk_greedy(p, 20) for i, p in enumerate(PROMPTS[:4]))
    assert engine.acceptance.tree_rounds == 0


def test_suffix_falls_back_to_the_n_gram_match_where_its_tries_have_no_candidate() -> None:
    from cluster.engine.acceptance_stats import AcceptanceStats
    from cluster.engine.planner import PlanContext, plan_request
    from cluster.engine.spec_policy import CostModel
    from drafter_service.suffix_drafts import SuffixDrafter

    tokens = [1, 2, 3, 4, 9, 5, 6, 9]  # "9" once before, then 5 6: the trie scores 5 at 1/2

    def fresh() -> RequestState:
        return new_request_state(request("f", tokens, max_tokens=10, k=2, draft="suffix"), None, (), FAKE_VOCAB,
                                 1024, has_drafter=False)

    def context(min_score: float) -> PlanContext:
        return PlanContext(k_max=4, probe_every=32, pressure_free_fraction=0.1, free_fraction=1.0,
                           drafter_usable=False, engine_acceptance=AcceptanceStats(), cost=CostModel(), batch=1,
                           suffix=SuffixDrafter(min_score=min_score), tree_nodes=0)

    own = plan_request(fresh(), context(0.0))
    assert own.drafts == [5, 6] and "n-gram" not in own.reason
    fallback = plan_request(fresh(), context(0.9))  # nothing scores 0.9: the n-gram drafter's latest match
    assert fallback.drafts == [5, 6] and "suffix: no match, n-gram" in fallback.reason
    assert not fallback.state.policy_events  # the plan is an intent: the engine records it
