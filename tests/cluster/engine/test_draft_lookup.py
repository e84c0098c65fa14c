"""A draft model's requests drafting from their n-gram lookup (EngineConfig.draft_lookup, cluster/engine/planner.py):
a round takes the lookup's chain where auto expects more tokens a second from it (no draft cost) than from the draft
model, each source's acceptance measured apart; the output stays plain decoding's, the draft cache catches up over
the lookup rounds' tokens, and nothing is leaked."""

from __future__ import annotations

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.planner import PlanContext, plan_request
from cluster.engine.request_state import new_request_state
from cluster.engine.spec_policy import AutoDecision, CostModel, lookup_wins
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, fake_engine, request

PERIOD = 5


def periodic_target(sequence: list[int]) -> int:
    """The fake target repeats the token PERIOD back, except every 16th position, where it breaks the period with a
    token of the whole sequence (so a lookup's chain is right until a break, and wrong just after one)."""
    if len(sequence) % 16 == 0:
        return (sum(sequence) + 11) % FAKE_VOCAB
    return sequence[-PERIOD]


def half_right_draft(sequence: list[int]) -> int:
    """The fake draft model: the target's choice where the sum of the sequence is even (it reads every token: a draft
    cache that missed the lookup rounds' tokens reads slots never written, which the fake runner refuses)."""
    token = periodic_target(sequence)
    return token if sum(sequence) % 2 == 0 else (token + 1) % FAKE_VOCAB


