"""The engine's three ways to run a round, one chosen when the engine is built (`step_mode`): each is one function
that strings the round's phases together (engine.py; drafting.py and verify_call.py are their functions on values,
whose decisions the engine applies: `drafted`, the verify's totals); none asks which mode runs, the step passes what
differs.

    serial        plan, reserve, propose (waited for), verify (with reservation windows), accept, commit (held: it
                  rides with the next reserve), emit
    ping_pong     two groups (overlap.py): this step's group lands (its drafts were made during the last verify)
                  and is verified while the other group's drafter call runs on the draft thread; nothing held
    predrafting   one group (predraft.py): as serial, and while the round verifies, the same requests' next round
                  is drafted on the draft thread; it lands after the verify and is kept or dropped by accept

`SpecEngine.step` admits, then calls the mode's function once; the engine calls nothing else here. Owner: the
engine thread. The draft thread's flights live in the engine's `DraftPipeline`, kept pre-drafts in its `PreDrafter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from cluster.engine.accept import RoundOutcome
from cluster.engine.config import EngineConfig
from cluster.engine.drafting import Drafted, answered, failed
from cluster.engine.overlap import DraftPipeline, InFlight
from cluster.engine.predraft import PreDrafter, void_draft_grants
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan, plain_proposed, with_predraft
from cluster.engine.spec_policy import CostModel, NominalCosts
from cluster.engine.step_trace import StepTrace
from cluster.engine.verify_call import VerifyCall
from cluster.engine.worker_health import WorkerHealth
from specserve_types.api import TokenChunk
from specserve_types.round_messages import ProposeBatch, VerifyResult

SERIAL, PING_PONG, PREDRAFTING = "serial", "ping-pong", "pre-drafting"


class RoundHost(Protocol):
    """The engine's phases, as the steps call them (SpecEngine, engine.py)."""

    config: EngineConfig
    running: list[RequestState]
    vocab_size: int
    health: WorkerHealth
    cost: CostModel
    nominal: NominalCosts  # seeded requests' costs, by the target's dtype
    trace: StepTrace
    pipeline: DraftPipeline | None
    predrafter: PreDrafter | None

    def plan(self, states: list[RequestState], model_trees: bool, kept: Mapping[str, RoundPlan] | None = None,
             void: Sequence[tuple[str, str]] = ()) -> list[RoundPlan]: ...

    def reserve(self, plans: list[RoundPlan], may_preempt: bool, own_step: bool) -> list[RoundPlan]: ...

    def propose(self, plans: list[RoundPlan], own_step: bool) -> tuple[list[RoundPlan], float]: ...

    def propose_batch(self, plans: list[RoundPlan], own_step: bool) -> ProposeBatch | None: ...

    def drafted(self, drafted: Drafted) -> list[RoundPlan]: ...

    def verify(self, plans: list[RoundPlan], windows: bool) -> VerifyCall | None: ...

    def accept(self, plans: list[RoundPlan], result: VerifyResult) -> RoundOutcome: ...

    def close_round(self, plans: list[RoundPlan], outcome: RoundOutcome, hold: bool, draft_seconds: float,
                    verify_seconds: float, round_start: float, accept_start: float) -> list[TokenChunk]: ...

    def preempt(self, state: RequestState) -> None: ...

    def restart_draft_caches(self) -> None: ...



def serial(engine: RoundHost) -> list[TokenChunk]:
    round_start = time.perf_counter()
    plans = engine.reserve(engine.plan(engine.running, model_trees=True), may_preempt=True, own_step=True)
    plans, draft_seconds = engine.propose(plans, own_step=True)
    return _verify_and_close(engine, plans, True, draft_seconds, round_start)


def ping_pong(engine: RoundHost) -> list[TokenChunk]:
    """This step's group lands (its drafts were made during the last verify); the other group is planned and
    reserved here and its drafter call is started, to run during this step's verify."""
    round_start = time.perf_counter()
    pipeline = engine.pipeline
    assert pipeline is not None
    turn = pipeline.next_turn()
    mine = [s for s in engine.running if s.group == turn]
    others = [s for s in engine.running if s.group != turn]
    flight = pipeline.take(turn)
    plans, draft_seconds = [], 0.0
    if flight is not None:
        plans, draft_seconds = _land(engine, flight)
    elif mine:  # nothing in flight for this group (its first turn, or after a recovery)
        plans, draft_seconds = engine.propose(engine.reserve(engine.plan(mine, model_trees=False), False, False),
                                              own_step=False)
    if others and not pipeline.has(1 - turn):
        other_plans = engine.reserve(engine.plan(others, model_trees=False), may_preempt=False, own_step=False)
        pipeline.submit(1 - turn, other_plans, [p for p in other_plans if p.needs_propose],
                        engine.propose_batch(other_plans, own_step=False), engine.health.drafter_holder)
    idle = [s for s in engine.running if s.request_id not in pipeline.in_flight_ids()]
    # out of blocks: no group reserved anything in a whole cycle (or the other group is empty)
    if pipeline.out_of_blocks(planned=bool(plans), idle=bool(idle)):
        engine.preempt(idle[-1])
    return _verify_and_close(engine, plans, False, draft_seconds, round_start)


