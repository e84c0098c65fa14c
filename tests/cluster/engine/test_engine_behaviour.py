"""Engine behaviour: seeds, stop conditions inside/at/after a fully accepted round (and an unset max_tokens: EOS
or the context's end), sampling sets, abort, bad input. Every test ends with the ledger audit showing zero leaked blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve_types.api import CapacityError, InvalidRequestError
from tests.cluster.engine.engine_helpers import (
    fake_engine,
    fake_greedy,
    load_target,
    local_engine,
    plain_greedy,
    request,
    run,
)
from tests.model_runtime.random_checkpoint import make_random_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("behaviour")
    target = make_random_checkpoint(root / "t", seed=21, vocab_size=64)
    draft = make_random_checkpoint(root / "d", seed=22, vocab_size=64, num_layers=1)
    return target, draft


def engine_for(pair: tuple[Path, Path], draft: str = "model", **fields):
    target, draft_dir = pair
    return local_engine(target, draft_dir if draft == "model" else draft, tokenizer=None,
                        **{"max_batch": 8, "block_size": 4, "kv_blocks": 512, **fields})


def test_same_seed_same_tokens_alone_or_batched(pair) -> None:
    kwargs = dict(max_tokens=20, k=3, contract="exact", temperature=0.9, seed=1234, ignore_eos=True)
    alone = run(engine_for(pair), [request("a", [5, 6, 7], **kwargs)])["a"]
    engine = engine_for(pair)
    others = [request(f"o{i}", [9 + i, 3], max_tokens=15, k=2, contract="exact", temperature=1.0, seed=i,
                      ignore_eos=True) for i in range(5)]
    batched = run(engine, [*others[:2], request("a", [5, 6, 7], **kwargs), *others[2:]])["a"]
    assert alone == batched
    engine.kv.audit().assert_no_leaks()


def test_different_seeds_differ(pair) -> None:
    engine = engine_for(pair)
    out = run(engine, [request(f"s{i}", [5, 6, 7], max_tokens=16, k=2, contract="exact", temperature=1.0,
                               seed=i, ignore_eos=True) for i in range(4)])
    assert len({tuple(v) for v in out.values()}) > 1
    engine.kv.audit().assert_no_leaks()


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6, 7, 9])
def test_max_tokens_cut_exactly_like_plain_decoding(pair, max_tokens: int) -> None:
    """max_tokens falls inside, at the end of, and right after fully accepted rounds (k=3: 4 tokens/round)."""
    target, _ = pair
    engine = engine_for(pair, draft="ngram")
    prompt = [8, 9, 10, 8, 9, 10, 8, 9]  # repetitive: the n-gram drafts are often fully accepted
    got = run(engine, [request("m", prompt, max_tokens=max_tokens, k=3, draft="ngram", ignore_eos=True)])["m"]
    assert got == plain_greedy(target, prompt, max_tokens)
    engine.kv.audit().assert_no_leaks()


def test_eos_inside_a_round_stops_like_plain_decoding(pair) -> None:
    target, _ = pair
    reference = plain_greedy(target, [4, 4, 4], 40)
    eos = reference[len(reference) // 2]  # pretend a token of the greedy path is EOS
    engine = engine_for(pair, draft="ngram")
    engine.eos_token_ids = frozenset({eos})
    chunks = engine.run_to_completion() if engine.submit(request("e", [4, 4, 4], max_tokens=40, k=4,
                                                                  draft="ngram")) is None else {}
    tokens = [t for c in chunks["e"] for t in c.token_ids]
    assert tokens == reference[:reference.index(eos) + 1]
    assert chunks["e"][-1].finish_reason == "eos"
    engine.kv.audit().assert_no_leaks()


def test_top_k_top_p_min_p_tokens_inside_allowed_set(pair) -> None:
    target, _ = pair
    model = load_target(target)
    cases = [dict(top_k=3), dict(top_p=0.3), dict(min_p=0.2)]
    for i, params in enumerate(cases):
        engine = engine_for(pair)
        prompt = [11, 12, 13]
        out = run(engine, [request(f"t{j}", prompt, max_tokens=12, k=2, contract="exact", temperature=1.5, seed=j,
                                   ignore_eos=True, **params) for j in range(4)])
        engine.kv.audit().assert_no_leaks()
        for tokens in out.values():
            seq = prompt + tokens
            from model_runtime.local_alloc import LocalAllocator, LocalSequence

            alloc = LocalAllocator(64, 4)
            (logits,) = model.forward_seqs([alloc.extend(LocalSequence(), seq[:-1])], model.allocate_kv(64, 4))
            for pos, token in enumerate(tokens):
                row = logits[len(prompt) - 1 + pos] / 1.5
                probs = row.softmax(-1)
                # ties at the boundary are allowed too: bf16 logits tie often on a 64-token vocabulary
                if "top_k" in params:
                    allowed = set((row >= torch.topk(row, 3).values[-1]).nonzero().flatten().tolist())
                elif "top_p" in params:
                    order = torch.argsort(probs, descending=True)
                    mass = probs[order].cumsum(0)
                    last = probs[order[int((mass < 0.3).sum())]]
                    allowed = set((probs >= last).nonzero().flatten().tolist())
                else:
                    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
                assert token in allowed, (i, pos, token, allowed)


def test_abort_releases_everything(pair) -> None:
    engine = engine_for(pair)
    for i in range(4):
        engine.submit(request(f"x{i}", [1, 2, 3, 4, 5], max_tokens=30, k=3, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort("x1")
    engine.abort("x3")
    chunks = engine.run_to_completion()
    assert chunks["x1"][-1].finish_reason == "abort" and chunks["x3"][-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks["x0"]) > 0
    engine.kv.audit().assert_no_leaks()
    # and the engine still serves a new request
    assert len(run(engine, [request("new", [7, 8], max_tokens=5, ignore_eos=True)])["new"]) == 5
    engine.kv.audit().assert_no_leaks()


def test_bad_input_typed_errors_and_nothing_changes(pair) -> None:
    engine = engine_for(pair, max_context=64, max_batch=1, queue_capacity=1)
    with pytest.raises(InvalidRequestError) as exc:
        engine.submit(request("long", list(range(1, 60)), max_tokens=10))
    assert exc.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.submit(request("vocab", [1, 9999]))
    with pytest.raises(InvalidRequestError):
        request("neg", [1], max_tokens=-1)
    with pytest.raises(InvalidRequestError):
        request("topp", [1], top_p=1.5)
    engine.submit(request("q1", [1, 2]))
    with pytest.raises(CapacityError):
        engine.submit(request("q2", [1, 2]))
    with pytest.raises(InvalidRequestError):
        engine.submit(request("q1", [1, 2]))  # duplicate id
    run(engine, [])
    engine.kv.audit().assert_no_leaks()


def test_memory_pressure_preempts_and_recovers(pair) -> None:
    """A pool too small for all requests at once: requests wait or are preempted and re-prefilled
    from their tokens; every output still equals plain greedy decoding."""
    target, _ = pair
    engine = engine_for(pair, draft="model", kv_blocks=24, max_batch=4, max_context=64)
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(6)]
    got = run(engine, [request(f"p{i}", p, max_tokens=24, k=2, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"p{i}"] == plain_greedy(target, p, 24)
    engine.kv.audit().assert_no_leaks()


def test_stop_strings_across_token_boundaries_smollm2(smollm2_dir: Path) -> None:
    engine = local_engine(smollm2_dir, "ngram", max_batch=2, block_size=16, kv_blocks=64)
    tok = engine.tokenizer
    prompt = tok("def add(a, b):\n    return")["input_ids"]
    reference = plain_greedy(smollm2_dir, prompt, 24)
    text = tok.decode(reference, skip_special_tokens=True)
    stop = text[6:10]  # four characters from the middle, possibly spanning tokens
    engine.submit(request("st", prompt, max_tokens=24, k=3, draft="ngram", stop=(stop,)))
    chunks = engine.run_to_completion()["st"]
    out_text = "".join(c.text_delta for c in chunks)
    assert out_text == text[: text.index(stop)]
    assert chunks[-1].finish_reason == "stop"
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference[: len(tokens)]
    assert stop in tok.decode(tokens, skip_special_tokens=True)
    assert stop not in tok.decode(tokens[:-1], skip_special_tokens=True)
    engine.kv.audit().assert_no_leaks()


def test_each_chunk_carries_its_offset_in_the_output() -> None:
    """A chunk's offset is the count of tokens sent before it (chaos/invariants.py reads repeats and skips off
    it): they follow on, round after round, for every request of a batch."""
    engine = fake_engine(max_batch=3)
    for i in range(3):
        engine.submit(request(f"o{i}", [5 + i, 6, 7], max_tokens=17 + i, k=2 + i))
    chunks = engine.run_to_completion()
    for rid, stream in chunks.items():
        sent = 0
        for chunk in stream:
            assert chunk.offset == sent, (rid, chunk)
            sent += len(chunk.token_ids)
        assert sent == 17 + int(rid[1:])
    engine.kv.audit().assert_no_leaks()
    engine.check_ledger()


def test_an_unset_max_tokens_runs_until_eos_or_the_context() -> None:
    """max_tokens unset (None): the answer ends where the model ends it (EOS), as plain decoding, or where the context
    does (1024 tokens in all, "length"); a prompt that fills the context is refused, naming the prompt."""
    prompt = [5, 6, 7]
    reference = fake_greedy(prompt, 40)
    eos = reference[30]
    engine = fake_engine()
    engine.eos_token_ids = frozenset({eos})
    engine.submit(request("e", prompt, max_tokens=None, k=3))
    chunks = engine.run_to_completion()["e"]
    assert [t for c in chunks for t in c.token_ids] == reference[:reference.index(eos) + 1]
    assert chunks[-1].finish_reason == "eos"
    engine.kv.audit().assert_no_leaks()

    engine = fake_engine()  # no EOS: the context's end
    context = engine.config.max_context
    tokens = run(engine, [request("c", prompt, max_tokens=None, k=3)])["c"]
    assert tokens == fake_greedy(prompt, context - len(prompt))
    with pytest.raises(InvalidRequestError, match="prompt .1024 tokens. leaves no room") as refused:
        engine.submit(request("full", [1] * context, max_tokens=None))
    assert refused.value.field == "prompt"
