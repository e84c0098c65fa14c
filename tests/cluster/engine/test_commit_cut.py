"""A stop (EOS, stop string, max_tokens) inside a run of accepted drafts: the engine emits, commits to
the ledger and counts as accepted only what it kept, never the accepted drafts after the stop.

Model-free: the real engine, ledger and workers over the FakeRunners of engine_helpers, whose target and
drafter both follow one fixed script (`scripted`), so every draft is accepted and the stop lands exactly
where the test puts it. Every test ends with the ledger empty and no leaked block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.engine import SpecEngine
from cluster.engine.kv_client import LocalKV
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
from drafter_service.worker import DraftWorker
from kv_manager.ledger import BlockLedger
from kv_manager.schema import CommitItem, NamespaceConfig
from specserve_types.api import TokenChunk
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, FakeRunner, engine_config, request
from verifier_service.worker import VerifierWorker

EOS = 2
STOP_TOKEN = 30  # decodes to "!"
PROMPT = [5, 6, 7]
BLOCK_SIZE = 4


def scripted(sequence: list[int]) -> Callable[[list[int]], int]:
    """A greedy fake model that continues `sequence` (prompt + the script) token by token."""
    return lambda seen: sequence[len(seen)]


class CharTokenizer:
    """Token i decodes to "<i>", except STOP_TOKEN, which decodes to "!"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("!" if i == STOP_TOKEN else f"<{i}>" for i in ids)


