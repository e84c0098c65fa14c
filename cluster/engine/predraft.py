"""Pre-drafting: while round r verifies, the drafter drafts round r + 1 of the same requests, assuming every
draft of round r is accepted (docs/ARCHITECTURE.md §2). Opt-in (`predraft: true`), and only under overlap:
it replaces the two-group ping-pong of overlap.py with one group whose next drafter call is made in advance.

    round r     ONE draft reservation for the round and its pre-draft: catch-up + k - 1 slots, then 1 + k'
                (the ledger holds one reservation per request and namespace, so the two share it)
                propose(r) -> d_1..d_k                                     engine thread, waited for
                pre-draft  -> input d_k, k' + 1 tokens g_1..g_{k'+1}        draft thread, during verify(r)
                verify(r)  -> accepted drafts + the correction/bonus token b
    kept        iff all k drafts are accepted and kept (no stop inside them) and g_1 == b. g_1 is the drafter's
                guess of the bonus token, drawn as a (k+1)-th draft would be; the verifier samples b as always,
                so the guess only decides whether the pre-draft is usable. Round r then commits no draft KV
                (its draft commit is deferred) and round r + 1 proposes nothing: its drafts are g_2..g_{k'+1}
                with their q, its draft KV (d_k, b = g_1, g_2..g_{k'}) is written, its target reservation is
                made as always, and its draft commit covers both rounds with the same formula as any round
                (catch-up = round r's catch-up + d_1..d_k + b).
    dropped     otherwise (a rejection, a wrong guess, a stop, a failed or replaced drafter): round r commits
                its kept prefix as any round does, and the rest of the reservation, the pre-draft's slots with
                it, goes back to the free list in that same commit. No ledger call of its own.

Exactness. The pre-drafted drafts g_2.. are drawn from the drafter's distribution conditioned on the true
prefix (g_1 == b), with the uniforms of their positions (sampling.py: seed, position, purpose), exactly as
round r + 1's own propose would draw them, and the q sent with them is the one they were drawn from. Whether a
pre-draft is used depends only on round r's draws, never on round r + 1's, so every contract keeps its
guarantee (§5): greedy output equals plain greedy decoding, exact output follows p.
k' (the pre-drafted round's k) is what the plan of round r + 1 would choose after a fully accepted round r:
fixed k as is; a seeded sampled request's own-history choice (so its tokens are those of a run without
pre-drafting, up to float differences of the drafter's two ways to write d_k and b); auto otherwise keeps
round r's k.

Depth one: a pre-drafted round has no reservation to pre-draft into (its draft reservation is still in
flight), so pre-drafted and fresh rounds alternate while drafts are accepted; at best half of the drafter
calls leave the critical path. Ownership: the engine thread; the draft thread only runs the ProposeBatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.config import DRAFT_NAMESPACE
from cluster.engine.overlap import PREDRAFT, DraftPipeline
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import (
    PreDraft,
    RoundPlan,
    penalty_history,
    predraft_slots,
    with_predraft_k,
    without_draft_grant,
)
from cluster.engine.spec_policy import FLOAT32_COSTS, NominalCosts, SeededInputs, choose_k_seeded
from cluster.engine.worker_health import WorkerHealth
from kv_manager.schema import Holder, Reservation
from specserve_types.round_messages import ProposeBatch, ProposeItem


@dataclass
class KeptPreDraft:
    """A pre-draft that survived its round: the next round's drafts, and the reservation they live in."""

    drafts: list[int]
    probs: np.ndarray | None
    grant: Reservation  # the round's draft reservation, still in flight (its commit was deferred)
    holder: Holder  # the drafter epoch it was reserved under
    draft_cached: int  # the request's draft_cached when it was kept (nothing committed since)


def next_k(plan: RoundPlan, k_max: int, probe_every: int, costs: NominalCosts = FLOAT32_COSTS) -> int:
    """k' of round r + 1 after a fully accepted round r (0: nothing to pre-draft): what `plan_request` would
    choose then, for fixed k and seeded requests; round r's k for auto."""
    s, spec, sampling = plan.state, plan.state.request.spec, plan.state.request.sampling
    remaining = sampling.max_tokens - s.num_output - (plan.k + 1)
    cap = max(0, min(k_max if spec.k is None else spec.k, remaining - 1))
    if cap == 0 or spec.k is not None:
        return cap
    if sampling.seed is not None and not sampling.is_greedy:
        after = AcceptanceStats()
        after.record(plan.k, plan.k, spec.contract)
        return choose_k_seeded(SeededInputs.of(s.acceptance.merge(after), cap, 0, probe_every,
                                               model_draft=True, costs=costs)).k
    return min(plan.k, cap)


