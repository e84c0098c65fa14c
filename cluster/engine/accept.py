"""Accept: one round's verifier outputs become emitted tokens, ledger commits and chunks.

    accept_round(plans, outputs, holders) -> RoundOutcome(commits, chunks, finished, release_draft, acceptance)
    record_acceptance(outcome.acceptance, ...)  the round's acceptance into the engine's statistics, by source

A prompt group's prefill-only plan (`prefill_to`) commits its prefix and nothing else: no token, no chunk.

It calls no ledger and reads no engine attribute: the engine sends `commits`, releases `release_draft`
and drops `finished` (docs/ARCHITECTURE.md §2). It advances each request's own state (tokens appended
one by one with stop checks, cached counts), which the engine thread owns.

A pre-draft (predraft.py) is settled here: kept (this round's draft commit is deferred to the pre-drafted
round) or dropped (the commit below gives its slots back with the round's rejected tail).

Glossary: `out.tokens` = the accepted drafts + one correction/bonus token. A stop (EOS, stop string,
max_tokens) may keep fewer: only kept tokens exist. The accepted drafts after a stop are neither committed
nor counted, and a round cut inside its accepted drafts counts as having proposed only the drafts up to the
stop (all accepted): the drafts after it were never needed, not rejected.

    target KV written this round:  [ target_pending | drafts ]      commit: pending + kept accepted drafts
                                   (a tree: its accepted path, moved by the verifier to the first draft slots)
    draft  KV written this round:  [ draft_pending | drafts[:-1] ]  commit: pending + min(kept, k - 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.predraft import KeptPreDraft, settle
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
from kv_manager.schema import CommitItem, Holder
from specserve_types.api import TokenChunk
from specserve_types.round_messages import VerifyOutput


@dataclass(frozen=True)
class AcceptanceRecord:
    accepted: int
    proposed: int
    contract: str
    ranks: tuple[int, ...] = ()  # a tree round's accepted nodes' sibling ranks (acceptance_stats.py)
    tree_nodes: int = 0
    request_id: str = ""
    lookup: bool = False  # a model-drafted request's n-gram lookup drafts (planner.py), counted apart
    forced: bool = False  # drafts its constraint forced (planner.py): counted apart, not the drafter's acceptance


def _accepted_path(out: VerifyOutput, nodes: int) -> list[int]:
    """The verifier's accepted path through a tree of `nodes` drafts, checked: root first, each node once."""
    path = out.accepted_path
    assert path is not None and len(path) == out.accepted_len, f"{out.request_id}: a tree answer without its path"
    assert all(0 <= n < nodes for n in path) and path == sorted(set(path)), f"{out.request_id}: bad path {path}"
    return list(path)


@dataclass(frozen=True)
class RoundOutcome:
    """What one round produced, filled by `accept_round` alone (its lists grow there; no field is reassigned)."""

    commits: list[CommitItem] = field(default_factory=list)
    chunks: list[TokenChunk] = field(default_factory=list)
    finished: list[RequestState] = field(default_factory=list)
    release_draft: list[str] = field(default_factory=list)  # finished, holding a draft entry it did not commit to
    acceptance: list[AcceptanceRecord] = field(default_factory=list)  # one per request that proposed drafts
    predrafts_kept: dict[str, KeptPreDraft] = field(default_factory=dict)  # the next round's drafts (predraft.py)
    predraft_results: list[str] = field(default_factory=list)  # kept / why dropped, one per landed pre-draft


