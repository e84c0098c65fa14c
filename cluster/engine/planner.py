"""Plan: how many draft tokens k one request proposes this round, and by which drafter.

    plan_context(config, states, ...) -> PlanContext                 the engine-wide values, once per round
    plan_request(state, context) -> RoundPlan(k, target_pending, drafts (n-gram, suffix), uses_model_drafter,
                                              reason, rounds_at_zero)

Fixed k, or auto (spec_policy.py): seeded sampled requests from their own history only, the others from
the measured costs. n-gram and suffix drafts are made here (in process); a suffix draft is a token tree of k
levels whose size tree_policy.py picks, or its best chain. Under auto a model-drafted request also looks up its
last tokens in its own prompt and output (`draft_lookup`): where that n-gram chain matches, auto picks its k from
the request's lookup acceptance at no draft cost, and the round drafts the lookup's chain if its expected tokens a
second are no lower than the draft model's choice (spec_policy.lookup_wins); the draft model's cache then catches up
in its next round. Each source's acceptance is measured apart, so an n-gram that copies long spans (edits,
summaries) never makes the draft model look better, nor the model the lookup; a lookup's estimate reads the
request's own lookups only (other requests' copy more or less than it does). The plan is built once, on
the engine thread, and writes nothing: the engine records its k, reason and rounds at zero on the request, enters
a model-drafted request in the draft namespace, sets its `draft_pending` and reserves the plan's maximum
(docs/ARCHITECTURE.md §2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.catch_up import USUAL_CATCH_UP, price_catch_up
from cluster.engine.config import EngineConfig
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
from cluster.engine.spec_policy import (
    FLOAT32_COSTS,
    AutoDecision,
    AutoInputs,
    CostModel,
    NominalCosts,
    SeededInputs,
    choose_k,
    choose_k_seeded,
    lookup_wins,
)
from cluster.engine.tree_policy import TreeDecision, TreeInputs, tree_size, tree_size_seeded
from drafter_service.ngram import MAX_N, propose_ngram
from drafter_service.suffix_drafts import SuffixDrafter
from verifier_service.tree_contracts import TokenTree

LOOKUP_N = MAX_N  # a model-drafted request's lookups match its last this many tokens


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
    max_batch: int = 1  # the engine's setting: seeded requests size trees for a full batch (tree_policy.py)
    nominal: NominalCosts = FLOAT32_COSTS  # seeded requests' costs: by the target's dtype (spec_policy.py)
    suffix: SuffixDrafter | None = None  # the engine's suffix drafter (its tries: the engine thread's)
    tree_nodes: int = 0  # most nodes of a suffix tree (0: chains only)
    model_tree_nodes: int = 0  # most nodes of a draft model's tree (0: chains; always 0 outside the serial mode)
    draft_stop_below: float = 0.0  # auto greedy model-draft chains stop after a draft below this probability
    lookup: bool = False  # auto model-drafted requests may draft a round from their n-gram lookup instead


def plan_context(config: EngineConfig, states: Sequence[RequestState], free_fraction: Callable[[], float],
                 drafter_usable: Callable[[], bool], engine_acceptance: AcceptanceStats, cost: CostModel,
                 nominal: NominalCosts, suffix: SuffixDrafter, model_trees: bool) -> PlanContext:
    """The context of one round's plans for `states`: the target pool's free fraction asked only where auto reads
    it, the drafter's health only where a request drafts with the model (asking may start its retry).
    `model_trees`: a draft model may draft token trees (serial steps only: the others draft ahead in chains)."""
    return PlanContext(
        k_max=config.k_max, probe_every=config.probe_every, pressure_free_fraction=config.pressure_free_fraction,
        free_fraction=free_fraction() if any(s.request.spec.k is None and s.request.spec.draft != "none"
                                             for s in states) else 1.0,
        drafter_usable=any(s.request.spec.draft == "model" for s in states) and drafter_usable(),
        engine_acceptance=engine_acceptance, cost=cost, batch=len(states), max_batch=config.max_batch,
        nominal=nominal, suffix=suffix, tree_nodes=config.tree_nodes,
        model_tree_nodes=config.model_tree_nodes if model_trees else 0, draft_stop_below=config.draft_stop_below,
        lookup=config.draft_lookup)


def plan_request(state: RequestState, ctx: PlanContext) -> RoundPlan:
    spec, sampling = state.request.spec, state.request.sampling
    remaining = sampling.max_tokens - state.num_output
    k_cap = max(0, min(ctx.k_max if spec.k is None else spec.k, remaining - 1))
    pending = state.token_ids[state.target_cached:]
    if spec.draft == "none" or k_cap == 0:
        return RoundPlan(state=state, k=0, target_pending=pending, reason="no speculation requested"
                         if spec.draft == "none" or spec.k == 0 else "end of output")
    forced = state.constraint.forced(k_cap) if state.constraint is not None else []
    if forced:  # the constraint's own next tokens: drafted at no draft cost, whatever the drafter
        return RoundPlan(state=state, k=len(forced), target_pending=pending, drafts=forced, forced=len(forced),
                         reason="constraint: forced tokens", rounds_at_zero=0)
    lookup = _lookup(state, ctx, k_cap)
    if spec.draft == "model" and not ctx.drafter_usable and not lookup:
        return RoundPlan(state=state, k=0, target_pending=pending, reason="fallback: drafter unavailable, plain decoding")
    looked_up = False  # this round drafts the lookup's chain
    if spec.k is not None:
        k, reason = k_cap, "fixed k"
    else:
        decision = _auto_k(state, ctx, k_cap, len(pending))
        veto = _catch_up_veto(state, ctx, decision, k_cap)
        if veto is not None:
            decision = veto
        if lookup:
            chosen = _auto_k(state, ctx, len(lookup), len(pending), lookup=True)
            # in a batch the draft model's steps are the batch's: a request that looks up saves them only if every
            # other one does, so there the lookup must beat the model's chain as if its drafting were free
            rival = decision if ctx.batch == 1 or veto else _auto_k(state, ctx, k_cap, len(pending), free_draft=True)
            looked_up = lookup_wins(chosen, rival) or not ctx.drafter_usable
            decision = chosen if looked_up else decision
        k, reason = decision.k, decision.reason
    at_zero = state.rounds_at_zero + 1 if k == 0 else 0  # auto's plain-decoding rounds in a row (it re-probes)
    if looked_up:
        return RoundPlan(state=state, k=k, target_pending=pending, drafts=lookup[:k], lookup=k > 0,
                         reason=f"{reason}; lookup: n-gram chain" if k else reason, rounds_at_zero=at_zero)
    drafts: list[int] = []
    parents: tuple[int, ...] | None = None
    if spec.draft == "ngram" and k > 0:
        drafts = propose_ngram(state.token_array(), k)
        k = len(drafts)
        if k == 0:
            reason = "n-gram: no match"
    elif spec.draft == "suffix" and k > 0:
        drafts, parents, reason = _suffix_drafts(state, ctx, k, len(pending), reason)
        k = len(drafts)
    budget = 0
    if spec.draft == "model" and k > 0 and ctx.model_tree_nodes:
        size = _tree_size(state, ctx, k, len(pending), ctx.model_tree_nodes)
        budget = size.nodes if size.nodes > k else 0
        reason = f"{reason}; {size.reason}"
    # auto's k is the most a greedy chain drafts: it ends after a draft the draft model is unsure of, and a greedy
    # tree feeds no level whose best path it is unsure of (fixed k and sampled requests draft as asked)
    stop_below = ctx.draft_stop_below if (spec.draft == "model" and k > 1 and spec.k is None
                                          and sampling.is_greedy) else 0.0
    return RoundPlan(state=state, k=k, target_pending=pending, drafts=drafts,
                     uses_model_drafter=spec.draft == "model" and k > 0, draft_parents=parents, tree_budget=budget,
                     draft_stop_below=stop_below, reason=reason, rounds_at_zero=at_zero)


def _lookup(state: RequestState, ctx: PlanContext, k_cap: int) -> list[int]:
    """An auto model-drafted request's n-gram lookup for this round: what followed the latest earlier match of its
    last LOOKUP_N tokens, up to k_cap ([] where lookups are off, k is fixed, or nothing matches). Only a match of
    LOOKUP_N tokens: shorter ones match common tokens anywhere, where the draft model does better."""
    spec = state.request.spec
    if not ctx.lookup or spec.draft != "model" or spec.k is not None or k_cap == 0:
        return []
    return propose_ngram(state.token_array(), k_cap, min_n=LOOKUP_N)


def _catch_up_veto(state: RequestState, ctx: PlanContext, decision: AutoDecision, k_cap: int) -> AutoDecision | None:
    """Plain decoding instead of the draft model's round where the tokens its cache lacks cost more to feed it than
    drafting saves over the rest of the request (catch_up.py); None: the decision stands. Measured costs only: a
    seeded sampled request's k reads its own history and nominal costs."""
    sampling = state.request.sampling
    tokens = len(state.token_ids) - state.draft_cached
    if tokens <= USUAL_CATCH_UP or state.request.spec.draft != "model" or decision.k == 0 or not ctx.drafter_usable \
            or (sampling.seed is not None and not sampling.is_greedy):
        return None  # most rounds: the usual catch-up, nothing to price
    price = price_catch_up(_auto_inputs(state, ctx, k_cap, 1), tokens)
    if price is None or price.pays:
        return None
    return AutoDecision(0, f"draft catch-up: {tokens} tokens cost {price.extra * 1e3:.0f} ms, drafting saves "
                           f"{max(price.saved, price.budget) * 1e3:.0f} ms")


