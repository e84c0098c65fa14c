"""Overlap (two groups in ping-pong) with the KV pool exhausted: a request refused a reservation must
neither stay "in flight" nor block preemption or an abort. Model-free engine (engine_helpers.fake_engine);
every test ends with the ledger reconciled (empty) and no leaked block."""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from typing import Any

import pytest

from cluster.engine.engine import SpecEngine
from kv_manager.errors import OutOfBlocks
from kv_manager.schema import ReserveItem
from specserve_types.api import TokenChunk
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, fake_engine, fake_greedy, request

STEP_BUDGET = 3000  # steps; the runs below take a few hundred


def drive(engine: SpecEngine, out: dict[str, list[TokenChunk]], budget: int = STEP_BUDGET) -> None:
    """Step until every request ended; fail after `budget` steps (no progress: a livelock)."""
    for _ in range(budget):
        if not engine.has_unfinished():
            return
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
    raise AssertionError(f"no end within {budget} steps: running {[s.request_id for s in engine.running]}, "
                         f"waiting {[s.request_id for s in engine.waiting]}, aborts pending {list(engine._aborts)}")


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def preemptions(engine: SpecEngine) -> int:
    return sum(1 for e in engine.stats()["fallback_events"] if e["event"] == "preempted")


class RefusalLog:
    """The engine's ledger client, recording which requests a reserve refused target blocks (no plan)."""

    def __init__(self, inner: Any, target_namespace: str) -> None:
        self.inner = inner
        self.target_namespace = target_namespace
        self.refused: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reserve(self, items: Sequence[ReserveItem]) -> list[Any]:
        results = self.inner.reserve(items)
        self.refused.update(r.request_id for r in results
                            if isinstance(r, OutOfBlocks) and r.namespace == self.target_namespace)
        return results


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_pool_finishes_by_preemption_like_plain_decoding(overlap: bool) -> None:
    """20 blocks of 4 tokens per namespace for 6 requests of up to 46 tokens: requests wait, are refused
    and preempted; with or without overlap, every one finishes with the plain greedy output."""
    for seed in range(6):
        rng = random.Random(seed)
        engine = fake_engine(num_blocks=20, block_size=4, max_batch=4, overlap=overlap)
        prompts = {f"s{seed}r{i}": [rng.randrange(FAKE_VOCAB) for _ in range(rng.randint(6, 14))] for i in range(6)}
        max_tokens = {rid: rng.randint(20, 32) for rid in prompts}
        for rid, prompt in prompts.items():
            engine.submit(request(rid, prompt, max_tokens=max_tokens[rid], k=rng.choice([2, 3, None])))
        out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
        drive(engine, out)
        engine.close()
        for rid, prompt in prompts.items():
            assert out[rid][-1].finish_reason == "length", (seed, rid)
            assert tokens_of(out[rid]) == fake_greedy(prompt, max_tokens[rid]), (seed, rid)
        assert preemptions(engine) > 0, seed
        engine.reconcile_ledger()
        engine.kv.audit().assert_no_leaks()


def test_abort_under_overlap_while_out_of_blocks_completes() -> None:
    """A request refused its reservation is aborted: the abort applies once its group's drafting ended;
    the others still finish with the plain greedy output."""
    engine = fake_engine(num_blocks=20, block_size=4, max_batch=4, overlap=True)
    log = RefusalLog(engine.kv.inner, engine.config.target_namespace)
    engine.kv.inner = log  # below the held-commit wrapper; with overlap nothing is held: all reserves pass here
    prompts = {f"a{i}": [(5 * i + j) % FAKE_VOCAB for j in range(10)] for i in range(4)}
    for rid, prompt in prompts.items():
        engine.submit(request(rid, prompt, max_tokens=30, k=3))
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    for _ in range(STEP_BUDGET):
        if log.refused:
            break
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
    assert log.refused, "the pool never ran out"
    victim = min(log.refused)
    engine.abort(victim)
    drive(engine, out)
    engine.close()
    assert out[victim][-1].finish_reason == "abort"
    for rid, prompt in prompts.items():
        if rid != victim:
            assert tokens_of(out[rid]) == fake_greedy(prompt, 30), rid
    engine.reconcile_ledger()
    engine.kv.audit().assert_no_leaks()