def predraft_item(plan: RoundPlan) -> ProposeItem:
    """Round r + 1's propose, made before round r is verified: it starts from d_k (whose KV the round's own
    call does not write) at d_k's position, with d_1..d_k in the penalty history, and draws k' + 1 tokens."""
    s, grant = plan.state, plan.draft_grant
    assert grant is not None and plan.predraft_k > 0 and len(plan.drafts) == plan.k > 0, "nothing to pre-draft"
    start = len(plan.draft_pending) + plan.k - 1  # the round's own draft slots come first
    prompt_ids, output_ids = penalty_history(s)
    return ProposeItem(
        request_id=s.request_id, input_ids=[plan.drafts[-1]], past_len=s.draft_cached + start,
        block_table=list(grant.block_table), slot_mapping=list(grant.slot_mapping[start:start + predraft_slots(plan)]),
        k=plan.predraft_k + 1, sampling=s.request.sampling, seed=s.seed, position=len(s.token_ids) + plan.k,
        want_probs=s.request.spec.contract == "exact" and not s.request.sampling.is_greedy,
        prompt_ids=prompt_ids, output_ids=output_ids + plan.drafts if prompt_ids or output_ids else [],
    )


def settle(plan: RoundPlan, tokens: Sequence[int], accepted_len: int, kept: Sequence[int], finished: bool,
           holder: Holder) -> tuple[KeptPreDraft | None, str]:
    """After the round's verify: the pre-draft kept for the next round, or None, and why (a stats key)."""
    pre = plan.predraft
    assert pre is not None and plan.draft_grant is not None
    if finished:
        return None, "finished"
    if accepted_len < plan.k or len(kept) != len(tokens):
        return None, "rejected"
    if kept[-1] != pre.tokens[0]:
        return None, "guess_missed"
    assert plan.draft_grant.namespace == DRAFT_NAMESPACE
    probs = None if pre.probs is None else pre.probs[1:]
    return KeptPreDraft(pre.tokens[1:], probs, plan.draft_grant, holder, plan.state.draft_cached), "kept"


def plan_from_kept(state: RequestState, kept: KeptPreDraft) -> RoundPlan:
    """Round r + 1 of a kept pre-draft: its drafts and draft reservation exist; `draft_pending` (set by the
    engine's plan as for any model-drafted round) is round r's catch-up + d_1..d_k + b."""
    return RoundPlan(state=state, k=len(kept.drafts), target_pending=state.token_ids[state.target_cached:],
                     drafts=list(kept.drafts), draft_probs=kept.probs, draft_grant=kept.grant, uses_model_drafter=True,
                     predrafted=True, reason="pre-drafted during the last verify", rounds_at_zero=0)


@dataclass(frozen=True)
class Landing:
    seconds: float  # the pre-draft call's wall time (on the draft thread, beside the verify)
    failure: BaseException | None = None  # the drafter failed: the caller expires its epoch
    lost: bool = False  # every draft grant of the round is gone (failure, replaced drafter, epoch changed)
    predrafts: dict[str, PreDraft] = field(default_factory=dict)  # request id -> its landed pre-draft


