"""n completions of one prompt (cluster/engine/shared_prompts.py): one prefill, then forks of its KV.

Model-free engine (engine_helpers.fake_engine: a paged token pool, so a wrong block, a missing copy or a
stale slot shows up as a wrong token) for the ledger moves, aborts and lost workers; SmolLM2 for the
outputs of sampled completions against independent runs with the same seeds. Every test ends with no
leaked block and nothing in the ledger (check_ledger, audit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.engine import SpecEngine
from cluster.engine.prompt_group import group_key
from specserve_types.api import CapacityError, GenerationRequest, InvalidRequestError
from specserve_types.round_messages import VerifyBatch, VerifyResult
from tests.cluster.engine.engine_helpers import fake_engine, fake_greedy, local_engine, request

PROMPT = list(range(1, 12))  # 11 tokens: the shared prefix is 10, block_size 4 -> its last block is partial


class RecordingVerifier:
    """Passes every batch to the real verifier and keeps it (to see the copies the members ran)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batches: list[VerifyBatch] = []

    @property
    def instance(self) -> str:
        return self.inner.instance

    def verify(self, batch: VerifyBatch, on_sent: Any = None) -> VerifyResult:
        self.batches.append(batch)
        return self.inner.verify(batch, on_sent)


def ledger_of(engine: SpecEngine) -> Any:
    return engine.kv.inner.ledger


def checked_step(engine: SpecEngine, out: dict[str, list[int]], finish: dict[str, str]) -> None:
    for chunk in engine.step():
        out.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        if chunk.finished:
            finish[chunk.request_id] = chunk.finish_reason
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


def run_checked(engine: SpecEngine, out: dict[str, list[int]] | None = None,
                finish: dict[str, str] | None = None) -> tuple[dict[str, list[int]], dict[str, str]]:
    out = {} if out is None else out
    finish = {} if finish is None else finish
    while engine.has_unfinished():
        checked_step(engine, out, finish)
    assert all(not ledger_of(engine).requests[ns] for ns in engine.namespaces), "the ledger holds entries"
    return out, finish


