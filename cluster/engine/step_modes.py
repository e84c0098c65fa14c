"""The engine's three ways to run a step, one chosen when the engine is built (`step_mode`). Each calls the
engine's shared phases (engine.py); none of those phases asks which mode runs.

    Serial      plan, reserve, propose (waited for), verify, accept, commit (held: it rides with the next
                reserve), emit
    PingPong    two groups (overlap.py): this step's group lands (its drafts were made during the last verify)
                and is verified while the other group's drafter call runs on the draft thread; nothing held
    PreDraft    one group (predraft.py): as Serial, and while the round verifies, the same requests' next round
                is drafted on the draft thread; it lands after the verify and is kept or dropped by accept

Owner: the engine thread. A mode holds only its own state (the draft thread's flights, kept pre-drafts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cluster.engine.accept import RoundOutcome
from cluster.engine.backends import DrafterBackend
from cluster.engine.config import EngineConfig
from cluster.engine.give_back import EngineParts, preempt, restart_draft_caches
from cluster.engine.overlap import DraftPipeline, InFlight
from cluster.engine.predraft import PreDrafter, void_draft_grants
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan, plain_proposed, with_predraft
from cluster.engine.spec_policy import NominalCosts
from specserve_types.round_messages import ProposeBatch, ProposeResult

PlanOne = Callable[[RequestState], RoundPlan]


class RoundHost(EngineParts, Protocol):
    """The engine's shared phases, as the modes call them (SpecEngine, engine.py)."""

    drafter: DrafterBackend | None
    config: EngineConfig
    vocab_size: int

    def prepare(self, states: list[RequestState], may_preempt: bool) -> tuple[list[RoundPlan], float]: ...

    def plan(self, states: list[RequestState]) -> list[RoundPlan]: ...

    def reserve(self, plans: list[RoundPlan], may_preempt: bool) -> list[RoundPlan]: ...

    def propose_batch(self, plans: list[RoundPlan]) -> ProposeBatch | None: ...

    def apply_drafts(self, plans: list[RoundPlan], result: ProposeResult) -> list[RoundPlan]: ...

    def drafter_failed(self, plans: list[RoundPlan], exc: BaseException) -> list[RoundPlan]: ...

    def nominal_costs(self) -> NominalCosts: ...


class StepMode(Protocol):
    holds_commits: bool  # a steady round's commit waits for the next reserve (held_commit.py)
    drafts_own_step: bool  # the drafter call drafts this step's round (so it continues this step's trace)
    model_trees: bool  # a draft model may draft token trees (`model_tree_nodes`; serial only: the others draft
    # ahead in chains)
    windows: bool  # reservation windows: the next round granted beside this one's verify (held_commit.py; serial
    # only: pre-drafting reserves its drafts' slots itself, two groups interleave their rounds)

    def prepare(self, engine: RoundHost) -> tuple[list[RoundPlan], float]:
        """This step's plans, reserved and drafted, and the drafter seconds they cost."""

    def after_verify(self, engine: RoundHost, plans: list[RoundPlan]) -> tuple[list[RoundPlan], float]:
        """The plans accept reads (with landed pre-drafts), and drafter seconds spent beside the verify."""

    def after_accept(self, outcome: RoundOutcome) -> None: ...

    def plans_for(self, engine: RoundHost, states: list[RequestState], plan_one: PlanOne) -> list[RoundPlan]:
        """A plan per state (before draft admission and reserve)."""

    def budget(self, engine: RoundHost, plans: list[RoundPlan]) -> list[RoundPlan]:
        """The plans as they reserve (pre-drafting adds its slots)."""

    def in_flight_ids(self) -> set[str]:
        """Requests whose drafts the draft thread is making (an abort of one waits for its group to land)."""

    def drain(self) -> list[InFlight]: ...

    def draft_caches_restarted(self) -> None: ...

    def close(self) -> None: ...

    def summary(self) -> dict[str, int] | None: ...


class Serial:
    holds_commits = True
    drafts_own_step = True
    model_trees = True
    windows = True

    def prepare(self, engine: RoundHost) -> tuple[list[RoundPlan], float]:
        return engine.prepare(engine.running, may_preempt=True)

    def after_verify(self, engine: RoundHost, plans: list[RoundPlan]) -> tuple[list[RoundPlan], float]:
        return plans, 0.0

    def after_accept(self, outcome: RoundOutcome) -> None:
        pass

    def plans_for(self, engine: RoundHost, states: list[RequestState], plan_one: PlanOne) -> list[RoundPlan]:
        return [plan_one(state) for state in states]

    def budget(self, engine: RoundHost, plans: list[RoundPlan]) -> list[RoundPlan]:
        return plans

    def in_flight_ids(self) -> set[str]:
        return set()

    def drain(self) -> list[InFlight]:
        return []

    def draft_caches_restarted(self) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self) -> dict[str, int] | None:
        return None


