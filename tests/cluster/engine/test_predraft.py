"""Pre-drafting (cluster/engine/predraft.py): round r + 1's drafts made during round r's verify.

Model-free engines (engine_helpers.fake_engine) with drafters of chosen accuracy: a draft KV slot written in
the wrong place shows as a wrong draft (a perfect drafter then loses acceptance), a wrong token as a wrong
output. Every test ends with the ledger checked and no leaked block; the ledger's own reservation
lengths show that a dropped pre-draft's slots went back and a kept one's are held into its round.
"""

from __future__ import annotations

import collections
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.engine.config import DRAFT_NAMESPACE
from cluster.engine.engine import SpecEngine
from kv_manager.ledger import BlockLedger
from specserve_types.api import TokenChunk
from tests.cluster.engine.engine_helpers import (
    FAKE_VOCAB,
    fake_draft_token,
    fake_engine,
    fake_greedy,
    fake_next_token,
    load_target,
    local_engine,
    plain_greedy,
    request,
    run,
)
from tests.cluster.engine.test_overlap import drive, preemptions, tokens_of
from tests.model_runtime.random_checkpoint import make_random_checkpoint
from tests.verifier_service.test_contracts import chi_square_pvalue

PROMPT = [5, 17, 40, 2, 33, 8]  # 6 tokens: round 1 drafts positions 6..8, its bonus token sits at 9


def off_every(n: int):  # noqa: ANN201 - a drafter rule
    """A drafter that agrees with the target except at sequence lengths divisible by n."""
    def rule(sequence: list[int]) -> int:
        token = fake_next_token(sequence)
        return (token + 1) % FAKE_VOCAB if len(sequence) % n == 0 else token
    return rule


def off_at(length: int):  # noqa: ANN201 - a drafter rule
    """A drafter that agrees with the target except after exactly `length` tokens."""
    def rule(sequence: list[int]) -> int:
        token = fake_next_token(sequence)
        return (token + 1) % FAKE_VOCAB if len(sequence) == length else token
    return rule


def ledger(engine: SpecEngine) -> BlockLedger:
    engine.kv.send_held()  # a steady round's commit may wait for the next reserve
    return engine.kv.inner.ledger


def reserved_blocks(engine: SpecEngine) -> int:
    return engine.kv.audit().counts[DRAFT_NAMESPACE].reserved


def finish(engine: SpecEngine, out: dict[str, list[TokenChunk]]) -> None:
    drive(engine, out)
    engine.close()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    assert reserved_blocks(engine) == 0


