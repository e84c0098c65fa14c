"""How many nodes a token tree (suffix-drafted, or a draft model's) gets this round (the chain's k comes from
spec_policy.py).

    tree_size(TreeInputs) -> TreeDecision(nodes, reason)

A tree keeps the chain's k levels and spends extra nodes on side branches: the trie's second-best candidates
(or the draft model's) where its best may be wrong. Each extra node is a verify row (and for a draft model, rows of
its levels); it pays only when a side branch is accepted.
From the measurements the engine keeps:

    t(n)   the verify time of batch * (catch_up + n) rows (CostModel's monotone fit, updated every round)
    g      tokens per tree round that came from side branches: accepted nodes of sibling rank >= 1
           (AcceptanceStats.accepted_by_rank) over tree rounds; the engine's (before MIN_TREE_ROUNDS, the prior
           G_PRIOR), then the request's own, shrunk towards the engine's with OWN_PRIOR_ROUNDS pseudo-rounds
    E[Y]   tokens per round, measured (1 + accepted drafts): the engine's, then the request's shrunk towards it
    d, D   a draft model's part of the round: d = k chain steps (CostModel.draft_token), D what drafting k tree
           levels adds to it (k x (CostModel.draft_tree_level - draft_token), once both are measured); 0 for
           suffix trees, whose drafting costs nothing

the tree gets the largest n in (k, limit] with t(n) + D <= (t(k) + d) x (1 + g / E[Y]): the round may grow by at
most the share of tokens side branches add. No n qualifies: a chain of k. Per request, because side branches pay
by request: where a request's chain is accepted whole (a summary of its prompt) no side branch is ever taken, and
it returns to a chain while one on prose keeps its tree (in `bench spec` on the Xeon-AMX, with the engine's g and
the verify alone, the draft model's trees ran a summary at 0.90x its chain: their levels added ~25 ms to a ~170 ms
round and the verify of 13 nodes ~13 ms). At high batch every row costs more, so trees
shrink to chains as k shrinks to plain decoding; where verify rows are nearly free (a CPU scoring 4-16 rows at
1.0-1.3x one, a GPU), trees grow to the limit. A seeded sampled request sizes its tree from its own statistics
and the nominal costs (`tree_size_seeded`), as its k (spec_policy.choose_k_seeded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.spec_policy import MAX_ROWS, CostModel, NominalCosts

MIN_TREE_ROUNDS = 16  # tree rounds measured before g is read
G_PRIOR = 0.25  # side-branch tokens per round assumed until then (so trees are tried, and measured)
OWN_PRIOR_ROUNDS = 4  # weight of the engine's g and E[Y] in a request's own, in rounds


@dataclass(frozen=True)
class TreeInputs:
    k: int  # the chain's length (levels of the tree)
    limit: int  # most nodes (EngineConfig.tree_nodes)
    catch_up: int
    batch: int
    cost: CostModel
    engine: AcceptanceStats
    own: AcceptanceStats = field(default_factory=AcceptanceStats)  # the request's
    model_draft: bool = False  # a draft model's tree (its levels cost draft time), not a suffix tree's


@dataclass(frozen=True)
class TreeDecision:
    nodes: int  # == k: a chain
    reason: str


def side_gain(stats: AcceptanceStats) -> tuple[float, str]:
    """g (module docstring) and where it came from."""
    if stats.tree_rounds < MIN_TREE_ROUNDS:
        return G_PRIOR, f"prior {G_PRIOR}"
    return sum(stats.accepted_by_rank[1:]) / stats.tree_rounds, f"measured over {stats.tree_rounds} tree rounds"


def request_gain(own: AcceptanceStats, engine: AcceptanceStats, k: int) -> tuple[float, float, str]:
    """g and E[Y] for one request (module docstring): its own tree rounds and rounds, shrunk towards the engine's
    with OWN_PRIOR_ROUNDS pseudo-rounds."""
    gain, source = side_gain(engine)
    tokens = engine.mean_tokens_per_round or 1.0 + k / 2
    if not own.rounds:
        return gain, tokens, source
    w = OWN_PRIOR_ROUNDS
    own_gain = (sum(own.accepted_by_rank[1:]) + w * gain) / (own.tree_rounds + w)
    own_tokens = (own.rounds + own.accepted + w * tokens) / (own.rounds + w)
    return own_gain, own_tokens, f"request: {own.tree_rounds} tree rounds of {own.rounds}; engine: {source}"


def largest_tree(k: int, limit: int, stats: AcceptanceStats, verify_cost: Callable[[int], float],
                 costs: str, own: AcceptanceStats | None = None, draft: float = 0.0,
                 draft_growth: float = 0.0) -> TreeDecision:
    """The rule of the module docstring: the largest n in (k, limit] with verify_cost(n) + draft_growth <=
    (verify_cost(k) + draft) x (1 + g / E[Y]), g and E[Y] from `stats` (the engine's; with `own`, the request's
    shrunk towards them); `costs` names where verify_cost comes from (for the reason)."""
    if k == 0 or limit <= k:
        return TreeDecision(k, "chain: tree limit" if k else "plain")
    gain, tokens, source = request_gain(own or AcceptanceStats(), stats, k)
    allowed = 1.0 + gain / tokens
    base = verify_cost(k) + draft
    nodes = max([n for n in range(k + 1, limit + 1) if verify_cost(n) + draft + draft_growth <= base * allowed],
                default=k)
    if nodes == k:
        return TreeDecision(k, f"chain: side branches add {gain:.2f} tokens/round ({source}), under what a tree "
                               f"adds to the round ({costs})")
    return TreeDecision(nodes, f"tree: {nodes} nodes within the round x{allowed:.2f} ({costs}; side branches "
                               f"{gain:.2f} tokens/round, {source})")


def tree_size(inputs: TreeInputs) -> TreeDecision:
    """Sized by the measured verify times of the whole batch's rows and, for a draft model's tree, the measured
    draft steps and tree levels."""
    cost, k, batch, catch_up = inputs.cost, inputs.k, inputs.batch, inputs.catch_up
    if k and inputs.limit > k and cost.verify_time(batch * (catch_up + k)) is None:
        return TreeDecision(k, "chain: verify cost not measured yet")
    # no size whose rows were never timed: past the largest measured row count the fit reads flat, which would
    # make every larger tree look free (the rounds that run measure their own rows, so the bound moves up)
    measured = max(cost.verify_by_tokens, default=0)
    limit = min(inputs.limit, max(k, (MAX_ROWS if measured >= MAX_ROWS else measured) // batch - catch_up))
    draft = draft_growth = 0.0
    if inputs.model_draft and cost.draft_token is not None:
        draft = k * cost.draft_token
        if cost.draft_tree_level is not None:  # until a tree round is measured, trees are tried at a chain's cost
            draft_growth = k * max(0.0, cost.draft_tree_level - cost.draft_token)
    return largest_tree(k, limit, inputs.engine, lambda n: cost.verify_time(batch * (catch_up + n)) or 0.0,
                        "measured", inputs.own, draft, draft_growth)


def tree_size_seeded(k: int, limit: int, own: AcceptanceStats, costs: NominalCosts,
                     model_draft: bool = False, max_batch: int = 1) -> TreeDecision:
    """The same rule for a seeded sampled request from what its tokens may depend on (spec_policy.SeededInputs):
    its own tree rounds for g and E[Y] (shrunk towards the priors, G_PRIOR and 1 + k / 2, not the engine's), and
    the nominal cost table and, for a draft model's tree, its nominal draft step and tree level, never measured
    times or the batch of the moment: the tree's shape decides which uniforms its accept tests draw. The rows are
    those of a full batch, `max_batch` requests of catch-up 1 (the engine's setting: the command's, so a seed still
    gives the same tokens): a tree sized as if alone cost a full batch of them 0.78x its chains (Qwen pair, batch
    8, T=0.7, docs/speculation.md). A draft step of that many rows is read off the same table."""
    rows = costs.verify_cost(max_batch)
    draft = k * costs.draft_token * rows if model_draft else 0.0
    growth = draft * (costs.tree_level_factor - 1.0)
    return largest_tree(k, limit, AcceptanceStats(), lambda n: costs.verify_cost(max_batch * (1 + n)),
                        f"nominal costs, {costs.name}" + (f", {max_batch} requests" if max_batch > 1 else ""), own,
                        draft, growth)


__all__ = ["G_PRIOR", "MIN_TREE_ROUNDS", "OWN_PRIOR_ROUNDS", "TreeDecision", "TreeInputs", "largest_tree",
           "request_gain", "side_gain", "tree_size", "tree_size_seeded"]
