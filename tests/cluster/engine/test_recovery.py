"""Worker faults in process: a verifier call that fails, a verifier replaced by a new process with an
empty KV pool, a drafter that dies. Output stays identical to plain greedy decoding; nothing leaks, and
the ledger holds nothing for a request that waits or ended."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from drafter_service.worker import DraftWorker
from specserve_types.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult
from tests.cluster.engine.engine_helpers import (
    fake_engine,
    fake_greedy,
    local_engine,
    plain_greedy,
    request,
    run,
)
from tests.model_runtime.random_checkpoint import make_random_checkpoint
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

    def verify(self, batch: VerifyBatch, on_sent: Any = None) -> VerifyResult:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("verifier replica unreachable")
        if self.calls == self.replace_at:
            self.worker = self._new_worker()
        return self.worker.verify(batch, on_sent)


class FailingVerifier:
    """The engine's own verifier, with call `fail_at` raising (the replica was unreachable)."""

    def __init__(self, inner: VerifierWorker, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def verify(self, batch: VerifyBatch, on_sent: Any = None) -> VerifyResult:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("verifier replica unreachable")
        return self.inner.verify(batch, on_sent)


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
    engine = local_engine(target, draft, tokenizer=None, max_batch=4, block_size=4, kv_blocks=256)
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
    engine = local_engine(target, draft, tokenizer=None, max_batch=4, block_size=4, kv_blocks=256,
                          drafter_retry_seconds=3600.0)
    engine.drafter = DyingDrafter(engine.drafter, die_at=3)
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


def test_abort_while_waiting_after_verifier_failure_leaves_nothing_in_the_ledger() -> None:
    """A verifier failure requeues the running requests; one is aborted before it is re-admitted. Its
    draft cache goes with it: the ledger holds nothing for it, and a new request with its id drafts."""
    engine = fake_engine(max_batch=4)
    engine.verifier = FailingVerifier(engine.verifier, fail_at=3)
    prompts = {"w0": [5, 6, 7, 8], "w1": [9, 10, 11], "w2": [12, 13]}
    for rid, prompt in prompts.items():
        engine.submit(request(rid, prompt, max_tokens=16, k=3))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.verifier.calls < 3:
        for chunk in engine.step():
            out[chunk.request_id] += chunk.token_ids
    assert [s.request_id for s in engine.waiting] == list(prompts)  # requeued, to be re-prefilled
    engine.abort("w1")
    chunks = engine.step()
    assert [c.finish_reason for c in chunks if c.request_id == "w1"] == ["abort"]
    engine.check_ledger()
    for chunk in chunks:
        out[chunk.request_id] += chunk.token_ids
    out["w1"] = []  # its successor starts over
    engine.submit(request("w1", prompts["w1"], max_tokens=16, k=3))  # the id is free again
    rest = engine.run_to_completion()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    for rid, prompt in prompts.items():
        assert out[rid] + [t for c in rest[rid] for t in c.token_ids] == fake_greedy(prompt, 16), rid
    reasons = [e["reason"] for e in rest["w1"][-1].stats["policy_events"]]
    assert "draft cache out of blocks" not in reasons, reasons  # its draft admission was not refused
    assert rest["w1"][-1].stats["acceptance"]["proposed"] > 0