@pytest.mark.parametrize("drafter", ["perfect", "off_every_7", "off_every_3"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_equals_plain_decoding(drafter: str, seed: int) -> None:
    """Batched requests of mixed k (fixed and auto) and lengths: the plain greedy output, whatever the pre-drafts'
    fate; a perfect drafter keeps every draft (its pre-drafted KV sits in the right slots) and saves calls."""
    rule = {"perfect": fake_next_token, "off_every_7": off_every(7), "off_every_3": fake_draft_token}[drafter]
    rng = random.Random(seed)
    engine = fake_engine(max_batch=4, overlap=True, predraft=True, draft_rule=rule)
    prompts = {f"g{seed}r{i}": [rng.randrange(FAKE_VOCAB) for _ in range(rng.randint(3, 12))] for i in range(6)}
    max_tokens = {rid: rng.randint(5, 40) for rid in prompts}
    for rid, prompt in prompts.items():
        engine.submit(request(rid, prompt, max_tokens=max_tokens[rid], k=rng.choice([1, 2, 3, 4, None])))
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    finish(engine, out)
    for rid, prompt in prompts.items():
        assert tokens_of(out[rid]) == fake_greedy(prompt, max_tokens[rid]), rid
    stats = engine.stats()
    counts = stats["overlap"]["predraft"]
    assert stats["overlap"]["mode"] == "predraft" and counts["made"] > 0
    assert counts["made"] == sum(counts[r] for r in ("kept", "rejected", "guess_missed", "finished", "lost"))
    assert counts["rounds"] == counts["kept"]  # every kept pre-draft was verified in its round
    if drafter == "perfect":
        assert stats["acceptance"]["accepted"] == stats["acceptance"]["proposed"] > 0
        assert counts["kept"] > 0 and counts["rejected"] == counts["guess_missed"] == 0
    if drafter == "off_every_3":
        assert counts["rejected"] > 0


def test_a_kept_predraft_holds_its_reservation_into_its_round() -> None:
    """k = 3, perfect drafter. Round 1 reserves the prompt + 2 drafts + the pre-draft's d_3 + 3 slots; all is
    accepted and the guess is right: nothing of it is committed yet. Round 2 proposes nothing and commits
    both rounds' draft KV; round 3 is fresh again (pre-drafts are one round deep)."""
    engine = fake_engine(overlap=True, predraft=True, draft_rule=fake_next_token)
    engine.submit(request("a", PROMPT, max_tokens=30, k=3))
    calls = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda batch: calls.append(threading.current_thread().name) or propose(batch)
    engine.predrafter.pipeline._propose = engine.drafter.propose
    first = engine.step()
    assert tokens_of(first) == fake_greedy(PROMPT, 4)
    book = ledger(engine)
    assert book.committed_len(DRAFT_NAMESPACE, "a") == 0  # deferred to the pre-drafted round
    assert book.reserved_len(DRAFT_NAMESPACE, "a") == len(PROMPT) + 2 + 1 + 3
    assert engine.predrafter is not None and set(engine.predrafter.kept) == {"a"}
    assert len(calls) == 2 and calls[1].startswith("specserve-draft")  # the round's own, then the pre-draft
    second = engine.step()
    assert tokens_of(first + second) == fake_greedy(PROMPT, 8)
    assert len(calls) == 2  # round 2 drafted nothing: its drafts were made during round 1's verify
    book = ledger(engine)
    assert book.reserved_len(DRAFT_NAMESPACE, "a") == 0
    assert book.committed_len(DRAFT_NAMESPACE, "a") == len(PROMPT) + 4 + 2  # both rounds (round 2's last draft: no KV)
    engine.step()
    assert len(calls) == 4  # fresh: its own propose and a pre-draft
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    finish(engine, out)
    assert engine.stats()["overlap"]["predraft"]["drafter_calls_saved"] >= 1


@pytest.mark.parametrize(("rule", "why"), [
    (off_at(len(PROMPT) + 1), "rejected"),  # the second draft is wrong
    (off_at(len(PROMPT) + 3), "guess_missed"),  # all three drafts right, the guess of the bonus token wrong
])
def test_a_dropped_predraft_gives_its_slots_back_in_the_round_commit(rule: Any, why: str) -> None:
    engine = fake_engine(overlap=True, predraft=True, draft_rule=rule)
    engine.submit(request("b", PROMPT, max_tokens=30, k=3))
    engine.step()
    book = ledger(engine)
    assert book.reserved_len(DRAFT_NAMESPACE, "b") == 0  # the pre-draft's slots went back with the rejected tail
    accepted = 1 if why == "rejected" else 3
    assert book.committed_len(DRAFT_NAMESPACE, "b") == len(PROMPT) + min(accepted, 2)
    assert reserved_blocks(engine) == 0
    counts = engine.stats()["overlap"]["predraft"]
    assert counts[why] == 1 and counts["kept"] == 0
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    finish(engine, out)
    assert tokens_of(out["b"]) == fake_greedy(PROMPT, 30)[4 if why == "guess_missed" else 2:]


def test_abort_while_a_predraft_is_made_and_while_one_is_kept() -> None:
    """An abort arriving while the draft thread pre-drafts applies at the next step, when the request holds a
    kept pre-draft's reservation: everything is released; the other request finishes as plain decoding."""
    engine = fake_engine(overlap=True, predraft=True, draft_rule=fake_next_token)
    for rid in ("x", "y"):
        engine.submit(request(rid, PROMPT if rid == "x" else PROMPT[::-1], max_tokens=30, k=2))
    propose = engine.predrafter.pipeline._propose

    def abort_on_the_draft_thread(batch: Any) -> Any:
        if threading.current_thread().name.startswith("specserve-draft"):
            engine.abort("x")  # from another thread, in the middle of the step
        return propose(batch)

    engine.predrafter.pipeline._propose = abort_on_the_draft_thread
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    for chunk in engine.step():
        out[chunk.request_id].append(chunk)
    assert engine.predrafter is not None and set(engine.predrafter.kept) == {"x", "y"}
    assert ledger(engine).reserved_len(DRAFT_NAMESPACE, "x") > 0  # the kept pre-draft's reservation
    engine.predrafter.pipeline._propose = propose
    for chunk in engine.step():
        out[chunk.request_id].append(chunk)
    assert out["x"][-1].finish_reason == "abort"
    assert "x" not in ledger(engine).request_ids(DRAFT_NAMESPACE)
    finish(engine, out)
    assert tokens_of(out["y"]) == fake_greedy(PROMPT[::-1], 30)


def test_drafter_failure_during_a_predraft_loses_nothing() -> None:
    """The pre-draft call fails on the draft thread: the drafter's epoch expires (the round's draft grants with
    it), the round's verified tokens stand, plain decoding until the retry, and the output is plain greedy."""
    engine = fake_engine(overlap=True, predraft=True, draft_rule=fake_next_token)
    engine.health._retry_seconds = 0.0
    prompts = {f"f{i}": [(3 * i + j) % FAKE_VOCAB for j in range(7)] for i in range(3)}
    for rid, prompt in prompts.items():
        engine.submit(request(rid, prompt, max_tokens=25, k=3))
    propose, failed = engine.predrafter.pipeline._propose, []

    def fail_once_on_the_draft_thread(batch: Any) -> Any:
        if threading.current_thread().name.startswith("specserve-draft") and not failed:
            failed.append(True)
            raise ConnectionError("drafter replica unreachable")
        return propose(batch)

    engine.predrafter.pipeline._propose = fail_once_on_the_draft_thread
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    finish(engine, out)
    for rid, prompt in prompts.items():
        assert tokens_of(out[rid]) == fake_greedy(prompt, 25), rid
    stats = engine.stats()
    assert failed and "drafter unavailable" in [e["event"] for e in stats["fallback_events"]]
    assert stats["overlap"]["predraft"]["lost"] >= 1 and stats["overlap"]["predraft"]["kept"] > 0


def test_tiny_pool_with_predrafts_finishes_by_preemption() -> None:
    """A pool too small for every request: reservations that include a pre-draft are refused or preempted;
    every request still ends with the plain greedy output."""
    for seed in range(4):
        rng = random.Random(seed)
        engine = fake_engine(num_blocks=20, block_size=4, max_batch=4, overlap=True, predraft=True,
                             draft_rule=off_every(5))
        prompts = {f"t{seed}r{i}": [rng.randrange(FAKE_VOCAB) for _ in range(rng.randint(6, 14))] for i in range(6)}
        max_tokens = {rid: rng.randint(20, 32) for rid in prompts}
        for rid, prompt in prompts.items():
            engine.submit(request(rid, prompt, max_tokens=max_tokens[rid], k=rng.choice([2, 3, None])))
        out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
        finish(engine, out)
        for rid, prompt in prompts.items():
            assert tokens_of(out[rid]) == fake_greedy(prompt, max_tokens[rid]), (seed, rid)
        assert preemptions(engine) > 0, seed


def test_predraft_needs_overlap() -> None:
    """`predraft: true` without overlap runs no draft thread: plain rounds, and the stats say why."""
    engine = fake_engine(overlap=False, predraft=True, draft_rule=fake_next_token)
    engine.submit(request("p", PROMPT, max_tokens=12, k=3))
    out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
    finish(engine, out)
    assert tokens_of(out["p"]) == fake_greedy(PROMPT, 12)
    overlap = engine.stats()["overlap"]
    assert engine.predrafter is None and overlap["enabled"] is False and overlap["predraft"].startswith("off")


# ---------------------------------------------------------------------- real models
def test_greedy_smollm2_with_predrafts_equals_plain_decoding(smollm2_dir: Path) -> None:
    """SmolLM2 drafting for itself in its own (lower) draft precision: drafts mostly right, sometimes not."""
    engine = local_engine(smollm2_dir, smollm2_dir, tokenizer=None, max_batch=2, max_context=256, block_size=16,
                          overlap=True, predraft=True)
    prompts = {"s0": [1, 504, 3458, 282, 4786, 314, 260], "s1": [1, 22, 2428, 33]}
    got = run(engine, [request(rid, p, max_tokens=24, k=3, ignore_eos=True) for rid, p in prompts.items()])
    engine.close()
    for rid, prompt in prompts.items():
        assert got[rid] == plain_greedy(smollm2_dir, prompt, 24), rid
    counts = engine.stats()["overlap"]["predraft"]
    assert counts["made"] > 0 and counts["kept"] > 0, counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kwargs = dict(vocab_size=6, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                  init_std=0.5)
    return make_random_checkpoint(tmp_path_factory.mktemp("predraft") / "t", seed=5, **kwargs)


def test_greedy_tiny_pair_with_predrafts_equals_plain_decoding(tmp_path: Path) -> None:
    target = make_random_checkpoint(tmp_path / "target", arch="qwen2", seed=1, vocab_size=64)
    draft = make_random_checkpoint(tmp_path / "draft", arch="qwen2", seed=2, vocab_size=64, num_layers=1)
    engine = local_engine(target, draft, tokenizer=None, max_batch=4, block_size=4, kv_blocks=256,
                          overlap=True, predraft=True)
    prompts = [[3, 4, 5, 3, 4, 5, 3], [10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28], [7]]
    got = run(engine, [request(f"r{i}", p, max_tokens=20 + i, k=1 + i % 3, ignore_eos=True)
                       for i, p in enumerate(prompts)])
    engine.close()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == plain_greedy(target, p, 20 + i), f"request r{i}"


# ---------------------------------------------------------------------- the exact contract
EXACT_PROMPT = [3, 1, 4, 1, 5]
EXACT_SAMPLES = 6000


def second_and_third(checkpoint: Path) -> torch.Tensor:
    """p(x2, x3) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) over the 6-token vocabulary, flat (36 cells)."""
    model = load_target(checkpoint)
    kv = model.allocate_kv(16, 4)

    def next_probs(prefix: list[int]) -> torch.Tensor:
        from model_runtime.local_alloc import LocalAllocator, LocalSequence

        (logits,) = model.forward_seqs([LocalAllocator(16, 4).extend(LocalSequence(), prefix, logits="last")], kv)
        return logits[-1].double().softmax(-1)

    out = torch.zeros(6, 6, dtype=torch.float64)
    p1 = next_probs(EXACT_PROMPT)
    for x1 in range(6):
        p2 = next_probs([*EXACT_PROMPT, x1])
        for x2 in range(6):
            out[x2] += p1[x1] * p2[x2] * next_probs([*EXACT_PROMPT, x1, x2])
    return out.flatten()


def sample_second_and_third(checkpoint: Path, samples: int = EXACT_SAMPLES) -> tuple[torch.Tensor, dict[str, int]]:
    """k = 1, 4 tokens: round 1 drafts x1 and pre-drafts (guess of x2, draft of x3); when x1 is accepted and
    the guess is right, x3 is verified from the pre-drafted draft and its q. The model drafts for itself in
    float32 (q close to p: most drafts accepted, the guess right often), so many x3 come from pre-drafts."""
    engine = local_engine(checkpoint, checkpoint, tokenizer=None, max_batch=256, queue_capacity=samples,
                          block_size=4, kv_blocks=1500, overlap=True, predraft=True, draft_dtype="float32")
    for i in range(samples):
        engine.submit(request(f"e{i}", EXACT_PROMPT, max_tokens=4, k=1, contract="exact", temperature=1.0,
                              seed=7000 + i, ignore_eos=True))
    chunks = engine.run_to_completion()
    engine.close()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    cells = []
    for i in range(samples):
        tokens = [t for c in chunks[f"e{i}"] for t in c.token_ids]
        assert len(tokens) == 4
        cells.append(tokens[1] * 6 + tokens[2])
    return torch.tensor(cells), engine.stats()["overlap"]["predraft"]


@pytest.mark.statistical
def test_exact_with_predrafts_matches_the_target_distribution(tiny: Path) -> None:
    """Pearson's chi-square over the 36 cells of (x2, x3) at alpha = 0.001 (see test_engine_exact.py); a
    third of the samples or more verify x3 from a pre-draft."""
    cells, counts = sample_second_and_third(tiny)
    assert counts["rounds"] >= EXACT_SAMPLES // 3, counts
    assert chi_square_pvalue(cells, second_and_third(tiny)) > 1e-3


@pytest.mark.statistical
def test_power_a_misaligned_predraft_q_is_detected(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same test fails when the pre-drafted draft is verified against the guess's q row (the q of the
    previous position): the test can tell a wrong q from the right one."""
    import cluster.engine.predraft as predraft

    real = predraft.settle

    def misaligned(*args: Any, **kwargs: Any) -> Any:
        kept, why = real(*args, **kwargs)
        if kept is not None and kept.probs is not None:
            plan = args[0]
            kept.probs = plan.predraft.probs[:-1]
        return kept, why

    monkeypatch.setattr("cluster.engine.accept.settle", misaligned)
    cells, counts = sample_second_and_third(tiny, samples=3000)
    assert counts["rounds"] > 0
    assert chi_square_pvalue(cells, second_and_third(tiny)) < 1e-3