def _land(engine: RoundHost, flight: InFlight) -> tuple[list[RoundPlan], float]:
    """A group's drafts, applied on the engine thread; a failed call or a drafter epoch that changed since the
    batch was reserved (failure, retry, replacement) leaves the group to plain decoding."""
    if flight.future is None:
        return flight.plans, 0.0
    try:
        result, seconds = flight.future.result()
    except Exception as exc:
        return engine.drafted(failed(flight.plans, engine.health, exc)), 0.0
    # made on the draft thread during the last verify
    engine.trace.add_phase("draft.propose", seconds, requests=len(flight.model_plans), overlapped=True)
    if flight.drafter_holder != engine.health.drafter_holder:
        return plain_proposed(flight.plans, "drafter epoch changed while drafting: plain decoding"), seconds
    return engine.drafted(answered(flight.plans, result, engine.health, engine.cost, engine.vocab_size)), seconds


def predrafting(engine: RoundHost) -> list[TokenChunk]:
    """As serial, with the next round's drafts made beside the verify; kept pre-drafts are their requests' plans
    (and a stale one the ledger still holds goes back), fresh model-drafted plans reserve their pre-draft's slots."""
    round_start = time.perf_counter()
    predrafter, cfg = engine.predrafter, engine.config
    assert predrafter is not None
    kept, void = predrafter.take(engine.running)
    plans = predrafter.budget(engine.plan(engine.running, False, kept, void), cfg.k_max, cfg.probe_every,
                              engine.nominal)
    plans, draft_seconds = engine.propose(engine.reserve(plans, may_preempt=True, own_step=True), own_step=True)
    predrafter.start(plans)  # the next round's drafts, made on the draft thread during the verify
    if not plans or (verified := engine.verify(plans, windows=False)) is None:
        return []
    plans, beside = _land_predrafts(engine, predrafter, verified.plans)
    accept_start = time.perf_counter()
    outcome = engine.accept(plans, verified.result)
    # kept ones are the next round's drafts; dropped ones go back in the commit
    predrafter.keep(outcome.predrafts_kept, outcome.predraft_results)
    return engine.close_round(plans, outcome, True, draft_seconds + beside, verified.result.seconds, round_start,
                              accept_start)


def _verify_and_close(engine: RoundHost, plans: list[RoundPlan], own_step: bool, draft_seconds: float,
                      round_start: float) -> list[TokenChunk]:
    """A chain round's end in the serial and ping-pong steps: verify (reservation windows beside it only when the
    step is the round's own), accept, close."""
    if not plans or (verified := engine.verify(plans, windows=own_step)) is None:
        return []
    accept_start = time.perf_counter()
    outcome = engine.accept(verified.plans, verified.result)
    return engine.close_round(verified.plans, outcome, own_step, draft_seconds, verified.result.seconds, round_start,
                              accept_start)


def _land_predrafts(engine: RoundHost, predrafter: PreDrafter, plans: list[RoundPlan]
                    ) -> tuple[list[RoundPlan], float]:
    """This step's pre-drafts, made during the verify (predraft.py). A failed or replaced drafter voids the
    round's draft grants (its epoch expired; the drafts already verified stay verified), and every draft cache
    restarts."""
    landing = predrafter.land()
    if landing.failure is not None:
        engine.health.drafter_failed(landing.failure)
    if landing.lost:
        engine.restart_draft_caches()
        return void_draft_grants(plans), landing.seconds
    if landing.seconds:
        engine.trace.add_phase("draft.propose", landing.seconds, requests=len(landing.predrafts),
                               overlapped=True, predraft=True)
    return [with_predraft(p, landing.predrafts[p.request_id]) if p.request_id in landing.predrafts else p
            for p in plans], landing.seconds


STEPS: dict[str, Callable[[RoundHost], list[TokenChunk]]] = {
    SERIAL: serial, PING_PONG: ping_pong, PREDRAFTING: predrafting}


def step_mode(config: EngineConfig, has_drafter: bool) -> str:
    """The engine's mode, from its config and drafter (overlap_policy.py decided `overlap`)."""
    if not has_drafter or not config.overlap:
        return SERIAL
    return PREDRAFTING if config.predraft else PING_PONG


__all__ = ["PING_PONG", "PREDRAFTING", "SERIAL", "STEPS", "RoundHost", "step_mode"]
