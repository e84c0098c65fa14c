"""The drafter's part of a round, as functions on values; the engine applies what they return.

    enter_draft     a model-drafted plan enters the draft namespace (admission.admit_draft), or decodes plainly
    propose_batch   the ONE drafter call's batch: the plans whose drafts it makes (None: none)
    propose         that call, waited for on the engine thread                                   -> Drafted
    answered        the drafter's answer on the plans; a replaced drafter or invalid drafts: plain -> Drafted
    failed          the drafter died: its epoch expires, the plans it was to draft decode plainly -> Drafted

A `Drafted` is the plans with their drafts and what the engine does about them: restart every draft cache (the
drafter's epoch changed) and count the drafts that stopped early. The collaborators passed in change only
themselves (`WorkerHealth` its epochs and events, `CostModel` its samples, the ledger its entries). Owner: the
engine thread; under two groups the draft thread runs a batch's call and nothing else (overlap.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.engine.admission import admit_draft
from cluster.engine.backends import DrafterBackend
from cluster.engine.catch_up import observe_propose
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.round_plan import (
    RoundPlan,
    drafted_steps,
    invalid_drafts,
    plain,
    plain_proposed,
    propose_item,
    with_draft_pending,
    with_proposed,
)
from cluster.engine.spec_policy import CostModel
from cluster.engine.step_record import Carrier
from cluster.engine.step_trace import StepTrace
from cluster.engine.worker_health import WorkerHealth
from kv_manager.schema import Holder
from specserve_types.round_messages import ProposeBatch, ProposeResult


class InvalidDrafts(Exception):
    """The drafter answered with drafts the engine refuses (ids outside the vocabulary, a wrong count)."""


@dataclass(frozen=True)
class Drafted:
    plans: list[RoundPlan]  # with their drafts, or decoding plainly
    restart: bool = False  # the drafter's epoch changed: every draft cache restarts (the engine's)
    stops: Mapping[str, int] = field(default_factory=dict)  # chains and trees that could stop early, and did
    seconds: float = 0.0  # the call as waited for on the engine thread (`propose`)


def enter_draft(kv: HeldCommitKV, plan: RoundPlan, holder: Holder | None) -> RoundPlan:
    """A model-drafted plan with its draft catch-up, once its request holds a draft entry; plain if the draft
    namespace cannot hold it. Other plans as they are."""
    if not plan.uses_model_drafter:
        return plan
    return with_draft_pending(plan) if admit_draft(kv, plan.state, holder) else plain(plan, "draft cache out of blocks")


def propose_batch(plans: list[RoundPlan], constrain: bool, trace_context: Carrier) -> ProposeBatch | None:
    """The drafter call for the plans whose drafts it makes (None: none); `constrain`: the engine's
    `constrain_drafts`."""
    model_plans = [p for p in plans if p.needs_propose]
    if not model_plans:
        return None
    return ProposeBatch([propose_item(p, constrain) for p in model_plans], trace_context)


def propose(drafter: DrafterBackend, batch: ProposeBatch, plans: list[RoundPlan], trace: StepTrace,
            health: WorkerHealth, cost: CostModel, vocab_size: int) -> Drafted:
    """The drafter call, waited for: the plans with their drafts, or (the drafter died) decoding plainly."""
    start = time.perf_counter()
    try:
        with trace.phase("draft.propose", requests=len(batch.items), k=max(i.k for i in batch.items)):
            result = drafter.propose(batch)
        drafted = answered(plans, result, health, cost, vocab_size)
    except Exception as exc:  # the drafter died: this round and the next ones decode plainly
        drafted = failed(plans, health, exc)
    return Drafted(drafted.plans, drafted.restart, drafted.stops, time.perf_counter() - start)


def answered(plans: list[RoundPlan], result: ProposeResult, health: WorkerHealth, cost: CostModel,
             vocab_size: int) -> Drafted:
    """The drafter's answer on the plans it drafted (its draft steps timed into the cost model); a replaced
    drafter or invalid drafts: plain decoding."""
    if health.drafter_answered(result.worker_instance):
        # a new process drafted from an empty KV pool: worthless, so this round decodes plainly
        return Drafted(plain_proposed(plans, "drafter replaced: re-prefilling its cache"), restart=True)
    model_plans = [p for p in plans if p.needs_propose]
    by_id = {o.request_id: o for o in result.outputs}
    ran = {p.request_id: drafted_steps(p, by_id.get(p.request_id)) for p in model_plans}  # may stop early
    observe_propose(cost, model_plans, max(ran.values()), result.seconds)
    refusal = invalid_drafts(model_plans, by_id, vocab_size)
    if refusal is not None:  # never trusted: the drafter is treated as failed, this round decodes plainly
        return failed(plans, health, InvalidDrafts(refusal), "fallback: drafter returned invalid drafts")
    drafted, stops = with_proposed(plans, by_id, ran)
    return Drafted(drafted, stops=stops)


def failed(plans: list[RoundPlan], health: WorkerHealth, exc: BaseException,
           reason: str = "fallback: drafter failed, plain decoding") -> Drafted:
    """The drafter died, timed out or answered wrongly: its epoch expires (every draft grant is gone), every draft
    cache restarts, the plans it was to draft decode plainly."""
    health.drafter_failed(exc)
    return Drafted(plain_proposed(plans, reason), restart=True)


__all__ = ["Drafted", "InvalidDrafts", "answered", "enter_draft", "failed", "propose", "propose_batch"]
