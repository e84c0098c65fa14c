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

from collections.abc import Callable
from dataclasses import dataclass

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.spec_policy import MAX_ROWS, CostModel, NominalCosts

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


def largest_tree(k: int, limit: int, stats: AcceptanceStats, verify_cost: Callable[[int], float],
                 costs: str) -> TreeDecision:
    """The rule of the module docstring: the largest n in (k, limit] with verify_cost(n) <= verify_cost(k) x
    (1 + g / E[Y]), g and E[Y] from `stats`; `costs` names where verify_cost comes from (for the reason)."""
    if k == 0 or limit <= k:
        return TreeDecision(k, "chain: tree limit" if k else "plain")
    gain, source = side_gain(stats)
    allowed = 1.0 + gain / (stats.mean_tokens_per_round or 1.0 + k / 2)
    base = verify_cost(k)
    nodes = max([n for n in range(k + 1, limit + 1) if verify_cost(n) <= base * allowed], default=k)
    if nodes == k:
        return TreeDecision(k, f"chain: side branches add {gain:.2f} tokens/round ({source}), under their verify "
                               f"cost ({costs})")
    return TreeDecision(nodes, f"tree: {nodes} nodes within verify x{allowed:.2f} ({costs}; side branches "
                               f"{gain:.2f} tokens/round, {source})")


def tree_size(inputs: TreeInputs) -> TreeDecision:
    """Sized by the measured verify times of the whole batch's rows."""
    cost, k, batch, catch_up = inputs.cost, inputs.k, inputs.batch, inputs.catch_up
    if k and inputs.limit > k and cost.verify_time(batch * (catch_up + k)) is None:
        return TreeDecision(k, "chain: verify cost not measured yet")
    # no size whose rows were never timed: past the largest measured row count the fit reads flat, which would
    # make every larger tree look free (the rounds that run measure their own rows, so the bound moves up)
    measured = max(cost.verify_by_tokens, default=0)
    limit = min(inputs.limit, max(k, (MAX_ROWS if measured >= MAX_ROWS else measured) // batch - catch_up))
    return largest_tree(k, limit, inputs.engine, lambda n: cost.verify_time(batch * (catch_up + n)) or 0.0,
                        "measured")


def tree_size_seeded(k: int, limit: int, own: AcceptanceStats, costs: NominalCosts) -> TreeDecision:
    """The same rule for a seeded sampled request from what its tokens may depend on (spec_policy.SeededInputs):
    its own tree rounds for g and E[Y], and the nominal cost table at one request's rows (catch-up 1), never
    measured times or the batch: the tree's shape decides which uniforms its accept tests draw."""
    return largest_tree(k, limit, own, lambda n: costs.verify_cost(1 + n), f"nominal costs, {costs.name}")


__all__ = ["G_PRIOR", "MIN_TREE_ROUNDS", "TreeDecision", "TreeInputs", "largest_tree", "side_gain", "tree_size",
           "tree_size_seeded"]
