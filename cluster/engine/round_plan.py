"""One request's plan within one round, as a frozen value, its transitions, and the worker messages built from it.

    plan_request / prefill_plan / plan_from_kept -> RoundPlan(k, target_pending, n-gram drafts)
      -> with_draft_pending (draft namespace entered) -> with_predraft_k (pre-drafting's budget)
      -> with_grants (reserve) -> with_drafts (propose) -> with_predraft (a pre-draft landed)
      -> verify_item -> accept_round (accept.py)
    plain(plan, reason): "decode plainly this round" at any point before the verify; without_draft_grant: the
    drafter's epoch changed during the round.

A phase never changes a plan: it returns new ones (`dataclasses.replace` here, and only here), so a plan seen
by one phase stays what it was. Owner: the engine thread (docs/ARCHITECTURE.md §3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.request_state import RequestState
from kv_manager.errors import KVError
from kv_manager.schema import Holder, Reservation, ReserveItem
from specserve_types.round_messages import ProposeItem, VerifyItem
from verifier_service.tree_contracts import TokenTree


@dataclass(frozen=True)
class PreDraft:
    """A pre-draft made during its round's verify (predraft.py): the guess g_1 of the bonus token, then the
    next round's drafts g_2..g_{k'+1}, with their q rows when the contract needs them."""

    tokens: list[int]
    probs: np.ndarray | None


@dataclass(frozen=True)
class RoundPlan:
    """One request within one round: what it verifies, what it drafted, what it was granted."""

    state: RequestState
    k: int
    target_pending: list[int]  # committed tokens without target KV (catch-up), then drafts follow
    draft_pending: list[int] = field(default_factory=list)  # committed tokens without draft KV (model drafts)
    drafts: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None
    uses_model_drafter: bool = False
    lookup: bool = False  # a model-drafted request whose drafts this round are its n-gram lookup's (planner.py)
    target_grant: Reservation | None = None
    draft_grant: Reservation | None = None
    prefill_to: int | None = None  # a prompt group's prefiller: prefill up to here only, nothing sampled
    # pre-drafting (predraft.py): the next round's k' drafted during this verify; this round's drafts were
    # pre-drafted during the last one (no propose); the pre-draft, once landed
    predraft_k: int = 0
    predrafted: bool = False
    predraft: PreDraft | None = None
    # the drafts as a token tree (suffix drafting): draft i's parent draft, -1 = the round's root (its last input
    # token); None = a chain. A tree reserves a target slot per node; k counts its nodes.
    draft_parents: tuple[int, ...] | None = None
    # a model draft asked for as a token tree (drafter_service/draft_tree.py): at most this many nodes over k levels
    # (0: a chain); its target reservation holds a slot per node, its draft one MODEL_TREE_WIDTH * (k - 1) scratch
    tree_budget: int = 0
    # a greedy model-draft chain may end early (1..k drafts): after a draft whose draft probability is below this
    draft_stop_below: float = 0.0
    # the request's constraint (constraint.py): the drafts are the tokens it forces (no drafter ran for them)
    forced: int = 0
    # set by `constrained` before the verify: each verified row's allowed tokens (int32 bitmask words), and how many
    # drafts the constraint cut (counted as proposed and rejected)
    allowed: np.ndarray | None = None
    cut: int = 0
    # why k is what it is (the planner's choice, or why the round decodes plainly; "": nothing to record) and the
    # request's rounds of plain decoding after this one (None: as they were): intents the engine records on the
    # request (`RequestState.record_k`), the planner's when planned, a fallback's when verified
    reason: str = ""
    rounds_at_zero: int | None = None

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def tree(self) -> TokenTree | None:
        return None if self.draft_parents is None else TokenTree(tuple(self.drafts), self.draft_parents)

    @property
    def needs_propose(self) -> bool:
        """Its drafts come from the drafter call of this round (not n-gram, not a kept pre-draft)."""
        return self.uses_model_drafter and self.k > 0 and not self.predrafted


MODEL_TREE_WIDTH = 4  # nodes of each level a draft model's tree expands


def target_slots(plan: RoundPlan) -> int:
    """Target slots the round reserves: its catch-up, then one per draft (a tree's budget before it is drafted)."""
    return len(plan.target_pending) + max(plan.k, plan.tree_budget, len(plan.drafts))


def draft_slots(plan: RoundPlan) -> int:
    """Draft slots the drafter writes: its catch-up, then k - 1 drafts (a tree: its fed nodes' scratch)."""
    return len(plan.draft_pending) + (MODEL_TREE_WIDTH * (plan.k - 1) if plan.tree_budget else plan.k - 1)


def predraft_slots(plan: RoundPlan) -> int:
    """Draft slots the pre-draft writes after the round's own: d_k, then g_1..g_{k'} (0: no pre-draft, predraft.py)."""
    return 1 + plan.predraft_k if plan.predraft_k else 0


def reserve_items(plans: Sequence[RoundPlan], verifier: Holder, drafter: Holder | None) -> list[ReserveItem]:
    """The round's ONE reserve: each plan's target slots, then the draft slots of those the drafter writes (a kept
    pre-draft's reservation exists already)."""
    items = [ReserveItem(TARGET_NAMESPACE, p.request_id, target_slots(p), verifier) for p in plans]
    return items + [ReserveItem(DRAFT_NAMESPACE, p.request_id, draft_slots(p) + predraft_slots(p), drafter)
                    for p in plans if p.uses_model_drafter and not p.predrafted]


def granted(plans: Sequence[RoundPlan], results: Sequence[Reservation | KVError]) -> tuple[list[RoundPlan], list[str]]:
    """The plans with their grants, and the requests refused their target slots that hold a draft grant (to roll
    back): a plan refused its target slots sits this round out; one refused its draft slots decodes plainly."""
    grants = {(r.namespace, r.request_id): r for r in results if not isinstance(r, KVError)}
    kept: list[RoundPlan] = []
    refused: list[str] = []
    for plan in plans:
        rid = plan.request_id
        target = grants.get((TARGET_NAMESPACE, rid))
        draft = plan.draft_grant if plan.predrafted else grants.get((DRAFT_NAMESPACE, rid))  # a kept pre-draft's
        if target is None:
            if draft is not None:
                refused.append(rid)
            continue  # out of blocks this round: skipped; preempted if nothing runs
        if plan.uses_model_drafter and draft is None:
            plan = plain(plan, "draft cache out of blocks")
        kept.append(with_grants(plan, target, draft))
    return kept, refused


def window_items(plans: Sequence[RoundPlan], k_max: int, verifier: Holder, drafter: Holder | None
                 ) -> list[ReserveItem]:
    """The reservation windows a round asks for beside its verify (held_commit.py): each reservation grown by
    the next round's maximum (its catch-up, then k_max drafts, or as many nodes as this round's tree), in each
    namespace the plan writes. None for a prompt group's prefill (its entry is forked after the commit)."""
    items: list[ReserveItem] = []
    for plan in plans:
        if plan.target_grant is None or plan.prefill_to is not None:
            continue
        spec = plan.state.request.spec
        k = 0 if spec.draft == "none" else max(spec.k if spec.k is not None else k_max, plan.k)
        nodes = max(k, plan.tree_budget, len(plan.drafts))
        items.append(ReserveItem(plan.target_grant.namespace, plan.request_id,
                                 len(plan.target_grant.slot_mapping) + 1 + nodes, verifier, extend=True))
        if plan.draft_grant is not None and plan.uses_model_drafter and drafter is not None and k:
            scratch = MODEL_TREE_WIDTH * (k - 1) if plan.tree_budget else k - 1
            items.append(ReserveItem(plan.draft_grant.namespace, plan.request_id,
                                     len(plan.draft_grant.slot_mapping) + 2 + scratch, drafter, extend=True))
    return items


def plain(plan: RoundPlan, reason: str) -> RoundPlan:
    """This round decodes plainly: no drafts, no draft grant; `reason` is why (recorded when it is verified)."""
    return replace(plan, uses_model_drafter=False, lookup=False, k=0, drafts=[], draft_probs=None, draft_grant=None,
                   draft_parents=None, tree_budget=0, reason=reason)


def plain_proposed(plans: Iterable[RoundPlan], reason: str) -> list[RoundPlan]:
    """Those of `plans` whose drafts this round's drafter call makes decode plainly; the others as they are."""
    return [plain(p, reason) if p.needs_propose else p for p in plans]


def with_draft_pending(plan: RoundPlan) -> RoundPlan:
    """The request holds a draft entry: its catch-up is what the draft cache lacks (up to a prefill's end)."""
    s = plan.state
    return replace(plan, draft_pending=s.token_ids[s.draft_cached:plan.prefill_to])


def with_predraft_k(plan: RoundPlan, predraft_k: int) -> RoundPlan:
    return replace(plan, predraft_k=predraft_k)


def with_grants(plan: RoundPlan, target: Reservation, draft: Reservation | None) -> RoundPlan:
    return replace(plan, target_grant=target, draft_grant=draft if plan.uses_model_drafter else None)


def with_drafts(plan: RoundPlan, drafts: Sequence[int], probs: np.ndarray | None,
                parents: Sequence[int] | None = None) -> RoundPlan:
    return replace(plan, drafts=list(drafts), draft_probs=probs,
                   draft_parents=None if parents is None else tuple(parents))


def with_proposed(plans: Sequence[RoundPlan], by_id: Mapping[str, Any], ran: Mapping[str, int]
                  ) -> tuple[list[RoundPlan], dict[str, int]]:
    """The drafter's answer (checked by `invalid_drafts`) on the plans it drafted; and how many of its chains and
    trees could stop early (draft_stop_below) and how many did (`ran`: the steps each drafted)."""
    stops: dict[str, int] = {}
    for p in plans:
        if p.needs_propose and p.draft_stop_below > 0:
            kind = "trees" if p.tree_budget else "chains"
            stops[f"draft_{kind}_may_stop"] = stops.get(f"draft_{kind}_may_stop", 0) + 1
            stops[f"draft_{kind}_stopped"] = stops.get(f"draft_{kind}_stopped", 0) + (ran[p.request_id] < p.k)
    return [with_drafts(p, by_id[p.request_id].draft_ids, by_id[p.request_id].draft_probs,
                        by_id[p.request_id].draft_parents) if p.needs_propose else p for p in plans], stops


def constrained(plan: RoundPlan) -> RoundPlan:
    """The round as the request's constraint lets it verify (constraint.py): drafts it forbids cut (a chain after
    its first forbidden draft, or at it for point-mass drafts; a tree's forbidden nodes with their subtrees) and
    each row's allowed tokens. Unconstrained requests and a prompt group's prefill (nothing sampled): as they are."""
    constraint = plan.state.constraint
    if constraint is None or plan.prefill_to is not None:
        return plan
    if plan.draft_parents is not None:
        rows = constraint.tree_masks(plan.drafts, plan.draft_parents)
        index = {old: new for new, old in enumerate(rows.keep)}
        parents = tuple(-1 if plan.draft_parents[old] == -1 else index[plan.draft_parents[old]] for old in rows.keep)
        return replace(plan, drafts=[plan.drafts[i] for i in rows.keep], allowed=rows.allowed,
                       draft_parents=parents if rows.keep else None)
    rows = constraint.chain_masks(plan.drafts, with_q=plan.draft_probs is not None)
    n = len(rows.keep)
    probs = None if plan.draft_probs is None else plan.draft_probs[:n]
    return replace(plan, drafts=plan.drafts[:n], draft_probs=probs, allowed=rows.allowed,
                   cut=len(plan.drafts) - n)


def with_predraft(plan: RoundPlan, predraft: PreDraft) -> RoundPlan:
    return replace(plan, predraft=predraft)


def without_draft_grant(plan: RoundPlan) -> RoundPlan:
    """The drafter's epoch changed during the round: its grants are gone, so nothing commits to them (the
    drafts already verified stay verified; the draft caches restart)."""
    return replace(plan, draft_grant=None, predraft=None)


def drafted_steps(plan: RoundPlan, out: Any | None) -> int:
    """The draft steps the drafter ran for `plan` (its ProposeOutput `out`): k, or where a greedy chain or tree may
    stop early (draft_stop_below), its drafts or its tree's levels (read before the drafts are validated: a
    malformed tree counts k)."""
    if plan.draft_stop_below <= 0 or out is None:
        return plan.k
    if not plan.tree_budget:
        return max(1, len(out.draft_ids))
    try:
        return max(1, TokenTree(tuple(out.draft_ids), tuple(out.draft_parents or ())).depth())
    except ValueError:  # TokenTree refuses parents that do not make a tree
        return plan.k


def invalid_drafts(plans: Sequence[RoundPlan], by_id: Mapping[str, Any], vocab_size: int) -> str | None:
    """Why the drafter's answer cannot be used (None if it can): every planned request answered, with
    exactly k ids (1..k where the chain may stop early), each in [0, vocab_size), and draft probabilities (when
    sent) with one row per draft."""
    for p in plans:
        out = by_id.get(p.request_id)
        if out is None:
            return f"no drafts for {p.request_id}"
        if (out.draft_parents is not None) != bool(p.tree_budget):
            return f"{p.request_id}: a {'chain' if p.tree_budget else 'tree'} where a {'tree' if p.tree_budget else 'chain'} was asked for"
        if p.tree_budget:
            if out.draft_probs is not None or not 0 < len(out.draft_ids) <= p.tree_budget:
                return f"{p.request_id}: a tree of {len(out.draft_ids)} nodes for a budget of {p.tree_budget}"
            try:
                tree = TokenTree(tuple(out.draft_ids), tuple(out.draft_parents))
            except ValueError as exc:
                return f"{p.request_id}: {exc}"
            if tree.depth() > p.k or any(not 0 <= int(t) < vocab_size for t in out.draft_ids):
                return f"{p.request_id}: a tree deeper than k={p.k} or ids outside [0, {vocab_size})"
            continue
        if len(out.draft_ids) != p.k and not (p.draft_stop_below > 0 and 0 < len(out.draft_ids) <= p.k):
            return f"{p.request_id}: {len(out.draft_ids)} drafts, asked for k={p.k}"
        if any(not 0 <= int(t) < vocab_size for t in out.draft_ids):
            return f"{p.request_id}: draft ids outside [0, {vocab_size})"
        if out.draft_probs is not None and len(out.draft_probs) != len(out.draft_ids):
            return f"{p.request_id}: {len(out.draft_probs)} draft probability rows for {len(out.draft_ids)} drafts"
    return None


def penalty_history(state: RequestState) -> tuple[list[int], list[int]]:
    if not state.request.sampling.has_penalties:
        return [], []
    return state.token_ids[:state.prompt_len], state.output_ids


def propose_item(plan: RoundPlan, constrain: bool = True) -> ProposeItem:
    """The drafter's item for the plan; `constrain`: a constrained request's chain is drafted under its constraint
    (the engine's `constrain_drafts`; trees draft freely and are pruned before the verify)."""
    s, grant = plan.state, plan.draft_grant
    assert grant is not None, "propose needs a draft reservation"
    prompt_ids, output_ids = penalty_history(s)
    constraint = s.request.constraint if constrain and s.constraint is not None and not plan.tree_budget else None
    if constraint is not None:
        output_ids = s.output_ids
    return ProposeItem(
        request_id=s.request_id, input_ids=plan.draft_pending, past_len=s.draft_cached,
        block_table=list(grant.block_table), k=plan.k,
        slot_mapping=list(grant.slot_mapping[:draft_slots(plan)]),  # a pre-draft's follow
        sampling=s.request.sampling, seed=s.seed, position=len(s.token_ids),
        want_probs=s.request.spec.contract == "exact" and not s.request.sampling.is_greedy and not plan.tree_budget,
        tree_nodes=plan.tree_budget, tree_width=MODEL_TREE_WIDTH if plan.tree_budget else 0,
        stop_below=plan.draft_stop_below, prompt_ids=prompt_ids, output_ids=output_ids, copy_blocks=list(grant.copy_on_write),
        constraint=constraint,
    )


def verify_item(plan: RoundPlan, exact_rule: str) -> VerifyItem:
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
        draft_parents=list(plan.draft_parents) if plan.draft_parents is not None and drafts else None,
        exact_rule=exact_rule, allowed=plan.allowed if plan.prefill_to is None else None,
        score_prompt=plan.prefill_to is None and s.scores_prompt,
    )
