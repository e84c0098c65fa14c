"""Greedy contract: the engine's output equals plain greedy target decoding token by token."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.engine.engine_helpers import local_engine, plain_greedy, random_pair, request, run


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return random_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize("draft", ["model", "ngram", "suffix", "none"])
def test_greedy_equals_plain_decoding_batched(pair: tuple[Path, Path], draft: str) -> None:
    target, draft_dir = pair
    engine = local_engine(target, draft_dir if draft == "model" else draft, tokenizer=None,
                          max_batch=4, block_size=4, kv_blocks=256)
    prompts = [[9, 3, 4, 5, 9, 3, 4, 6, 9, 3, 4], [10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28], [7]]
    reqs = [request(f"r{i}", p, max_tokens=20 + i, k=1 + i % 3, draft=draft) for i, p in enumerate(prompts)]
    got = run(engine, reqs)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == plain_greedy(target, p, 20 + i), f"request r{i}"
    engine.kv.audit().assert_no_leaks()
    if draft == "suffix":  # token trees ran through the runtime's tree mask and the pool's slot moves
        assert engine.acceptance.tree_rounds > 0 and engine.acceptance.accepted > 0


def test_overlap_two_groups_equals_plain_decoding(pair: tuple[Path, Path]) -> None:
    """Drafting one group while verifying the other changes nothing in the output."""
    target, draft_dir = pair
    engine = local_engine(target, draft_dir, tokenizer=None, max_batch=6, block_size=4, kv_blocks=256,
                          overlap=True)
    prompts = [[3, 4, 5, 3], [10, 11], [20, 21, 22, 23, 24], [7], [9, 9, 9], [30, 31, 32]]
    reqs = [request(f"r{i}", p, max_tokens=14 + i, k=1 + i % 3, draft="model", ignore_eos=True)
            for i, p in enumerate(prompts)]
    for r in reqs[:3]:
        engine.submit(r)
    early = engine.step() + engine.step()
    for r in reqs[3:]:  # join between rounds, while a group's drafts are in flight
        engine.submit(r)
    engine.abort("r1")
    chunks = engine.run_to_completion()
    engine.close()
    for i, p in enumerate(prompts):
        tokens = [t for c in early + chunks[f"r{i}"] if c.request_id == f"r{i}" for t in c.token_ids]
        if i == 1:
            assert chunks["r1"][-1].finish_reason == "abort"
            continue
        assert tokens == plain_greedy(target, p, 14 + i), f"request r{i}"
    engine.kv.audit().assert_no_leaks()
