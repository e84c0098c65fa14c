"""Overlap (two groups in ping-pong) with the KV pool exhausted: a request refused a reservation must
neither stay "in flight" nor block preemption or an abort. Model-free engine (engine_helpers.fake_engine);
every test ends with the ledger checked (empty) and no leaked block."""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from cluster.engine.config import TARGET_NAMESPACE
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
                         f"waiting {[s.request_id for s in engine.waiting]}, aborts pending {list(engine.inbox._aborts)}")


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
        engine.check_ledger()
        engine.kv.audit().assert_no_leaks()


def test_abort_under_overlap_while_out_of_blocks_completes() -> None:
    """A request refused its reservation is aborted: the abort applies once its group's drafting ended;
    the others still finish with the plain greedy output."""
    engine = fake_engine(num_blocks=20, block_size=4, max_batch=4, overlap=True)
    log = RefusalLog(engine.kv.inner, TARGET_NAMESPACE)
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
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


class Faults:
    """Worker wrappers that fail chosen calls, and record the threads the drafter is called from."""

    def __init__(self, verifier: Any, drafter: Any, verifier_fail_at: set[int], drafter_fail_at: set[int]) -> None:
        self.verifier, self.drafter = verifier, drafter
        self.verifier_fail_at, self.drafter_fail_at = verifier_fail_at, drafter_fail_at
        self.verify_calls = self.propose_calls = 0
        self.drafter_threads: set[str] = set()

    def verify(self, batch: Any, on_sent: Any = None) -> Any:
        self.verify_calls += 1
        if self.verify_calls in self.verifier_fail_at:
            raise ConnectionError("verifier replica unreachable")
        return self.verifier.verify(batch, on_sent)

    def propose(self, batch: Any) -> Any:
        self.propose_calls += 1
        self.drafter_threads.add(threading.current_thread().name)
        if self.propose_calls in self.drafter_fail_at:
            raise ConnectionError("drafter replica unreachable")
        return self.drafter.propose(batch)


@pytest.mark.parametrize("seed", range(4))
def test_worker_failures_under_overlap_lose_nothing(seed: int) -> None:
    """Verifier failures while the other group's drafts are in flight, and drafter failures landing on the
    engine thread: every request still ends with the plain greedy output, the ledger checks empty.
    (Before the groups in flight were drained on a verifier failure, their target commit raised
    UnknownRequest: the verifier's expired epoch had dropped their entries.)"""
    rng = random.Random(seed)
    engine = fake_engine(num_blocks=256, block_size=4, max_batch=4, overlap=True)
    faults = Faults(engine.verifier, engine.drafter, verifier_fail_at={rng.randint(3, 8), rng.randint(10, 20)},
                    drafter_fail_at={rng.randint(2, 12)})
    engine.verifier = faults
    assert engine.pipeline is not None
    engine.pipeline._propose = faults.propose  # the draft thread's only call
    engine.health._retry_seconds = 0.0  # retry the drafter at once
    prompts = {f"f{seed}r{i}": [rng.randrange(FAKE_VOCAB) for _ in range(rng.randint(5, 12))] for i in range(6)}
    for rid, prompt in prompts.items():
        engine.submit(request(rid, prompt, max_tokens=24, k=rng.choice([2, 3, None])))
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    drive(engine, out)
    engine.close()
    for rid, prompt in prompts.items():
        assert tokens_of(out[rid]) == fake_greedy(prompt, 24), rid
    events = [e["event"] for e in engine.stats()["fallback_events"]]
    assert events.count("verifier recovery") == 2 and "drafter unavailable" in events, events
    assert faults.drafter_threads == {"specserve-draft_0"}, faults.drafter_threads
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
