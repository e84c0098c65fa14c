"""The draft cache's catch-up, priced (cluster/engine/catch_up.py): a model-drafted round whose draft cache lacks
many tokens runs only where drafting saves more than feeding them costs, or where that costs no more than a look at
the request's own acceptance may; the catch-up's cost is timed from the propose calls that carry one."""

from __future__ import annotations

import pytest

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.catch_up import (
    LOOK_BUDGET,
    TIMED_CATCH_UP,
    USUAL_CATCH_UP,
    observe_propose,
    price_catch_up,
)
from cluster.engine.planner import PlanContext, plan_request
from cluster.engine.request_state import new_request_state
from cluster.engine.round_plan import RoundPlan
from cluster.engine.spec_policy import AutoInputs, CostModel
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, fake_engine, request

VERIFY = {1: 0.050, 2: 0.055, 3: 0.060, 4: 0.065, 5: 0.070}  # seconds per verify of n rows


def costs(row: float | None, draft: float = 0.010) -> CostModel:
    cost = CostModel()
    cost.draft_token, cost.draft_catch_up_row, cost.verify_by_tokens = draft, row, dict(VERIFY)
    return cost


def accepting(rate_per_round: int, rounds: int = 40) -> AcceptanceStats:
    stats = AcceptanceStats()
    for _ in range(rounds):
        stats.record(rate_per_round, 4, "greedy")
    return stats


def inputs(cost: CostModel, own: AcceptanceStats, tokens_left: int | None = 64) -> AutoInputs:
    return AutoInputs(own, AcceptanceStats(), cost, 4, 1, 0, 32, 1.0, 0.1, draft_cost_per_token=cost.draft_token,
                      tokens_left=tokens_left)


def test_nothing_is_priced_without_a_catch_up_a_measured_cost_or_a_bound() -> None:
    good = accepting(4)
    assert price_catch_up(inputs(costs(0.005), good), USUAL_CATCH_UP) is None
    assert price_catch_up(inputs(costs(None), good), 100) is None
    assert price_catch_up(inputs(costs(0.005), good, tokens_left=None), 100) is None
    assert price_catch_up(inputs(costs(0.005), good), 100) is not None


def test_a_catch_up_pays_where_drafting_saves_more_over_the_tokens_left() -> None:
    tokens = 100
    good, poor = accepting(4), accepting(0)
    # every draft accepted: k = 4 gives ~5 tokens (the survival estimate shrunk a little towards the prior) for
    # 0.04 + 0.07 s where plain gives 1 for 0.05
    price = price_catch_up(inputs(costs(0.005), good), tokens)
    assert price is not None
    assert price.extra == pytest.approx((tokens - USUAL_CATCH_UP) * 0.005)
    assert price.saved == pytest.approx(64 * (0.05 - 0.11 / 5), rel=0.01)
    assert price.budget == pytest.approx(LOOK_BUDGET * 64 * 0.05) and price.pays
    # nothing ever accepted: drafting saves nothing, and 0.49 s is more than a look may cost (0.16 s)
    price = price_catch_up(inputs(costs(0.005), poor), tokens)
    assert price is not None and price.saved == 0.0 and not price.pays
    # a cheap catch-up (AMX tiles: ~0.4 ms a token) stays within the look's budget
    price = price_catch_up(inputs(costs(0.0004), poor), tokens)
    assert price is not None and price.pays
    # near the end of the request even a good draft cannot earn a long catch-up back
    price = price_catch_up(inputs(costs(0.005), good, tokens_left=8), tokens)
    assert price is not None and not price.pays


def plan_of(pending: int, draft_cached: int) -> RoundPlan:
    state = new_request_state(request("r", list(range(1, pending + 1)), max_tokens=32, k=None), None, frozenset(),
                              FAKE_VOCAB, 1024, has_drafter=True)
    state.draft_cached = draft_cached
    return RoundPlan(state=state, k=2, target_pending=[], draft_pending=state.token_ids[draft_cached:],
                     uses_model_drafter=True)


