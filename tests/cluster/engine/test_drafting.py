"""The drafter's part of a round (drafting.py) as functions on values, on the model-free engine: a round strung by
hand from them gives plain greedy tokens; a replaced drafter, invalid drafts and a failed call each come back as a
`Drafted` whose plans decode plainly and which asks for the draft caches' restart, and none of them writes a
request's state (the engine applies it). Each run ends with an empty ledger and no leaked block."""

from __future__ import annotations

import time

import pytest

from cluster.engine.drafting import Drafted, answered, failed, propose_batch
from cluster.engine.engine import SpecEngine
from cluster.engine.round_plan import RoundPlan
from specserve_types.round_messages import ProposeOutput, ProposeResult
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, fake_engine, fake_greedy, request

PROMPTS = {"a": [5, 17, 42, 8, 3], "b": [11, 2, 60, 9, 33, 71, 4]}
MAX_TOKENS = 16


def planned_round() -> tuple[SpecEngine, dict[str, list[int]], list[RoundPlan], ProposeResult]:
    """An engine one round in (its tokens), its next round planned and reserved, and the drafter's answer to it."""
    engine = fake_engine(max_batch=2)
    for rid, prompt in PROMPTS.items():
        engine.submit(request(rid, prompt, max_tokens=MAX_TOKENS, k=3))
    out = {rid: [] for rid in PROMPTS}
    for chunk in engine.step():
        out[chunk.request_id] += chunk.token_ids
    plans = engine.reserve(engine.plan(engine.running, model_trees=False), may_preempt=False, own_step=True)
    batch = propose_batch(plans, constrain=True, trace_context=())
    assert batch is not None and {i.request_id for i in batch.items} == set(PROMPTS)
    return engine, out, plans, engine.drafter.propose(batch)  # type: ignore[union-attr]


def finish(engine: SpecEngine, out: dict[str, list[int]], drafted: Drafted) -> None:
    """The engine applies the decision and verifies the round; the requests run out to plain greedy tokens."""
    plans = engine.drafted(drafted)
    call = engine.verify(plans, windows=False)
    assert call is not None
    outcome = engine.accept(call.plans, call.result)
    now = time.perf_counter()
    for chunk in engine.close_round(call.plans, outcome, False, 0.0, call.result.seconds, now, now):
        out[chunk.request_id] += chunk.token_ids
    for rid, chunks in engine.run_to_completion().items():
        out[rid] += [t for c in chunks for t in c.token_ids]
    assert out == {rid: fake_greedy(p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    engine.close()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


def snapshot(plans: list[RoundPlan]) -> list[tuple]:
    return [(p.state.k, list(p.state.policy_events), p.state.draft_cached, p.state.draft_admitted) for p in plans]


def test_the_drafters_answer_becomes_the_plans_drafts() -> None:
    engine, out, plans, result = planned_round()
    before = snapshot(plans)
    drafted = answered(plans, result, engine.health, engine.cost, FAKE_VOCAB)
    by_id = {o.request_id: o.draft_ids for o in result.outputs}
    assert not drafted.restart and all(p.drafts == by_id[p.request_id] for p in drafted.plans)
    assert all(p.drafts == [] for p in plans)  # the plans it was given stay what they were
    assert snapshot(plans) == before
    finish(engine, out, drafted)


@pytest.mark.parametrize("case", ["replaced", "invalid", "failed"])
def test_a_lost_or_lying_drafter_leaves_the_round_to_plain_decoding(case: str) -> None:
    engine, out, plans, result = planned_round()
    before = snapshot(plans)
    holder = engine.health.drafter_holder
    if case == "replaced":  # a new process (an empty KV pool) answered
        drafted = answered(plans, ProposeResult(result.outputs, result.seconds, "new-process"), engine.health,
                           engine.cost, FAKE_VOCAB)
        reason, event = "drafter replaced: re-prefilling its cache", "drafter replaced"
    elif case == "invalid":  # an id outside the vocabulary
        outputs = [ProposeOutput(o.request_id, [FAKE_VOCAB] + list(o.draft_ids[1:]), None) for o in result.outputs]
        drafted = answered(plans, ProposeResult(outputs, result.seconds, result.worker_instance), engine.health,
                           engine.cost, FAKE_VOCAB)
        reason, event = "fallback: drafter returned invalid drafts", "drafter unavailable"
    else:
        drafted = failed(plans, engine.health, TimeoutError("drafter timed out"))
        reason, event = "fallback: drafter failed, plain decoding", "drafter unavailable"
    assert drafted.restart and not drafted.stops
    assert all((p.k, p.drafts, p.draft_grant, p.reason) == (0, [], None, reason) for p in drafted.plans)
    assert snapshot(plans) == before  # the states are the engine's to change (drafted, record_k)
    assert [e["event"] for e in engine.health.take_events()] == [event]
    # the epoch that made the grants is gone: replaced at once, or a failed drafter backs off before its retry
    assert engine.health.drafter_holder != holder if case == "replaced" else not engine.health.drafter_usable()
    finish(engine, out, drafted)
