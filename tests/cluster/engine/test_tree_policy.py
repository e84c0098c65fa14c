"""Tree sizing (cluster/engine/tree_policy.py): the largest tree whose verify grows by at most the share of tokens
side branches add, from measured costs or, for seeded requests, from the nominal table."""

from __future__ import annotations

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.spec_policy import BFLOAT16_COSTS, FLOAT32_COSTS, CostModel
from cluster.engine.tree_policy import G_PRIOR, MIN_TREE_ROUNDS, TreeInputs, tree_size, tree_size_seeded


def test_nearly_free_rows_grow_trees_and_dear_rows_keep_chains() -> None:
    # prior g 0.25 over E[Y] 1 + k/2 = 2 at k = 2: the verify may grow 12.5%; bf16 rows 1..16 cost 1.0-1.1 of one
    assert tree_size_seeded(2, 16, AcceptanceStats(), BFLOAT16_COSTS).nodes == 15
    assert tree_size_seeded(1, 16, AcceptanceStats(), FLOAT32_COSTS).nodes == 1  # 3 rows cost 1.2 of 2
    assert tree_size_seeded(2, 2, AcceptanceStats(), BFLOAT16_COSTS).reason == "chain: tree limit"


def test_measured_side_branches_and_costs_decide() -> None:
    cost = CostModel()
    for rows, seconds in ((1, 0.10), (3, 0.10), (6, 0.11), (12, 0.20)):
        cost.observe_verify(rows, seconds)
    assert tree_size(TreeInputs(2, 16, 1, 1, CostModel(), AcceptanceStats())).reason.startswith("chain: verify cost")
    unmeasured = tree_size(TreeInputs(2, 16, 1, 1, cost, AcceptanceStats()))
    assert 2 < unmeasured.nodes < 11 and "prior" in unmeasured.reason and G_PRIOR > 0
    barren = AcceptanceStats(rounds=MIN_TREE_ROUNDS, accepted=MIN_TREE_ROUNDS, tree_rounds=MIN_TREE_ROUNDS,
                             accepted_by_rank=[MIN_TREE_ROUNDS])  # side branches never accepted: g = 0
    barren_size = tree_size(TreeInputs(2, 16, 1, 1, cost, barren))  # every extra row costs a little: a chain
    assert barren_size.nodes == 2 and "add 0.00 tokens/round" in barren_size.reason
    assert tree_size(TreeInputs(2, 16, 1, 8, cost, AcceptanceStats())).nodes == 2  # at batch 8 rows cost: a chain