def group(prefix: str, n: int, max_tokens: int = 9, prompt: list[int] = PROMPT) -> list[GenerationRequest]:
    return [request(f"{prefix}{i}", prompt, max_tokens=max_tokens, k=3, draft="model") for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_members_fork_the_prompt_blocks_and_copy_the_partial_one_on_write(overlap: bool) -> None:
    engine = fake_engine(num_blocks=64, block_size=4, max_batch=3, overlap=overlap)
    recorder = engine.verifier = RecordingVerifier(engine.verifier)
    engine.submit_group(group("g", 5))
    key, ledger = group_key("g0"), ledger_of(engine)
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    checked_step(engine, out, finish)  # the prefiller's prefill-only round: nothing emitted
    assert not any(out.values())
    (prefill,) = recorder.batches[0].items
    assert prefill.input_ids == PROMPT[:10] and prefill.draft_ids == []
    for namespace in (TARGET_NAMESPACE, DRAFT_NAMESPACE):  # the group's entry: the prefix, in both caches
        assert ledger.committed_len(namespace, key) == 10
        table = ledger.block_table(namespace, key)
        assert table == ledger.block_table(namespace, "g0") and len(table) == 3
    shared = ledger.block_table(TARGET_NAMESPACE, key)
    most_holders = 0
    while engine.has_unfinished():
        checked_step(engine, out, finish)
        if key in ledger.requests[TARGET_NAMESPACE]:
            pool = ledger.pools[TARGET_NAMESPACE]
            most_holders = max(most_holders, pool.blocks[shared[0]].ref_count)
    assert most_holders >= 3  # the key and at least two members hold the first prompt block at once
    copies = [pair for batch in recorder.batches for item in batch.items for pair in item.copy_blocks]
    assert [src for src, _ in copies].count(shared[-1]) >= 4  # each member copied the partial block it writes
    assert all(out[r.request_id] == fake_greedy(PROMPT, 9) for r in group("g", 5))
    assert set(finish.values()) == {"length"}
    assert all(not ledger.requests[ns] for ns in engine.namespaces)


def test_abort_of_members_waiting_running_and_of_the_prefiller() -> None:
    engine = fake_engine(num_blocks=64, block_size=4, max_batch=2)
    engine.submit_group(group("g", 6))
    key, ledger = group_key("g0"), ledger_of(engine)
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    checked_step(engine, out, finish)  # the prefiller prefilled; its group's entry holds the prefix
    assert key in ledger.request_ids(TARGET_NAMESPACE)
    checked_step(engine, out, finish)  # one member forked (the batch holds 2)
    engine.abort("g0")  # the prefiller, running, after its fork
    engine.abort("g4")  # a member still waiting, never forked
    run_checked(engine, out, finish)
    assert finish["g0"] == finish["g4"] == "abort"
    for rid in ("g1", "g2", "g3", "g5"):
        assert out[rid] == fake_greedy(PROMPT, 9) and finish[rid] == "length", rid
    assert key not in ledger.request_ids(TARGET_NAMESPACE)
    engine.submit(request(key, PROMPT, max_tokens=2, k=0))  # the group is over: its key is free again
    run_checked(engine)


def test_prefiller_aborted_before_its_prefill_hands_over_and_the_last_abort_frees_the_entry() -> None:
    engine = fake_engine(num_blocks=64, block_size=4, max_batch=1)
    engine.submit_group(group("a", 4))
    engine.abort("a0")  # waiting: a1 carries the group instead
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    checked_step(engine, out, finish)
    key, ledger = group_key("a0"), ledger_of(engine)
    assert finish == {"a0": "abort"} and ledger.committed_len(TARGET_NAMESPACE, key) == 10
    engine.abort("a2")
    engine.abort("a3")  # the last members waiting: nobody needs the entry any more
    checked_step(engine, out, finish)
    assert key not in ledger.request_ids(TARGET_NAMESPACE) and key not in ledger.request_ids(DRAFT_NAMESPACE)
    run_checked(engine, out, finish)
    assert out["a1"] == fake_greedy(PROMPT, 9) and finish["a2"] == finish["a3"] == "abort"


def test_lost_verifier_and_replaced_drafter_in_mid_group() -> None:
    engine = fake_engine(num_blocks=64, block_size=4, max_batch=2)
    engine.submit_group(group("v", 6))
    key, ledger = group_key("v0"), ledger_of(engine)
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(2):
        checked_step(engine, out, finish)
    engine.drafter.instance = "a new drafter process"  # its empty pool: every draft entry goes, the key's too
    checked_step(engine, out, finish)
    assert key in ledger.request_ids(TARGET_NAMESPACE) and key not in ledger.request_ids(DRAFT_NAMESPACE)
    engine.verifier.instance = "a new verifier process"  # the key's target entry goes with the old epoch
    checked_step(engine, out, finish)
    assert key not in ledger.request_ids(TARGET_NAMESPACE)
    run_checked(engine, out, finish)  # a waiting member carried the group's prompt again
    for i in range(6):
        assert out[f"v{i}"] == fake_greedy(PROMPT, 9) and finish[f"v{i}"] == "length"
    assert len([e for e in engine.fallback_events if e.get("event") == "verifier recovery"]) == 1


def test_a_cached_prefix_needs_no_prefill_round() -> None:
    """Prompt of 9, block_size 4: the prefix (8) is two full blocks; once a first group committed them, a second
    group's prefiller finds them cached and the group's entry is made at once, without a prefill round."""
    prompt = PROMPT[:9]
    engine = fake_engine(num_blocks=64, block_size=4, max_batch=2)
    recorder = engine.verifier = RecordingVerifier(engine.verifier)
    engine.submit_group(group("p", 3, prompt=prompt))
    run_checked(engine)
    seen = len(recorder.batches)
    engine.submit_group(group("q", 3, prompt=prompt))
    out, _ = run_checked(engine)
    items = [item for batch in recorder.batches[seen:] for item in batch.items]
    assert all(item.past_len >= 8 for item in items)  # nobody prefilled the prompt again
    assert all(out[f"q{i}"] == fake_greedy(prompt, 9) for i in range(3))


def test_a_group_is_submitted_whole_or_not_at_all() -> None:
    engine = fake_engine(num_blocks=64, block_size=4, max_batch=2)
    with pytest.raises(InvalidRequestError, match="share one prompt"):
        engine.submit_group([request("x0", PROMPT), request("x1", PROMPT[:-1])])
    with pytest.raises(CapacityError):
        engine.submit_group(group("c", 65))  # the queue holds 64
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.submit_group([request("d", PROMPT), request("d", PROMPT)])
    assert not engine.has_unfinished()
    engine.submit_group(group("g", 2))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.submit(request(group_key("g0"), PROMPT))  # the group's key is taken while it lives
    run_checked(engine)


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_smollm2_sampled_completions_equal_independent_runs(smollm2_dir: Path, draft: str) -> None:
    """Completions i = 0..4 with seeds 7 + i at temperature 1 (exact contract, k = 2): the group's tokens are
    those of the same requests submitted one by one; the prompt's prefix (7 tokens, block_size 4) ends in a
    partial block."""
    engine = local_engine(smollm2_dir, smollm2_dir if draft == "model" else "ngram", max_batch=3, block_size=4,
                          kv_blocks=256)
    prompt = engine.tokenizer("def fib(n):\n    if n")["input_ids"]
    assert len(prompt) % 4 != 1  # the shared prefix (the prompt but its last token) ends inside a block

    def completion(rid: str, i: int) -> GenerationRequest:
        return request(rid, prompt, max_tokens=8, k=2, draft=draft, contract="exact", temperature=1.0, seed=7 + i)

    engine.submit_group([completion(f"g{i}", i) for i in range(5)])
    grouped, _ = run_checked(engine)
    for i in range(5):
        engine.submit(completion(f"s{i}", i))
    alone, _ = run_checked(engine)
    assert [grouped[f"g{i}"] for i in range(5)] == [alone[f"s{i}"] for i in range(5)]
    assert len({tuple(grouped[f"g{i}"]) for i in range(5)}) > 1  # the seeds differ, and so do the samples
