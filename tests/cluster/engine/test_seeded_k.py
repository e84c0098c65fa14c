"""A seeded request under `--k auto` gives the same tokens alone or in any batch, and whatever the engine's
cost model measured: its k follows its own acceptance only (cluster/engine/spec_policy.py `choose_k_seeded`).

The engines' cost models are preloaded with measurements (what warm-up would have timed) chosen so that the
engine-wide policy picks different k: speculation pays at batch 1 but not at batch 21, or never (a draft
step costing 1000 s). The tokens of an exact-contract request at temperature > 0 depend on k (other drafts,
other acceptance draws), so a k that follows those measurements shows up as different tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.engine.engine import SpecEngine
from specserve_types.api import GenerationRequest
from tests.cluster.engine.engine_helpers import local_engine, request
from tests.model_runtime.random_checkpoint import make_random_checkpoint

ROWS = range(1, 129)
FLAT = {r: 1.0 for r in ROWS}  # every row count costs the same: deep speculation pays at any batch
SMALL_BATCH_PAYS = {r: 1.0 if r <= 16 else r / 16 for r in ROWS}  # flat up to 16 rows, then linear


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("seeded_k")
    return (make_random_checkpoint(root / "t", seed=41, vocab_size=64),
            make_random_checkpoint(root / "d", seed=42, vocab_size=64, num_layers=1))


def engine_for(pair: tuple[Path, Path], draft_token: float, verify: dict[int, float],
               max_batch: int = 32) -> SpecEngine:
    target, draft = pair
    # float32 draft: a float16 draft computes products of more than 8 rows in bfloat16, so its probabilities
    # would depend on the batch for a reason other than k (reported separately, not what this test is about)
    engine = local_engine(target, draft, tokenizer=None, max_batch=max_batch, block_size=4, kv_blocks=1024,
                          draft_dtype="float32")
    engine.cost.draft_token = draft_token
    engine.cost.verify_by_tokens = dict(verify)
    return engine


def seeded(rid: str = "a", seed: int = 1234) -> GenerationRequest:
    return request(rid, [5, 6, 7], max_tokens=24, k=None, contract="exact", temperature=0.9, seed=seed,
                   ignore_eos=True)


def others() -> list[GenerationRequest]:
    """20 requests of every kind: seeded and not, auto and fixed k, model and n-gram drafts, greedy."""
    out = []
    for i in range(20):
        out.append(request(
            f"o{i}", [10 + i, 3 + i % 5, 40 + i], max_tokens=8 + i, k=None if i % 3 else 2,
            draft="ngram" if i % 5 == 4 else "model", contract="greedy" if i % 7 == 6 else "exact",
            temperature=0.0 if i % 7 == 6 else 0.7 + 0.1 * (i % 4), seed=100 + i if i % 2 == 0 else None,
            ignore_eos=True))
    return out


def run(engine: SpecEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], dict[str, Any]]]:
    """request id -> (tokens, final stats); then the ledger holds nothing for the ended requests."""
    for r in requests:
        engine.submit(r)
    chunks = engine.run_to_completion()
    engine.kv.audit().assert_no_leaks()
    ledger = engine.kv.inner.ledger
    assert all(not ledger.request_ids(ns) for ns in engine.namespaces)
    return {rid: ([t for c in cs for t in c.token_ids], cs[-1].stats) for rid, cs in chunks.items()}


def k_history(stats: dict[str, Any]) -> list[tuple[int, str]]:
    return [(e["k"], e["reason"]) for e in stats["policy_events"]]


def test_seeded_tokens_do_not_depend_on_the_batch(pair: tuple[Path, Path]) -> None:
    alone, alone_stats = run(engine_for(pair, 0.0, SMALL_BATCH_PAYS), [seeded()])["a"]
    batch = others()
    out = run(engine_for(pair, 0.0, SMALL_BATCH_PAYS), [*batch[:7], seeded(), *batch[7:]])
    batched, batched_stats = out["a"]
    acc = alone_stats["acceptance"]
    assert 0 < acc["accepted"] < acc["proposed"]  # it speculated, and drafts were both accepted and rejected
    assert len(alone) == 24 and len(out) == 21
    assert alone == batched, (k_history(alone_stats), k_history(batched_stats))
    assert k_history(alone_stats) == k_history(batched_stats)


def test_seeded_tokens_do_not_depend_on_measured_costs(pair: tuple[Path, Path]) -> None:
    requests = [seeded("a", 1), seeded("b", 2), seeded("c", 3)]
    cheap = run(engine_for(pair, 0.0, FLAT), requests)
    dear = run(engine_for(pair, 1e3, FLAT), requests)  # a draft step "costs" 1000 s
    for rid in ("a", "b", "c"):
        assert cheap[rid][0] == dear[rid][0], (rid, k_history(cheap[rid][1]), k_history(dear[rid][1]))
        assert k_history(cheap[rid][1]) == k_history(dear[rid][1])
        assert all(reason.startswith("seeded: ") or reason == "end of output" for _, reason in k_history(cheap[rid][1]))
    assert cheap["a"][1]["acceptance"]["proposed"] > 0


def test_seeded_suffix_trees_do_not_depend_on_the_batch_or_costs(pair: tuple[Path, Path]) -> None:
    """Suffix drafts: a seeded request's trees come from its own trie (not the global one, which holds what other
    requests wrote) and are sized by nominal costs for a full batch (max_batch 2 in both engines: larger, the
    nominal rows leave it chains), so its tokens are the same alone, beside other suffix requests that finish
    first, and under other measured costs."""
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6]

    def mine() -> GenerationRequest:
        return request("a", prompt, max_tokens=24, k=None, draft="suffix", contract="exact", temperature=0.9,
                       seed=77, ignore_eos=True)

    beside = [request(f"s{i}", prompt[: 4 + i], max_tokens=4 + 2 * i, k=None, draft="suffix", contract="exact",
                      temperature=0.8, seed=None if i % 2 else 300 + i, ignore_eos=True) for i in range(6)]
    alone, alone_stats = run(engine_for(pair, 0.0, SMALL_BATCH_PAYS, max_batch=2), [mine()])["a"]
    batched, batched_stats = run(engine_for(pair, 0.0, FLAT, max_batch=2), [*beside, mine()])["a"]
    assert alone_stats["acceptance"]["tree_rounds"] > 0  # it drafted trees
    assert alone == batched, (k_history(alone_stats), k_history(batched_stats))
    assert k_history(alone_stats) == k_history(batched_stats)
