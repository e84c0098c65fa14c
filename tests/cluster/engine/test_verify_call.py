"""The verify phase as a function on values (verify_call.py), on the model-free engine: `verify_round` changes no
engine total (its counts and times come back in `totals`, with the ledger call beside it), a lost verifier's
`VerifierLost` carries that call's times too, and the round it verified accepts to plain greedy tokens. Each run ends
with an empty ledger and no leaked block."""

from __future__ import annotations

import time

import pytest

from cluster.engine.engine import SpecEngine
from cluster.engine.give_back import recover_verifier
from cluster.engine.round_plan import RoundPlan, window_items
from cluster.engine.verify_call import VerifierLost, verify_round
from specserve_types.round_messages import VerifyBatch, VerifyResult
from tests.cluster.engine.engine_helpers import fake_engine, fake_greedy, request

PROMPTS = {"a": [5, 17, 42, 8, 3], "b": [11, 2, 60, 9, 33, 71, 4]}
MAX_TOKENS = 16


class FailOnce:
    def __init__(self, inner: object) -> None:
        self.inner, self.failed = inner, False

    def verify(self, batch: VerifyBatch, on_sent=None) -> VerifyResult:
        if not self.failed:
            self.failed = True
            if on_sent is not None:
                on_sent()  # the ledger call rides beside it, then the verifier is lost
            raise ConnectionError("verifier replica gone")
        return self.inner.verify(batch, on_sent=on_sent)  # type: ignore[attr-defined]


def proposed_round(engine: SpecEngine) -> tuple[dict[str, list[int]], list[RoundPlan]]:
    """One round in (its tokens); the next round's plans with their drafts."""
    for rid, prompt in PROMPTS.items():
        engine.submit(request(rid, prompt, max_tokens=MAX_TOKENS, k=3))
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for chunk in engine.step():
        out[chunk.request_id] += chunk.token_ids
    plans = engine.reserve(engine.plan(engine.running, model_trees=False), may_preempt=False, own_step=True)
    plans, _ = engine.propose(plans, own_step=True)
    return out, plans


def windows(engine: SpecEngine):
    return lambda plans: window_items(plans, engine.config.k_max, engine.health.verifier_holder,
                                      engine.health.drafter_holder)


def run_out(engine: SpecEngine, out: dict[str, list[int]]) -> None:
    for rid, chunks in engine.run_to_completion().items():
        out[rid] += [t for c in chunks for t in c.token_ids]
    assert out == {rid: fake_greedy(p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    engine.close()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


def test_a_verified_round_brings_its_totals_back() -> None:
    engine = fake_engine(max_batch=2)
    out, plans = proposed_round(engine)
    totals = dict(engine.totals)
    call = verify_round(engine.verifier, engine.kv, engine.health, engine.trace, engine.cost, plans,
                        engine.config.exact_rule, windows(engine))
    assert dict(engine.totals) == totals  # nothing counted on the engine
    assert set(call.totals) == {"kv_seconds", "kv_ahead_wait_seconds", "verify_call_seconds"}
    assert call.totals["verify_call_seconds"] >= call.result.seconds > 0
    assert [p.request_id for p in call.plans] == [p.request_id for p in plans]
    assert {o.request_id for o in call.result.outputs} == set(PROMPTS)
    outcome = engine.accept(call.plans, call.result)
    now = time.perf_counter()
    for chunk in engine.close_round(call.plans, outcome, True, 0.0, call.result.seconds, now, now):
        out[chunk.request_id] += chunk.token_ids
    run_out(engine, out)


def test_without_windows_no_ledger_call_rides_beside_it() -> None:
    engine = fake_engine(max_batch=2)
    out, plans = proposed_round(engine)
    call = verify_round(engine.verifier, engine.kv, engine.health, engine.trace, engine.cost, plans,
                        engine.config.exact_rule, None)
    assert set(call.totals) == {"verify_call_seconds"}
    outcome = engine.accept(call.plans, call.result)
    now = time.perf_counter()
    for chunk in engine.close_round(call.plans, outcome, False, 0.0, call.result.seconds, now, now):
        out[chunk.request_id] += chunk.token_ids
    run_out(engine, out)


def test_a_lost_verifier_carries_the_ledger_calls_times() -> None:
    engine = fake_engine(max_batch=2)
    out, plans = proposed_round(engine)
    verifier = FailOnce(engine.verifier)
    with pytest.raises(VerifierLost, match="verifier failed") as lost:
        verify_round(verifier, engine.kv, engine.health, engine.trace, engine.cost, plans, engine.config.exact_rule,
                     windows(engine))
    assert set(lost.value.totals) == {"kv_seconds", "kv_ahead_wait_seconds"}
    # as the engine does: every running request is requeued and re-prefills from its tokens
    engine.give_back(recover_verifier(engine.parts, engine.running, [], str(lost.value)))
    assert not engine.running and len(engine.waiting) == len(PROMPTS)
    run_out(engine, out)
