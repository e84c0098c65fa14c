"""Tree sizing (cluster/engine/tree_policy.py): the largest tree whose round grows by at most the share of tokens
side branches add, from measured costs and the request's own side branches or, for seeded requests, from the
nominal table and their own rounds only."""

from __future__ import annotations

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.spec_policy import BFLOAT16_COSTS, BFLOAT16_INT8_DRAFT_COSTS, FLOAT32_COSTS, CostModel
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


def test_a_draft_models_tree_counts_its_levels_and_the_requests_own_side_branches() -> None:
    cost = CostModel()
    for rows, seconds in ((1, 0.100), (4, 0.101), (8, 0.102), (17, 0.104)):  # verify rows nearly free (AMX)
        cost.observe_verify(rows, seconds)
    cost.observe_draft(3, 0.066)  # chain steps: 22 ms
    cost.observe_draft(3, 0.078, tree=True)  # tree levels: 26 ms, kept apart from the chain's step
    assert abs(cost.draft_token - 0.022) < 1e-12 and abs(cost.draft_tree_level - 0.026) < 1e-12
    engine = AcceptanceStats(rounds=40, accepted=60, tree_rounds=40, accepted_by_rank=[40, 20])  # g 0.5, E[Y] 2.5
    # a new request reads the engine's: round 0.167 s -> 0.182 s with 16 nodes, within x1.2
    assert tree_size(TreeInputs(3, 16, 1, 1, cost, engine, AcceptanceStats(), model_draft=True)).nodes == 16
    # a summary: every chain accepted whole over 12 tree rounds, never a side branch: g 0.125 over E[Y] 3.6
    whole = AcceptanceStats(rounds=12, accepted=36, tree_rounds=12, accepted_by_rank=[36])
    chain = tree_size(TreeInputs(3, 16, 1, 1, cost, engine, whole, model_draft=True))
    assert chain.nodes == 3 and "request: 12 tree rounds of 12" in chain.reason
    # the same request's suffix tree costs only verify rows, nearly free here: it keeps its tree
    assert tree_size(TreeInputs(3, 16, 1, 1, cost, engine, whole)).nodes == 16
    # prose: a side branch in most of its tree rounds keeps the draft model's tree
    prose = AcceptanceStats(rounds=12, accepted=14, tree_rounds=12, accepted_by_rank=[6, 8])
    assert tree_size(TreeInputs(3, 16, 1, 1, cost, engine, prose, model_draft=True)).nodes == 16


def test_a_seeded_request_sizes_a_draft_models_tree_from_its_own_rounds_and_nominal_costs() -> None:
    # nominal: verify of 1..8 rows 1.0, the int8 draft's step 0.22 and a tree level 1.2 steps
    fresh = tree_size_seeded(3, 16, AcceptanceStats(), BFLOAT16_INT8_DRAFT_COSTS, model_draft=True)
    assert fresh.nodes == 7  # the prior g 0.25 over E[Y] 2.5 pays 10%: 8 rows and the levels' 0.13 fit
    whole = AcceptanceStats(rounds=12, accepted=36, tree_rounds=12, accepted_by_rank=[36])
    assert tree_size_seeded(3, 16, whole, BFLOAT16_INT8_DRAFT_COSTS, model_draft=True).nodes == 3
    assert tree_size_seeded(3, 16, whole, BFLOAT16_INT8_DRAFT_COSTS).nodes == 7  # a suffix tree: rows only


def test_a_seeded_request_sizes_its_tree_for_a_full_batch() -> None:
    """A seeded tree never reads the batch of the moment, but the engine's max_batch: sized as if alone, a full
    batch of them scored 8 x 17 rows where chains scored 8 x 4 (0.78x the chains in bench spec)."""
    branchy = AcceptanceStats(rounds=12, accepted=24, tree_rounds=12, accepted_by_rank=[12, 12])  # g = 1
    alone = tree_size_seeded(3, 16, branchy, BFLOAT16_INT8_DRAFT_COSTS, model_draft=True)
    assert alone.nodes == 16 and "requests" not in alone.reason  # g 0.81 over E[Y] 2.9: x1.28 fits 17 rows
    full = tree_size_seeded(3, 16, branchy, BFLOAT16_INT8_DRAFT_COSTS, model_draft=True, max_batch=8)
    assert full.nodes < alone.nodes and "8 requests" in full.reason
    assert tree_size_seeded(3, 16, AcceptanceStats(), BFLOAT16_INT8_DRAFT_COSTS, max_batch=8).nodes == 3  # prior g
