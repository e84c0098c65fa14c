"""One request's plan within one round, and the worker messages built from it.

    plan (k) -> reserve (target_grant, draft_grant) -> propose_item -> drafts -> verify_item -> verdict
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.engine.request_state import RequestState
from kv_manager.schema import Reservation
from specserve_types.round_messages import ProposeItem, VerifyItem


@dataclass
class RoundPlan:
    """Scratch state of one request within one round (owned by the round that made it)."""

    state: RequestState
    k: int
    target_pending: list[int]  # committed tokens without target KV (catch-up), then drafts follow
    draft_pending: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None
    uses_model_drafter: bool = False
    target_grant: Reservation | None = None
    draft_grant: Reservation | None = None
    prefill_to: int | None = None  # a prompt group's carrier: prefill up to here only, nothing sampled
    # pre-drafting (predraft.py): the next round's k' drafted during this verify; this round's drafts were
    # pre-drafted during the last one (no propose); the pre-draft, once landed
    predraft_k: int = 0
    predrafted: bool = False
    predraft: PreDraft | None = None


@dataclass
class PreDraft:
    """A pre-draft made during its round's verify (predraft.py): the guess g_1 of the bonus token, then the
    next round's drafts g_2..g_{k'+1}, with their q rows when the contract needs them."""

    tokens: list[int]
    probs: np.ndarray | None


def penalty_history(state: RequestState) -> tuple[list[int], list[int]]:
    if not state.request.sampling.has_penalties:
        return [], []
    return state.token_ids[:state.prompt_len], state.output_ids


def propose_item(plan: RoundPlan) -> ProposeItem:
    s, grant = plan.state, plan.draft_grant
    assert grant is not None, "propose needs a draft reservation"
    prompt_ids, output_ids = penalty_history(s)
    return ProposeItem(
        request_id=s.request_id, input_ids=plan.draft_pending, past_len=s.draft_cached,
        block_table=list(grant.block_table), k=plan.k,
        slot_mapping=list(grant.slot_mapping[:len(plan.draft_pending) + plan.k - 1]),  # a pre-draft's follow
        sampling=s.request.sampling, seed=s.seed, position=len(s.token_ids),
        want_probs=s.request.spec.contract == "exact" and not s.request.sampling.is_greedy,
        prompt_ids=prompt_ids, output_ids=output_ids, copy_blocks=list(grant.copy_on_write),
    )


def verify_item(plan: RoundPlan) -> VerifyItem:
    s, grant = plan.state, plan.target_grant
    assert grant is not None, "verify needs a target reservation"
    drafts, probs = (plan.drafts, plan.draft_probs) if plan.prefill_to is None else ([], None)  # never verified
    n_slots = len(plan.target_pending) + len(drafts)
    prompt_ids, output_ids = penalty_history(s)
    return VerifyItem(
        request_id=s.request_id, input_ids=plan.target_pending, draft_ids=drafts, draft_probs=probs,
        past_len=s.target_cached, block_table=list(grant.block_table), slot_mapping=list(grant.slot_mapping[:n_slots]),
        sampling=s.request.sampling, contract=s.request.spec.contract, seed=s.seed, position=len(s.token_ids),
        prompt_ids=prompt_ids, output_ids=output_ids, copy_blocks=list(grant.copy_on_write),
    )
