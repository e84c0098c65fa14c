"""Worker faults in process: a verifier call that fails, a verifier replaced by a new process with an
empty KV pool, a drafter that dies. Output stays identical to plain greedy decoding; nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.engine_factory import EngineOptions, build_local_engine
from cluster.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult
from drafter_service.worker import DraftWorker
from model_runtime.testing import make_random_checkpoint
from tests.cluster.engine_helpers import plain_greedy, request, run
from verifier_service.worker import LocalRunner, VerifierWorker


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("recovery")
    return (make_random_checkpoint(root / "t", seed=31, vocab_size=64),
            make_random_checkpoint(root / "d", seed=32, vocab_size=64, num_layers=1))


class FaultyVerifier:
    """Fails call `fail_at`; at call `replace_at` swaps in a brand-new worker (fresh, empty KV pool)."""

    def __init__(self, checkpoint: Path, fail_at: int, replace_at: int) -> None:
        self.checkpoint, self.fail_at, self.replace_at = checkpoint, fail_at, replace_at
        self.calls = 0
        self.worker = self._new_worker()

    def _new_worker(self) -> VerifierWorker:
        return VerifierWorker(LocalRunner(str(self.checkpoint), 256, 4))

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("verifier replica unreachable")
        if self.calls == self.replace_at:
            self.worker = self._new_worker()
        return self.worker.verify(batch)


class DyingDrafter:
    def __init__(self, worker: DraftWorker, die_at: int) -> None:
        self.worker, self.die_at, self.calls = worker, die_at, 0

    def propose(self, batch: ProposeBatch) -> ProposeResult:
        self.calls += 1
        if self.calls >= self.die_at:
            raise ConnectionError("drafter replica died")
        return self.worker.propose(batch)


def test_verifier_failure_and_replacement_recover_by_reprefill(pair) -> None:
    target, draft = pair
    engine = build_local_engine(str(target), str(draft), EngineOptions(max_batch=4, block_size=4, num_blocks=256),
                                tokenizer=None)
    engine.verifier = FaultyVerifier(target, fail_at=3, replace_at=6)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    got = run(engine, [request(f"v{i}", p, max_tokens=20, k=2, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"v{i}"] == plain_greedy(target, p, 20)
    events = [e["event"] for e in engine.stats()["fallback_events"]]
    assert events.count("verifier recovery") == 2
    engine.kv.audit().assert_no_leaks()


def test_drafter_death_falls_back_to_plain_decoding(pair) -> None:
    target, draft = pair
    engine = build_local_engine(str(target), str(draft), EngineOptions(max_batch=4, block_size=4, num_blocks=256),
                                tokenizer=None)
    engine.drafter = DyingDrafter(engine.drafter, die_at=3)
    engine.config.drafter_retry_seconds = 3600.0
    prompts = [[5, 6, 7, 8], [9, 10]]
    reqs = [request(f"d{i}", p, max_tokens=20, k=3, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    chunks = engine.run_to_completion()
    for i, p in enumerate(prompts):
        assert [t for c in chunks[f"d{i}"] for t in c.token_ids] == plain_greedy(target, p, 20)
        reasons = [e["reason"] for e in chunks[f"d{i}"][-1].stats["policy_events"]]
        assert any("drafter" in r for r in reasons)
    assert any(e["event"] == "drafter unavailable" for e in engine.stats()["fallback_events"])
    engine.kv.audit().assert_no_leaks()
