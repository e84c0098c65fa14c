"""How many nodes a suffix-drafted token tree gets this round (the chain's k comes from spec_policy.py).

    tree_size(TreeInputs) -> TreeDecision(nodes, reason)

A tree keeps the chain's k levels and spends extra nodes on side branches: the trie's second-best candidates
where its best may be wrong. Each extra node is a verify row; it pays only when a side branch is accepted.
From the measurements the engine keeps:

    t(n)   the verify time of batch * (catch_up + n) rows (CostModel's monotone fit, updated every round)
    g      tokens per tree round that came from side branches: accepted nodes of sibling rank >= 1
           (AcceptanceStats.accepted_by_rank) over tree rounds; before MIN_TREE_ROUNDS, the prior G_PRIOR
    E[Y]   tokens per round, measured (1 + accepted drafts)

the tree gets the largest n in (k, limit] with t(n) / t(k) <= 1 + g / E[Y]: the verify may grow by at most the
share of tokens side branches add. No n qualifies: a chain of k. At high batch every row costs more, so trees
shrink to chains as k shrinks to plain decoding; where verify rows are nearly free (a CPU scoring 4-16 rows at
1.0-1.3x one, a GPU), trees grow to the limit. A seeded sampled request sizes its tree from its own statistics
and the nominal costs (`tree_size_seeded`), as its k (spec_policy.choose_k_seeded).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.spec_policy import CostModel, NominalCosts

MIN_TREE_ROUNDS = 16  # tree rounds measured before g is read
G_PRIOR = 0.25  # side-branch tokens per round assumed until then (so trees are tried, and measured)


@dataclass(frozen=True)
class TreeInputs:
    k: int  # the chain's length (levels of the tree)
    limit: int  # most nodes (EngineConfig.tree_nodes)
    catch_up: int
    batch: int
    cost: CostModel
    engine: AcceptanceStats


@dataclass(frozen=True)
class TreeDecision:
    nodes: int  # == k: a chain
    reason: str


def side_gain(stats: AcceptanceStats) -> tuple[float, str]:
    """g (module docstring) and where it came from."""
    if stats.tree_rounds < MIN_TREE_ROUNDS:
        return G_PRIOR, f"prior {G_PRIOR}"
    return sum(stats.accepted_by_rank[1:]) / stats.tree_rounds, f"measured over {stats.tree_rounds} tree rounds"


def tree_size(inputs: TreeInputs) -> TreeDecision:
    k, limit, cost = inputs.k, inputs.limit, inputs.cost
    if k == 0 or limit <= k:
        return TreeDecision(k, "chain: tree limit" if k else "plain")
    base = cost.verify_time(inputs.batch * (inputs.catch_up + k))
    if base is None:
        return TreeDecision(k, "chain: verify cost not measured yet")
    gain, source = side_gain(inputs.engine)
    tokens = inputs.engine.mean_tokens_per_round or 1.0 + k / 2
    allowed = 1.0 + gain / tokens
    nodes = k
    for n in range(k + 1, limit + 1):
        t = cost.verify_time(inputs.batch * (inputs.catch_up + n))
        assert t is not None
        if t <= base * allowed:
            nodes = n
    if nodes == k:
        return TreeDecision(k, f"chain: side branches add {gain:.2f} tokens/round ({source}), under their verify cost")
    return TreeDecision(nodes, f"tree: {nodes} nodes within verify x{allowed:.2f} (side branches {gain:.2f} "
                               f"tokens/round, {source})")


def tree_size_seeded(k: int, limit: int, own: AcceptanceStats, costs: NominalCosts) -> TreeDecision:
    """The same rule for a seeded sampled request from what its tokens may depend on (spec_policy.SeededInputs):
    its own tree rounds for g and E[Y], and the nominal cost table at one request's rows (catch-up 1), never
    measured times or the batch: the tree's shape decides which uniforms its accept tests draw."""
    if k == 0 or limit <= k:
        return TreeDecision(k, "chain: tree limit" if k else "plain")
    gain, source = side_gain(own)
    tokens = own.mean_tokens_per_round or 1.0 + k / 2
    allowed = 1.0 + gain / tokens
    base = costs.verify_cost(1 + k)
    nodes = max([n for n in range(k + 1, limit + 1) if costs.verify_cost(1 + n) <= base * allowed], default=k)
    if nodes == k:
        return TreeDecision(k, f"chain: nominal costs ({costs.name}), side branches {gain:.2f} tokens/round")
    return TreeDecision(nodes, f"tree: {nodes} nodes by nominal costs ({costs.name}; side branches {gain:.2f} "
                               f"tokens/round, {source})")


__all__ = ["G_PRIOR", "MIN_TREE_ROUNDS", "TreeDecision", "TreeInputs", "side_gain", "tree_size", "tree_size_seeded"]