def plain(prompt: list[int], max_tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(periodic_target(sequence))
    return sequence[len(prompt):]


def flat_costs(draft: float) -> CostModel:
    """Scoring 1..32 rows costs one unit; a draft step `draft` units."""
    cost = CostModel()
    cost.draft_token = draft
    cost.verify_by_tokens = {rows: 1.0 for rows in (1, 2, 3, 4, 5, 8, 16, 32)}
    return cost


PROMPT = [3, 14, 15, 92, 65, 3, 14, 15, 92]


def generate(lookup: bool, draft_cost: float = 0.5, max_tokens: int = 60) -> tuple[list[int], dict]:
    engine = fake_engine(target_rule=periodic_target, draft_rule=half_right_draft, draft_lookup=lookup,
                         cost=flat_costs(draft_cost), block_size=4)
    engine.submit(request("a", PROMPT, max_tokens=max_tokens, k=None, ignore_eos=True))
    chunks = engine.run_to_completion()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    tokens = [t for c in chunks["a"] for t in c.token_ids]
    return tokens, chunks["a"][-1].stats or {}


def test_lookup_rounds_keep_plain_decodings_output_and_take_fewer_rounds() -> None:
    with_lookup, stats = generate(lookup=True)
    without, stats_off = generate(lookup=False)
    assert with_lookup == without == plain(PROMPT, 60)
    reasons = [e["reason"] for e in stats["policy_events"]]
    assert any(r.endswith("lookup: n-gram chain") for r in reasons), reasons
    lookup = stats["lookup_acceptance"]
    assert lookup["rounds"] > 0 and lookup["accepted"] > lookup["rejections"]
    # every draft is counted in the request's acceptance: the drafter's and the lookup's
    assert stats["acceptance"]["proposed"] >= lookup["proposed"] > 0
    assert "lookup_acceptance" not in stats_off
    assert stats["rounds"] < stats_off["rounds"], (stats["rounds"], stats_off["rounds"])


def test_the_draft_model_drafts_again_after_lookup_rounds() -> None:
    """After a break of the period the lookup's chain is wrong for a while and the draft model drafts: its cache
    first takes in the tokens of the lookup rounds (the fake runner refuses a slot that was never written)."""
    tokens, stats = generate(lookup=True, draft_cost=0.05, max_tokens=90)
    assert tokens == plain(PROMPT, 90)
    reasons = [e["reason"] for e in stats["policy_events"]]
    lookups = [i for i, r in enumerate(reasons) if r.endswith("lookup: n-gram chain")]
    model_after = [i for i, r in enumerate(reasons) if i > min(lookups) and r == "cost model"]
    assert lookups and model_after, reasons
    assert stats["acceptance"]["proposed"] > stats["lookup_acceptance"]["proposed"]  # the model drafted too


def test_engine_stats_count_lookups_apart_and_together() -> None:
    engine = fake_engine(target_rule=periodic_target, draft_rule=half_right_draft, cost=flat_costs(0.5))
    engine.submit(request("a", PROMPT, max_tokens=40, k=None, ignore_eos=True))
    engine.run_to_completion()
    stats = engine.stats()
    every, lookup = stats["acceptance"], stats["lookup_acceptance"]
    assert lookup["rounds"] > 0
    assert every["rounds"] == lookup["rounds"] + engine.acceptance.rounds
    engine.reset_statistics()
    assert "lookup_acceptance" not in engine.stats()


def test_fixed_k_and_lookups_off_never_look_up() -> None:
    for engine in (fake_engine(target_rule=periodic_target, draft_rule=half_right_draft, cost=flat_costs(0.5),
                               draft_lookup=False),
                   fake_engine(target_rule=periodic_target, draft_rule=half_right_draft, cost=flat_costs(0.5))):
        k = None if not engine.config.draft_lookup else 3
        engine.submit(request("a", PROMPT, max_tokens=30, k=k, ignore_eos=True))
        chunks = engine.run_to_completion()
        stats = chunks["a"][-1].stats or {}
        assert "lookup_acceptance" not in stats
        assert not any("lookup" in e["reason"] for e in stats["policy_events"])
        engine.kv.audit().assert_no_leaks()


def test_a_lookup_wins_only_where_it_drafts_at_no_lower_rate() -> None:
    model = AutoDecision(3, "cost model", 2.0)
    assert lookup_wins(AutoDecision(2, "cost model", 2.0), model)
    assert not lookup_wins(AutoDecision(2, "cost model", 1.9), model)
    assert not lookup_wins(AutoDecision(0, "fallback", 3.0), model)
    assert not lookup_wins(AutoDecision(1, "probe: re-measuring acceptance after plain decoding"), model)
    assert lookup_wins(AutoDecision(1, "cost model", 0.5), AutoDecision(0, "fallback", 1.0))
    assert lookup_wins(AutoDecision(1, "cost model", 0.5), AutoDecision(2, "warm-up: measuring draft and verify cost"))


def context(lookup: bool, cost: CostModel, drafter_usable: bool = True) -> PlanContext:
    return PlanContext(k_max=4, probe_every=32, pressure_free_fraction=0.1, free_fraction=1.0,
                       drafter_usable=drafter_usable, engine_acceptance=AcceptanceStats(), cost=cost, batch=1,
                       lookup=lookup)


def state_after(prompt: list[int], k: int | None = None, **sampling):
    return new_request_state(request("r", prompt, max_tokens=32, k=k, **sampling), None, frozenset(), FAKE_VOCAB,
                             1024, has_drafter=True)


def test_plan_takes_the_lookup_chain_where_it_pays_and_the_model_elsewhere() -> None:
    periodic = PROMPT + [65, 3, 14]  # the lookup finds "15 92 65 3 14" after "3 14"
    plan = plan_request(state_after(periodic), context(True, flat_costs(0.5)))
    assert plan.lookup and not plan.uses_model_drafter and plan.drafts == [15, 92, 65, 3][:plan.k] and plan.k > 0
    assert plan_request(state_after(periodic), context(False, flat_costs(0.5))).uses_model_drafter
    # no match: the draft model, as without lookups
    plan = plan_request(state_after([1, 2, 3, 4, 5, 6, 7]), context(True, flat_costs(0.5)))
    assert not plan.lookup and plan.uses_model_drafter
    # a match of fewer than LOOKUP_N tokens: the draft model
    plan = plan_request(state_after([1, 2, 3, 4, 5, 6, 7, 3]), context(True, flat_costs(0.5)))
    assert not plan.lookup and plan.uses_model_drafter
    # its lookups were rejected every time (and other requests' count for nothing): the model's chain
    state = state_after(periodic)
    for _ in range(12):
        state.lookup_acceptance.record(0, 3, "greedy")
    plan = plan_request(state, context(True, flat_costs(0.05)))
    assert not plan.lookup and plan.uses_model_drafter, plan.reason


def test_a_lost_drafter_still_drafts_from_the_lookup() -> None:
    periodic = PROMPT + [65, 3, 14]
    plan = plan_request(state_after(periodic), context(True, flat_costs(0.5), drafter_usable=False))
    assert plan.lookup and plan.k > 0 and not plan.uses_model_drafter
    plan = plan_request(state_after([1, 2, 3, 4, 5, 6, 7]), context(True, flat_costs(0.5), drafter_usable=False))
    assert plan.k == 0 and plan.reason == "fallback: drafter unavailable, plain decoding"
