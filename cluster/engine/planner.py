"""Plan: how many draft tokens k one request proposes this round, and by which drafter.

    plan_request(state, context) -> RoundPlan(k, target_pending, drafts (n-gram), uses_model_drafter)

Fixed k, or auto (spec_policy.py): seeded sampled requests from their own history only, the others from
the measured costs. n-gram drafts are made here (prompt lookup, in process). The plan is built once, on
the engine thread; the engine then enters a model-drafted request in the draft namespace, sets its
`draft_pending` and reserves the plan's maximum (docs/ARCHITECTURE.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
from cluster.engine.spec_policy import (
    FLOAT32_COSTS,
    AutoInputs,
    CostModel,
    NominalCosts,
    SeededInputs,
    choose_k,
    choose_k_seeded,
)
from drafter_service.ngram import propose_ngram


@dataclass(frozen=True)
class PlanContext:
    """The engine-wide values one round's plans read, taken once per round on the engine thread."""

    k_max: int
    probe_every: int
    pressure_free_fraction: float
    free_fraction: float  # of the target pool
    drafter_usable: bool
    engine_acceptance: AcceptanceStats
    cost: CostModel
    batch: int  # requests verified together (the group's size under overlap)
    nominal: NominalCosts = FLOAT32_COSTS  # seeded requests' costs: by the target's dtype (spec_policy.py)


def plan_request(state: RequestState, ctx: PlanContext) -> RoundPlan:
    spec, sampling = state.request.spec, state.request.sampling
    remaining = sampling.max_tokens - state.num_output
    k_cap = max(0, min(ctx.k_max if spec.k is None else spec.k, remaining - 1))
    pending = state.token_ids[state.target_cached:]
    if spec.draft == "none" or k_cap == 0:
        state.record_k(0, "no speculation requested" if spec.draft == "none" or spec.k == 0 else "end of output")
        return RoundPlan(state=state, k=0, target_pending=pending)
    if spec.draft == "model" and not ctx.drafter_usable:
        state.record_k(0, "fallback: drafter unavailable, plain decoding")
        return RoundPlan(state=state, k=0, target_pending=pending)
    if spec.k is not None:
        k, reason = k_cap, "fixed k"
    elif sampling.seed is not None and not sampling.is_greedy:
        # its own history only, so the seed reproduces its tokens whatever the batch and timing
        decision = choose_k_seeded(SeededInputs.of(state.acceptance, k_cap, state.rounds_at_zero, ctx.probe_every,
                                                   model_draft=spec.draft == "model", costs=ctx.nominal))
        k, reason = decision.k, decision.reason
    else:
        decision = choose_k(AutoInputs(
            state.acceptance, ctx.engine_acceptance, ctx.cost, k_cap, len(pending),
            state.rounds_at_zero, ctx.probe_every, ctx.free_fraction, ctx.pressure_free_fraction,
            draft_cost_per_token=0.0 if spec.draft == "ngram" else ctx.cost.draft_token, batch=ctx.batch))
        k, reason = decision.k, decision.reason
    state.rounds_at_zero = state.rounds_at_zero + 1 if k == 0 else 0
    drafts: list[int] = []
    if spec.draft == "ngram" and k > 0:
        drafts = propose_ngram(state.token_ids, k)
        k = len(drafts)
        if k == 0:
            reason = "n-gram: no match"
    state.record_k(k, reason)
    return RoundPlan(state=state, k=k, target_pending=pending, drafts=drafts,
                     uses_model_drafter=spec.draft == "model" and k > 0)