def accept_round(plans: Sequence[RoundPlan], outputs: Sequence[VerifyOutput], verifier_holder: Holder,
                 drafter_holder: Holder | None) -> RoundOutcome:
    outcome = RoundOutcome()
    for plan, out in zip(plans, outputs, strict=True):
        s = plan.state
        assert out.request_id == s.request_id, f"verifier answered {out.request_id} for {s.request_id}"
        if plan.prefill_to is not None:  # a prompt group's shared prefill: its token is not the request's
            _commit_prefill(plan, outcome, verifier_holder, drafter_holder)
            continue
        tree = plan.tree
        # a tree proposes the chain of its depth; its accepted drafts are the accepted path's nodes, whose KV the
        # verifier moves to the first draft slots (verifier_service/worker.py), so the commit is contiguous
        # drafts the constraint cut count as proposed and rejected (round_plan.constrained)
        proposed = len(plan.drafts) + plan.cut if tree is None else tree.depth()
        path = list(range(len(plan.drafts))) if tree is None else _accepted_path(out, len(plan.drafts))
        accepted_drafts = [plan.drafts[node] for node in path]
        s.rounds += 1
        kept, delta = s.append_tokens(out.tokens)
        finished = s.finish_reason is not None
        kept_accepted = min(out.accepted_len, len(kept))
        counted_proposed = proposed if len(kept) == len(out.tokens) else kept_accepted
        if proposed:
            record = AcceptanceRecord(kept_accepted, counted_proposed, s.request.spec.contract,
                                      ranks=() if tree is None else tuple(tree.rank(n) for n in path[:kept_accepted]),
                                      tree_nodes=0 if tree is None else len(tree), request_id=s.request_id,
                                      lookup=plan.lookup, forced=bool(plan.forced))
            if plan.forced:
                s.forced += counted_proposed
                s.forced_accepted += kept_accepted
            else:
                (s.lookup_acceptance if plan.lookup else s.acceptance).record(
                    record.accepted, record.proposed, record.contract, record.ranks, record.tree_nodes)
            outcome.acceptance.append(record)
        target_len = len(plan.target_pending) + kept_accepted
        committed = plan.target_pending + accepted_drafts[:kept_accepted]
        assert s.token_ids[s.target_cached:s.target_cached + target_len] == committed, "commit != kept tokens"
        outcome.commits.append(CommitItem(TARGET_NAMESPACE, s.request_id, target_len, committed, verifier_holder,
                                          finished=finished))
        s.target_cached += target_len
        carried = None
        if plan.uses_model_drafter and plan.draft_grant is not None and plan.predraft is not None:
            assert drafter_holder is not None, "a pre-draft without a drafter epoch"
            carried, result = settle(plan, out.tokens, out.accepted_len, kept, finished, drafter_holder)
            outcome.predraft_results.append(result)
        if carried is not None:  # the draft commit rides with the pre-drafted round's (predraft.py)
            outcome.predrafts_kept[s.request_id] = carried
        elif plan.uses_model_drafter and plan.draft_grant is not None:  # no grant: the drafter's epoch changed
            assert drafter_holder is not None, "a model draft without a drafter epoch"
            # a tree's nodes sat in scratch slots: the accepted path is fed again with the next catch-up
            draft_len = len(plan.draft_pending) + (0 if tree is not None else min(kept_accepted, proposed - 1))
            draft_committed = (plan.draft_pending + plan.drafts)[:draft_len]
            outcome.commits.append(CommitItem(DRAFT_NAMESPACE, s.request_id, draft_len, draft_committed,
                                              drafter_holder, finished=finished))
            s.draft_cached += draft_len
        elif finished and s.draft_admitted:
            outcome.release_draft.append(s.request_id)
        assert s.target_cached <= len(s.token_ids) and s.draft_cached <= len(s.token_ids), "cache > tokens"
        chunk = TokenChunk(s.request_id, kept, delta, proposed=counted_proposed, accepted=kept_accepted,
                           forced=counted_proposed if plan.forced else 0, finish_reason=s.finish_reason,
                           offset=s.num_output - len(kept),
                           logprobs=None if out.logprobs is None else out.logprobs.head(len(kept)),
                           prompt_logprobs=out.prompt_logprobs)
        if out.prompt_logprobs is not None:
            s.prompt_scored = True
        if finished:
            chunk.stats = s.stats()
            outcome.finished.append(s)
        outcome.chunks.append(chunk)
    return outcome


def record_acceptance(records: Sequence[AcceptanceRecord], drafter: AcceptanceStats, lookup: AcceptanceStats
                      ) -> dict[str, float]:
    """A round's acceptance records into the engine's statistics, each source apart (the drafter's drafts, the
    n-gram lookups'); the constraint's forced drafts are counted apart, never read by auto's k: their totals."""
    totals: dict[str, float] = {}
    for record in records:
        if record.forced:
            totals["forced_proposed"] = totals.get("forced_proposed", 0) + record.proposed
            totals["forced_accepted"] = totals.get("forced_accepted", 0) + record.accepted
            continue
        (lookup if record.lookup else drafter).record(record.accepted, record.proposed, record.contract,
                                                      record.ranks, record.tree_nodes)
    return totals


def _commit_prefill(plan: RoundPlan, outcome: RoundOutcome, verifier_holder: Holder,
                    drafter_holder: Holder | None) -> None:
    """A prefiller's prefill-only round (shared_prompts.py): the prefix's KV is kept in both caches; nothing
    is appended, emitted or counted (the request's own first round starts from its last prompt token)."""
    s = plan.state
    outcome.commits.append(CommitItem(TARGET_NAMESPACE, s.request_id, len(plan.target_pending),
                                      plan.target_pending, verifier_holder))
    s.target_cached += len(plan.target_pending)
    if plan.uses_model_drafter:
        assert drafter_holder is not None, "a model draft without a drafter epoch"
        outcome.commits.append(CommitItem(DRAFT_NAMESPACE, s.request_id, len(plan.draft_pending),
                                          plan.draft_pending, drafter_holder))
        s.draft_cached += len(plan.draft_pending)