def _auto_inputs(state: RequestState, ctx: PlanContext, k_cap: int, catch_up: int, lookup: bool = False,
                 free_draft: bool = False) -> AutoInputs:
    """What auto's k for one request reads from the measured costs (not a seeded sampled request's: its own)."""
    spec, sampling = state.request.spec, state.request.sampling
    own = state.lookup_acceptance if lookup else state.acceptance
    model_draft = spec.draft == "model" and not lookup
    # a lookup's acceptance is the request's own, shrunk towards the prior: it is high where a request copies its
    # prompt or itself (edits, summaries) and low elsewhere, so other requests' say little about it
    return AutoInputs(
        own, AcceptanceStats() if lookup else ctx.engine_acceptance, ctx.cost, k_cap, catch_up,
        state.rounds_at_zero, ctx.probe_every, ctx.free_fraction, ctx.pressure_free_fraction,
        draft_cost_per_token=ctx.cost.draft_token if model_draft and not free_draft else 0.0, batch=ctx.batch,
        tokens_left=sampling.max_tokens - state.num_output)


def _auto_k(state: RequestState, ctx: PlanContext, k_cap: int, catch_up: int, lookup: bool = False,
            free_draft: bool = False) -> AutoDecision:
    """Auto's k for one request: from its drafter's acceptance, or (`lookup`) from its n-gram lookups' at no draft
    cost. A seeded sampled request reads its own history and nominal costs only, so its seed reproduces its tokens
    whatever the batch and timing; the others the measured costs and the engine-wide acceptance."""
    spec, sampling = state.request.spec, state.request.sampling
    own = state.lookup_acceptance if lookup else state.acceptance
    model_draft = spec.draft == "model" and not lookup
    tokens_left = sampling.max_tokens - state.num_output
    if sampling.seed is not None and not sampling.is_greedy:
        return choose_k_seeded(SeededInputs.of(own, k_cap, state.rounds_at_zero, ctx.probe_every,
                                               model_draft=model_draft, costs=ctx.nominal, tokens_left=tokens_left))
    return choose_k(_auto_inputs(state, ctx, k_cap, catch_up, lookup, free_draft))