def test_a_propose_call_times_a_draft_step_or_its_catch_up() -> None:
    cost = CostModel()
    observe_propose(cost, [plan_of(40, 38)], steps=2, seconds=0.020)  # the usual catch-up: a draft step
    assert cost.draft_token == pytest.approx(0.010) and cost.draft_catch_up_row is None
    # 40 tokens to catch up, 38 beyond the usual: the call less its two steps, per token
    observe_propose(cost, [plan_of(40, 0)], steps=2, seconds=0.020 + 38 * 0.005)
    assert cost.draft_catch_up_row == pytest.approx(0.005) and cost.draft_token == pytest.approx(0.010)
    # in a batch the catch-ups add up; a call faster than its steps counts as free, never negative
    observe_propose(cost, [plan_of(40, 0), plan_of(12, 2)], steps=1, seconds=0.001)
    assert cost.draft_catch_up_row == pytest.approx(0.8 * 0.005)
    # a few tokens beyond the usual are not timed (their share is within the steps' jitter), nor a draft step
    before = (cost.draft_catch_up_row, cost.draft_token)
    observe_propose(cost, [plan_of(40, 40 - USUAL_CATCH_UP - TIMED_CATCH_UP + 1)], steps=2, seconds=1.0)
    assert (cost.draft_catch_up_row, cost.draft_token) == before


def context(cost: CostModel, lookup: bool = False) -> PlanContext:
    return PlanContext(k_max=4, probe_every=32, pressure_free_fraction=0.1, free_fraction=1.0, drafter_usable=True,
                       engine_acceptance=accepting(0), cost=cost, batch=1, lookup=lookup)


def state_of(prompt: list[int], **kw):
    return new_request_state(request("r", prompt, max_tokens=64, k=None, **kw), None, frozenset(), FAKE_VOCAB, 1024,
                             has_drafter=True)


def test_the_plan_decodes_plainly_or_looks_up_where_the_catch_up_does_not_pay() -> None:
    prompt = [(7 * i) % 50 + 1 for i in range(120)]  # no repeated 3-gram: no lookup
    state = state_of(prompt)
    state.acceptance.record(0, 2, "greedy")  # its drafts were rejected, so drafting saves nothing
    plan = plan_request(state, context(costs(0.005)))
    assert plan.k == 0 and not plan.uses_model_drafter
    assert plan.reason.startswith("draft catch-up: 120 tokens cost 590 ms")
    # where the draft cache holds all but the usual two tokens, the draft model drafts as before
    state = state_of(prompt)
    state.acceptance.record(0, 2, "greedy")
    state.draft_cached = len(prompt) - 2
    assert plan_request(state, context(costs(0.005))).uses_model_drafter
    # the same catch-up at AMX's cost per token: a look at its own acceptance, within the budget
    state = state_of(prompt)
    assert plan_request(state, context(costs(0.0004))).uses_model_drafter
    # a vetoed model round still drafts from the request's lookup where it has one (past its prompt's round)
    state = state_of([3, 14, 15, 92, 65] * 24)
    state.target_cached = len(state.token_ids) - 1
    plan = plan_request(state, context(costs(0.005), lookup=True))
    assert plan.lookup and plan.k > 0 and not plan.uses_model_drafter


def test_fixed_k_and_seeded_sampled_requests_never_read_the_catch_up_cost() -> None:
    prompt = [(7 * i) % 50 + 1 for i in range(120)]
    fixed = new_request_state(request("r", prompt, max_tokens=64, k=3), None, frozenset(), FAKE_VOCAB, 1024,
                              has_drafter=True)
    assert plan_request(fixed, context(costs(0.005))).uses_model_drafter
    seeded = state_of(prompt, temperature=0.7, seed=5)
    assert plan_request(seeded, context(costs(0.005))).uses_model_drafter


def test_an_engine_whose_draft_catch_up_never_pays_decodes_plainly_and_leaks_nothing() -> None:
    cost = costs(10.0)  # a catch-up no request earns back
    engine = fake_engine(cost=cost, draft_lookup=False)
    plain_engine = fake_engine(draft_lookup=False)
    prompt = [(7 * i) % 50 + 1 for i in range(40)]
    engine.submit(request("a", prompt, max_tokens=24, k=None, ignore_eos=True))
    plain_engine.submit(request("a", prompt, max_tokens=24, k=0, ignore_eos=True))
    chunks, expected = engine.run_to_completion(), plain_engine.run_to_completion()
    tokens = [t for c in chunks["a"] for t in c.token_ids]
    assert tokens == [t for c in expected["a"] for t in c.token_ids]
    stats = chunks["a"][-1].stats or {}
    assert stats["acceptance"]["proposed"] == 0
    assert any(e["reason"].startswith("draft catch-up:") for e in stats["policy_events"]), stats["policy_events"]
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    assert engine.cost.draft_catch_up_row == pytest.approx(10.0)  # never paid, so never timed again