class PingPong(Serial):
    holds_commits = False
    drafts_own_step = False  # the drafter call drafts the other group's next step
    model_trees = False
    windows = False

    def __init__(self, pipeline: DraftPipeline) -> None:
        self.pipeline = pipeline
        self._turns_without_plans = 0  # consecutive turns in which no plan got a reservation

    def prepare(self, engine: RoundHost) -> tuple[list[RoundPlan], float]:
        """This step's group lands (its drafts were made during the last verify); the other group is
        planned and reserved here and its drafter call is started, to run during this step's verify."""
        turn = self.pipeline.next_turn()
        mine = [s for s in engine.running if s.group == turn]
        others = [s for s in engine.running if s.group != turn]
        flight = self.pipeline.take(turn)
        if flight is not None:
            plans, draft_seconds = self._land(engine, flight)
        elif mine:  # nothing in flight for this group (its first turn, or after a recovery)
            plans, draft_seconds = engine.prepare(mine, may_preempt=False)
        else:
            plans, draft_seconds = [], 0.0
        if others and not self.pipeline.has(1 - turn):
            other_plans = engine.reserve(engine.plan(others), may_preempt=False)
            batch = engine.propose_batch(other_plans)
            self.pipeline.submit(1 - turn, other_plans, [p for p in other_plans if p.needs_propose], batch,
                                 engine.health.drafter_holder)
        self._turns_without_plans = 0 if plans else self._turns_without_plans + 1
        idle = [s for s in engine.running if s.request_id not in self.pipeline.in_flight_ids()]
        # out of blocks: no group reserved anything in a whole cycle (or the other group is empty)
        if not plans and idle and (not self.pipeline.busy() or self._turns_without_plans >= 2):
            preempt(engine, idle[-1])
            self._turns_without_plans = 0
        return plans, draft_seconds

    @staticmethod
    def _land(engine: RoundHost, flight: InFlight) -> tuple[list[RoundPlan], float]:
        """A group's drafts, applied on the engine thread; a failed call or a drafter epoch that changed
        since the batch was reserved (failure, retry, replacement) leaves the group to plain decoding."""
        if flight.future is None:
            return flight.plans, 0.0
        try:
            result, seconds = flight.future.result()
        except Exception as exc:
            return engine.drafter_failed(flight.plans, exc), 0.0
        # made on the draft thread during the last verify
        engine.trace.add_phase("draft.propose", seconds, requests=len(flight.model_plans), overlapped=True)
        if flight.drafter_holder != engine.health.drafter_holder:
            return plain_proposed(flight.plans, "drafter epoch changed while drafting: plain decoding"), seconds
        return engine.apply_drafts(flight.plans, result), seconds

    def in_flight_ids(self) -> set[str]:
        return self.pipeline.in_flight_ids()

    def drain(self) -> list[InFlight]:
        return self.pipeline.drain()

    def close(self) -> None:
        self.pipeline.close()


class PreDraft(Serial):
    model_trees = False
    windows = False

    def __init__(self, predrafter: PreDrafter) -> None:
        self.predrafter = predrafter

    def prepare(self, engine: RoundHost) -> tuple[list[RoundPlan], float]:
        plans, seconds = engine.prepare(engine.running, may_preempt=True)
        self.predrafter.start(plans)  # the next round's drafts, made on the draft thread during the verify
        return plans, seconds

    def plans_for(self, engine: RoundHost, states: list[RequestState], plan_one: PlanOne) -> list[RoundPlan]:
        plans, void = self.predrafter.plans(states, plan_one)  # a kept pre-draft is its request's plan
        if void:
            engine.kv.rollback(void)
        return plans

    def budget(self, engine: RoundHost, plans: list[RoundPlan]) -> list[RoundPlan]:
        """Fresh model-drafted plans reserve their pre-draft's slots too."""
        cfg = engine.config
        return self.predrafter.budget(plans, cfg.k_max, cfg.probe_every, engine.nominal_costs())

    def after_verify(self, engine: RoundHost, plans: list[RoundPlan]) -> tuple[list[RoundPlan], float]:
        """This step's pre-drafts, made during the verify (predraft.py). A failed or replaced drafter voids the
        round's draft grants (its epoch expired; the drafts already verified stay verified), and every draft
        cache restarts."""
        landing = self.predrafter.land()
        if landing.failure is not None:
            engine.health.drafter_failed(landing.failure)
        if landing.lost:
            restart_draft_caches(engine)
            return void_draft_grants(plans), landing.seconds
        if landing.seconds:
            engine.trace.add_phase("draft.propose", landing.seconds, requests=len(landing.predrafts),
                                   overlapped=True, predraft=True)
        return [with_predraft(p, landing.predrafts[p.request_id]) if p.request_id in landing.predrafts else p
                for p in plans], landing.seconds

    def after_accept(self, outcome: RoundOutcome) -> None:
        # kept ones are the next round's drafts; dropped ones went back in the commit
        self.predrafter.keep(outcome.predrafts_kept, outcome.predraft_results)

    def in_flight_ids(self) -> set[str]:
        return self.predrafter.pipeline.in_flight_ids()

    def drain(self) -> list[InFlight]:
        return self.predrafter.pipeline.drain()

    def draft_caches_restarted(self) -> None:
        self.predrafter.forget()

    def close(self) -> None:
        self.predrafter.pipeline.close()

    def summary(self) -> dict[str, int] | None:
        return self.predrafter.summary()


def step_mode(engine: RoundHost) -> StepMode:
    """The engine's mode, from its config and drafter (overlap_policy.py decided `overlap`)."""
    drafter, config = engine.drafter, engine.config
    if drafter is None or not config.overlap:
        return Serial()
    pipeline = DraftPipeline(drafter.propose)
    if config.predraft:
        return PreDraft(PreDrafter(pipeline, engine.health, engine.vocab_size))
    return PingPong(pipeline)


__all__ = ["PingPong", "PreDraft", "Serial", "StepMode", "step_mode"]