def _tree_size(state: RequestState, ctx: PlanContext, k: int, catch_up: int, limit: int) -> TreeDecision:
    """Nodes for a token tree of k levels: fixed k takes the limit, seeded sampled requests size it from their own
    statistics and nominal costs, the others from the measured ones (tree_policy.py); penalties: a chain."""
    sampling = state.request.sampling
    if sampling.has_penalties or limit <= k:
        return TreeDecision(k, "chain: penalties" if sampling.has_penalties else "chain: tree limit")
    if state.request.spec.k is not None:
        return TreeDecision(limit, f"tree: up to {limit} nodes (fixed k)")
    model_draft = state.request.spec.draft == "model"  # its levels cost draft time; a suffix tree's do not
    if sampling.seed is not None and not sampling.is_greedy:
        return tree_size_seeded(k, limit, state.acceptance, ctx.nominal, model_draft, ctx.max_batch)
    return tree_size(TreeInputs(k, limit, catch_up, ctx.batch, ctx.cost, ctx.engine_acceptance, state.acceptance,
                                model_draft))


def _suffix_drafts(state: RequestState, ctx: PlanContext, k: int, catch_up: int,
                   reason: str) -> tuple[list[int], tuple[int, ...] | None, str]:
    """A suffix tree of k levels (tree_policy.py sizes it; fixed k: the limit), or its best chain where trees
    are off or penalties apply (they read one history per row); no candidate in the tries: the n-gram chain."""
    assert ctx.suffix is not None, "suffix drafts need the engine's suffix drafter"
    sampling = state.request.sampling
    seeded = sampling.seed is not None and not sampling.is_greedy  # its tokens depend on its own history only
    size = _tree_size(state, ctx, k, catch_up, ctx.tree_nodes)
    # a chain is the best path of a wider proposal (best-first spends nodes on side branches); a seeded request
    # drafts from its own prompt and output only (the global trie holds what other requests wrote)
    proposal = ctx.suffix.propose(state.request_id, state.token_ids, max(size.nodes, 4 * k), levels=k,
                                  own_only=seeded)
    if proposal is None:  # nothing above the trie's min score: the n-gram drafter's latest match, if any
        chain = propose_ngram(state.token_array(), k)
        return chain, None, f"{reason}; suffix: no match, n-gram" if chain else "suffix: no match"
    if size.nodes == k or len(proposal.tree) <= k:
        chain = proposal.chain(k)
        return chain, None, f"{reason}; {size.reason}"
    # the first n nodes popped best-first are the tree a budget of n would have given
    tree = TokenTree(proposal.tree.tokens[:size.nodes], proposal.tree.parents[:size.nodes])
    if tree.is_chain():
        return list(tree.tokens), None, f"{reason}; {size.reason}"
    return list(tree.tokens), tree.parents, f"{reason}; {size.reason}"