class RecordingKV:
    """The LocalKV client, with every commit item that reaches the ledger and its outcome recorded."""

    def __init__(self, inner: LocalKV) -> None:
        self.inner = inner
        self.commits: list[tuple[CommitItem, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit(self, items: list[CommitItem]) -> list[Any]:
        results = self.inner.commit(items)
        self.commits += zip(items, results, strict=True)
        return results

    def commit_then_reserve(self, commits: list[CommitItem], reserves: list[Any]) -> tuple[list[Any], list[Any]]:
        committed, reserved = self.inner.commit_then_reserve(commits, reserves)
        self.commits += zip(commits, committed, strict=True)
        return committed, reserved

    def commit_then_reserve_ahead(self, commits: list[CommitItem], reserves: list[Any]) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(self.commit_then_reserve(commits, reserves))
        return done

    def of(self, namespace: str, rid: str) -> list[tuple[CommitItem, Any]]:
        return [(item, res) for item, res in self.commits if item.namespace == namespace and item.request_id == rid]


def scripted_engine(script: list[int], tokenizer: Any = None, engine_class: type[SpecEngine] = SpecEngine
                    ) -> tuple[SpecEngine, RecordingKV]:
    config = engine_config(max_batch=2, queue_capacity=8, max_context=256, max_verifier_failures=0)
    ledger = BlockLedger([NamespaceConfig(TARGET_NAMESPACE, 64, BLOCK_SIZE),
                          NamespaceConfig(DRAFT_NAMESPACE, 64, BLOCK_SIZE)])
    rule = scripted(PROMPT + script)
    engine = engine_class(VerifierWorker(FakeRunner(rule, BLOCK_SIZE)), DraftWorker(FakeRunner(rule, BLOCK_SIZE)),
                          LocalKV(ledger), tokenizer, (EOS,), FAKE_VOCAB, config)
    recorder = RecordingKV(engine.kv.inner)
    engine.kv.inner = recorder  # below the held-commit wrapper: what reaches the ledger
    return engine, recorder


def run_request(engine: SpecEngine, **kwargs: Any) -> tuple[list[TokenChunk], RequestState]:
    engine.submit(request("r", PROMPT, draft="model", **kwargs))
    state = engine.inbox._states[-1]  # the request's state, to read its caches after it has left the engine
    chunks = [c for cs in engine.run_to_completion().values() for c in cs]
    return chunks, state


def check_commits_and_acceptance(engine: SpecEngine, kv: RecordingKV, chunks: list[TokenChunk],
                                 state: RequestState, output: list[int], draft_short: int = 0) -> None:
    """Ledger: the target's commits of "r", in order, hold exactly prompt + output (the final commit ends
    there); the draft's the same less `draft_short` (a last draft's KV is never written), nothing past
    the kept tokens; the caches agree with the ledger; acceptance counts only kept drafts."""
    full = PROMPT + output
    expected = {TARGET_NAMESPACE: full, DRAFT_NAMESPACE: full[:len(full) - draft_short]}
    for namespace, tokens in expected.items():
        commits = kv.of(namespace, "r")
        assert commits[-1][0].finished
        assert commits[-1][1].committed_len == len(tokens), namespace  # prompt + kept tokens
        assert [t for item, _ in commits for t in item.token_ids] == tokens, namespace
        assert "r" not in engine.kv.inner.ledger.requests[namespace]
    assert (state.target_cached, state.draft_cached) == (len(full), len(full) - draft_short)
    # every round here proposes perfect drafts; a cut round counts only the drafts up to the stop
    kept_drafts = len(output) - (len(chunks) - 1)  # each uncut round emits one token that is not a draft
    stats = chunks[-1].stats["acceptance"]
    assert (stats["accepted"], stats["proposed"], stats["rejections"]) == (kept_drafts, kept_drafts, 0)
    assert (engine.acceptance.accepted, engine.acceptance.proposed) == (kept_drafts, kept_drafts)
    assert sum(c.accepted for c in chunks) == sum(c.proposed for c in chunks) == kept_drafts
    engine.kv.audit().assert_no_leaks()


@pytest.mark.parametrize("at", [0, 1, 3])
def test_eos_inside_accepted_drafts_commits_and_counts_only_kept_tokens(at: int) -> None:
    """Round 1 accepts 4 drafts + bonus (5 tokens); round 2's 4 drafts, all accepted, hold EOS at `at`."""
    script = [10, 11, 12, 13, 14] + [15, 16, 17, 18, 19, 20]
    script[5 + at] = EOS
    engine, kv = scripted_engine(script)
    chunks, state = run_request(engine, max_tokens=20, k=4)
    output = [t for c in chunks for t in c.token_ids]
    assert output == script[:5 + at + 1]
    assert chunks[-1].finish_reason == "eos"
    assert len(chunks) == 2
    check_commits_and_acceptance(engine, kv, chunks, state, output, draft_short=1 if at == 3 else 0)


def test_stop_string_inside_accepted_drafts_commits_and_counts_only_kept_tokens() -> None:
    script = [10, 11, 12, 13, 14, 15, STOP_TOKEN, 16, 17, 18, 19]
    engine, kv = scripted_engine(script, tokenizer=CharTokenizer())
    chunks, state = run_request(engine, max_tokens=20, k=4, stop=("!",))
    output = [t for c in chunks for t in c.token_ids]
    assert output == script[:7]
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text_delta for c in chunks) == "<10><11><12><13><14><15>"
    check_commits_and_acceptance(engine, kv, chunks, state, output)


class OverreachingEngine(SpecEngine):
    """Speculates k drafts even past the max_tokens budget. The engine's own planner caps k at
    remaining - 1, so there the max_tokens cut falls on the bonus token at the latest; this planner
    puts it inside the accepted drafts."""

    def plan(self, states: list[RequestState], model_trees: bool, kept: Mapping[str, RoundPlan] | None = None,
             void: Sequence[tuple[str, str]] = ()) -> list[RoundPlan]:
        return [dataclasses.replace(plan, k=plan.state.request.spec.k) if plan.uses_model_drafter else plan
                for plan in super().plan(states, model_trees, kept, void)]


def test_max_tokens_inside_accepted_drafts_finishes_length_and_commits_only_kept_tokens() -> None:
    script = [10, 11, 12, 13, 14, 15, 16]
    engine, kv = scripted_engine(script, engine_class=OverreachingEngine)
    chunks, state = run_request(engine, max_tokens=3, k=4, ignore_eos=True)
    output = [t for c in chunks for t in c.token_ids]
    assert output == script[:3]
    assert chunks[-1].finish_reason == "length"
    assert len(chunks) == 1
    check_commits_and_acceptance(engine, kv, chunks, state, output)