class PreDrafter:
    """The engine's pre-drafting: plans from kept pre-drafts, the budget of fresh plans, the draft-thread
    call and its landing. Counters in `counts` (engine stats `overlap.predraft`)."""

    def __init__(self, pipeline: DraftPipeline, health: WorkerHealth, vocab_size: int) -> None:
        self.pipeline = pipeline
        self.health = health
        self.vocab_size = vocab_size
        self.kept: dict[str, KeptPreDraft] = {}  # request id -> its next round's drafts (one step long)
        self.counts: dict[str, int] = dict.fromkeys(
            ("made", "kept", "rejected", "guess_missed", "finished", "lost", "rounds", "drafter_calls_saved"), 0)

    # ---------------------------------------------------------------- plan, reserve
    def take(self, states: Sequence[RequestState]) -> tuple[dict[str, RoundPlan], list[tuple[str, str]]]:
        """The plans of the states whose kept pre-draft is still good (by request id), and the reservations to roll
        back (an intent the engine applies): kept pre-drafts live one step, and a stale one the ledger still holds
        goes back. The other states are planned as usual."""
        kept, self.kept = self.kept, {}
        plans, void = {}, []
        for state in states:
            entry = kept.pop(state.request_id, None)
            if entry is None:
                continue
            if self._usable(state, entry):
                self.counts["rounds"] += 1
                plans[state.request_id] = plan_from_kept(state, entry)
            elif entry.holder == self.health.drafter_holder and state.draft_admitted:
                void.append((DRAFT_NAMESPACE, state.request_id))  # the ledger still holds it
        # the rest belong to requests no longer running: their entries were released with them
        return plans, void

    def _usable(self, state: RequestState, entry: KeptPreDraft) -> bool:
        return (state.draft_admitted and entry.holder == self.health.drafter_holder
                and entry.draft_cached == state.draft_cached and state.finish_reason is None)

    @staticmethod
    def budget(plans: Sequence[RoundPlan], k_max: int, probe_every: int,
               costs: NominalCosts = FLOAT32_COSTS) -> list[RoundPlan]:
        """Fresh model-drafted plans get k' (their reservation then holds the pre-draft's slots too)."""
        return [with_predraft_k(plan, next_k(plan, k_max, probe_every, costs))
                if plan.needs_propose and plan.prefill_to is None else plan for plan in plans]

    def forget(self) -> None:
        """Every draft cache restarted (its epoch expired): no kept pre-draft is usable."""
        self.kept.clear()

    # ---------------------------------------------------------------- the call beside the verify
    def start(self, plans: Sequence[RoundPlan]) -> None:
        """After the round's own propose: the pre-drafts of the plans that got their drafts, on the draft thread."""
        if any(p.predrafted for p in plans) and not any(
                p.uses_model_drafter and p.k > 0 and not p.predrafted for p in plans):
            self.counts["drafter_calls_saved"] += 1  # this step's round needed no drafter call
        ready = [p for p in plans if p.predraft_k > 0 and p.uses_model_drafter and p.draft_grant is not None
                 and len(p.drafts) == p.k > 0]
        if not ready:
            return
        self.counts["made"] += len(ready)
        self.pipeline.submit(PREDRAFT, list(ready), list(ready), ProposeBatch([predraft_item(p) for p in ready]),
                             self.health.drafter_holder)

    def land(self) -> Landing:
        """After the verify, before accept: the pre-drafts by request id (the engine puts them on the plans), or
        why none."""
        flight = self.pipeline.take(PREDRAFT)
        if flight is None or flight.future is None:
            return Landing(0.0)
        try:
            result, seconds = flight.future.result()
        except Exception as exc:
            self.counts["lost"] += len(flight.plans)
            return Landing(0.0, failure=exc, lost=True)
        if flight.drafter_holder != self.health.drafter_holder or self.health.drafter_answered(result.worker_instance):
            self.counts["lost"] += len(flight.plans)  # a new epoch: the round's draft grants are gone
            return Landing(seconds, lost=True)
        by_id = {o.request_id: o for o in result.outputs}
        predrafts = {}
        for plan in flight.plans:
            out = by_id.get(plan.state.request_id)
            if out is not None and self._valid(plan, out.draft_ids, out.draft_probs):
                predrafts[plan.request_id] = PreDraft([int(t) for t in out.draft_ids], out.draft_probs)
            else:
                self.counts["lost"] += 1  # never trusted; the round commits as without it
        return Landing(seconds, predrafts=predrafts)

    def _valid(self, plan: RoundPlan, ids: Sequence[int], probs: np.ndarray | None) -> bool:
        want = plan.predraft_k + 1
        return (len(ids) == want and all(0 <= int(t) < self.vocab_size for t in ids)
                and (probs is None or len(probs) == want))

    # ---------------------------------------------------------------- after accept
    def keep(self, kept: dict[str, KeptPreDraft], results: Sequence[str]) -> None:
        """The round's outcome: pre-drafts kept for the next step, the others counted by why they went."""
        self.kept = dict(kept)
        for reason in results:
            self.counts[reason] += 1

    def summary(self) -> dict[str, int]:
        return dict(self.counts)


def void_draft_grants(plans: Sequence[RoundPlan]) -> list[RoundPlan]:
    """The drafter's epoch changed during the round: its grants are gone, so nothing commits to them (the
    drafts already verified stay verified; the draft caches restart)."""
    return [without_draft_grant(plan) for plan in plans]


__all__ = ["KeptPreDraft", "Landing", "PreDrafter", "next_k", "plan_from_kept", "predraft_item",
           "settle", "void_draft_grants"]
