"""Deferred commit: a steady round costs one ledger call, made beside its verify (the last round's commit
and the next round's reservation window: held_commit.py); nothing reaches the ledger before the verify. A round
that finishes a request, an abort or an admission sends a held commit first. A refused draft commit (held or not) restarts that request's draft cache. Every test ends
with the ledger audit showing zero leaked blocks."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from kv_manager.errors import StaleEpoch
from tests.cluster.engine.engine_helpers import local_engine, plain_greedy, request
from tests.model_runtime.random_checkpoint import make_random_checkpoint

LEDGER_CALLS = {"reserve", "commit", "commit_then_reserve", "commit_then_reserve_ahead", "admit", "can_admit", "release", "rollback",
                "register_worker", "expire_worker"}


class CountingKV:
    """The engine's KV client with every ledger call recorded by name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in LEDGER_CALLS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)
        return counted


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("deferral")
    return (make_random_checkpoint(root / "t", seed=31, vocab_size=64),
            make_random_checkpoint(root / "d", seed=32, vocab_size=64, num_layers=1))


def engine_for(pair: tuple[Path, Path]) -> Any:
    target, draft = pair
    engine = local_engine(target, draft, tokenizer=None, max_batch=4, block_size=4, kv_blocks=256)
    engine.kv.inner = CountingKV(engine.kv.inner)  # below the held-commit wrapper: what reaches the ledger
    return engine


def live_ids(engine: Any, namespace: str) -> set[str]:
    return set(engine.kv.inner.ledger.requests.get(namespace, {}))


def test_steady_rounds_make_one_ledger_call_and_finishing_rounds_commit_at_once(pair) -> None:
    target, _ = pair
    engine = engine_for(pair)
    engine.submit(request("short", [3, 4, 5], max_tokens=5, k=2, ignore_eos=True))
    engine.submit(request("long", [7, 8, 9, 10], max_tokens=16, k=2, ignore_eos=True))
    out: dict[str, list[int]] = {"short": [], "long": []}
    steady = 0
    while engine.has_unfinished():
        engine.kv.inner.calls.clear()
        chunks = engine.step()
        for c in chunks:
            out[c.request_id] += c.token_ids
        finished = {c.request_id for c in chunks if c.finished}
        if finished:  # the finishing round sent its commit before returning: the ledger let go
            assert engine.kv.inner.calls[-1] == "commit", engine.kv.inner.calls
            for namespace in (TARGET_NAMESPACE, DRAFT_NAMESPACE):
                assert not finished & live_ids(engine, namespace)
        elif engine.kv.inner.calls == ["commit_then_reserve_ahead"]:  # granted from its window: no call before
            steady += 1
    assert steady >= 3  # most rounds of "long" after "short" finished
    assert out["short"] == plain_greedy(target, [3, 4, 5], 5)
    assert out["long"] == plain_greedy(target, [7, 8, 9, 10], 16)
    engine.kv.audit().assert_no_leaks()


def test_an_abort_sends_the_held_commit_first(pair) -> None:
    engine = engine_for(pair)
    engine.submit(request("a", [3, 4, 5], max_tokens=30, k=2, ignore_eos=True))
    engine.submit(request("b", [6, 7], max_tokens=30, k=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.held, "the last round's commit is held"
    engine.kv.inner.calls.clear()
    engine.abort("a")
    chunks = engine.step()
    assert [c.finish_reason for c in chunks if c.request_id == "a"] == ["abort"]
    assert engine.kv.inner.calls[:2] == ["commit", "release"], engine.kv.inner.calls
    assert "a" not in live_ids(engine, TARGET_NAMESPACE)
    engine.run_to_completion()
    assert not engine.kv.held
    engine.kv.audit().assert_no_leaks()


class RefusingKV(CountingKV):
    """Refuses one draft-namespace commit item (as a ledger would refuse a stale holder's), once."""

    def __init__(self, inner: Any, draft_namespace: str, after_calls: int) -> None:
        super().__init__(inner)
        self.draft_namespace = draft_namespace
        self.after_calls = after_calls
        self.refused: list[str] = []

    def _refuse(self, commits: list[Any]) -> tuple[list[Any], int | None]:
        if self.refused or len(self.calls) < self.after_calls:
            return commits, None
        for i, item in enumerate(commits):
            if item.namespace == self.draft_namespace:
                self.refused.append(item.request_id)
                return commits[:i] + commits[i + 1:], i
        return commits, None

    def commit(self, commits: list[Any]) -> list[Any]:
        self.calls.append("commit")
        kept, at = self._refuse(commits)
        results = self.inner.commit(kept)
        return results if at is None else results[:at] + [StaleEpoch("refused", namespace=self.draft_namespace)] + results[at:]

    def commit_then_reserve(self, commits: list[Any], reserves: list[Any]) -> tuple[list[Any], list[Any]]:
        self.calls.append("commit_then_reserve")
        kept, at = self._refuse(commits)
        committed, reserved = self.inner.commit_then_reserve(kept, reserves)
        if at is not None:
            committed = committed[:at] + [StaleEpoch("refused", namespace=self.draft_namespace)] + committed[at:]
        return committed, reserved


    def commit_then_reserve_ahead(self, commits: list[Any], reserves: list[Any]) -> Future[Any]:
        self.calls.append("commit_then_reserve_ahead")
        kept, at = self._refuse(commits)
        done: Future[Any] = Future()
        committed, reserved = self.inner.commit_then_reserve(kept, reserves)
        if at is not None:
            committed = committed[:at] + [StaleEpoch("refused", namespace=self.draft_namespace)] + committed[at:]
        done.set_result((committed, reserved))
        return done


def test_a_refused_draft_commit_restarts_that_draft_cache_and_output_stays_exact(pair) -> None:
    target, _ = pair
    engine = engine_for(pair)
    engine.kv.inner = RefusingKV(engine.kv.inner.inner, DRAFT_NAMESPACE, after_calls=6)
    engine.submit(request("r", [3, 4, 5, 6], max_tokens=20, k=2, ignore_eos=True))
    out = [t for c in engine.run_to_completion()["r"] for t in c.token_ids]
    assert engine.kv.inner.refused == ["r"]
    assert engine.kv.inner.calls.count("admit") >= 3  # target once, draft once, draft again after the refusal
    assert out == plain_greedy(target, [3, 4, 5, 6], 20)
    engine.kv.audit().assert_no_leaks()
