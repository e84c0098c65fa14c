"""A prompt's cost at the scheduler (cluster/serving/prompt_tokens.py): refused by its bytes before it is tokenized,
tokenized on threads while the event loop admits other requests, long prompts the shortest first, and the bound a
tokenizer's vocabulary gives."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cluster.serving import prompt_tokens
from cluster.serving.config import load_config
from cluster.serving.prompt_tokens import SHORT_PROMPT_BYTES, PromptBound, bytes_per_token
from cluster.serving.scheduler import Scheduler
from specserve_types.api import InvalidRequestError, SamplingParams
from specserve_types.protocol import GenerateArgs, IndexedChunk, StreamError
from tests.cluster.serving.test_scheduler_loop import ScriptedEngine, ScriptedTokenizer, drain, make_scheduler


class CountingTokenizer(ScriptedTokenizer):
    """Counts its calls; a text of at least `slow_from` characters waits for `release` (a long tokenization)."""

    def __init__(self, slow_from: int | None = None) -> None:
        self.calls = 0
        self.slow_from = slow_from
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[str] = []

    def __call__(self, text: str) -> dict[str, list[int]]:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        if self.slow_from is not None and len(text) >= self.slow_from:
            self.started.set()
            assert self.release.wait(10)
        return super().__call__(text[:8])  # a few tokens: the scripted context is small


def engine_with(tokenizer: ScriptedTokenizer) -> ScriptedEngine:
    engine = ScriptedEngine()
    engine.tokenizer = tokenizer
    return engine


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized() -> None:
    """4 bytes a token at most, a context of 2048 (the config's): 8000 tokens' room less max_tokens."""
    tokenizer = CountingTokenizer()
    scheduler = make_scheduler(engine_with(tokenizer))
    scheduler._prompt_bound = PromptBound(4)
    (refused,) = asyncio.run(drain(scheduler, GenerateArgs("big", prompt_text="x" * (4 * 2038 + 1),
                                                           sampling=SamplingParams(max_tokens=10))))
    assert isinstance(refused, StreamError) and refused.code == "invalid" and refused.field == "prompt"
    assert "8153 bytes of text cannot fit the 2038 tokens" in refused.message
    chat = GenerateArgs("chat", chat=True, messages=(("system", " " * 10_000 + "hi"), ("user", "日" * 3000)),
                        sampling=SamplingParams(max_tokens=10))
    (refused_chat,) = asyncio.run(drain(scheduler, chat))  # 9000 bytes of CJK; the blanks do not count
    assert refused_chat.field == "messages" and "9002 bytes" in refused_chat.message
    assert tokenizer.calls == 0 and scheduler._live == 0 and scheduler._counters["rejected_invalid"] == 2
    fits = asyncio.run(drain(scheduler, GenerateArgs("fits", prompt_text="x" * (4 * 2038),
                                                     sampling=SamplingParams(max_tokens=10))))
    assert fits[-1].chunk.finish_reason == "length" and tokenizer.calls == 1


def test_an_unset_max_tokens_is_what_the_tokenized_prompt_leaves() -> None:
    """max_tokens unset: before tokenizing, the bound leaves the prompt all but one token of the context; once
    tokenized, the request asks for what the engine's context leaves beside the prompt, within max_request_tokens / n,
    and the engine (and every check after tokenizing) gets that value."""
    bound = PromptBound(4)
    bound.check(GenerateArgs("fits", prompt_text="x" * (4 * 2047)), max_context=2048)
    with pytest.raises(InvalidRequestError, match="cannot fit the 2047 tokens .* beside one token to generate"):
        bound.check(GenerateArgs("big", prompt_text="x" * (4 * 2047 + 1)), max_context=2048)

    def scheduler_of(engine: ScriptedEngine, **fields: Any) -> Scheduler:
        engine.config = SimpleNamespace(max_context=engine.max_context)  # the context the scheduler reads off it
        config = load_config(model="smollm2-135m", draft="ngram", queue_capacity=8, max_batch=1, **fields)
        return Scheduler(config, None, None, engine_builder=lambda cfg, drafter, verifier, observer: engine)

    engine = ScriptedEngine(max_context=20)
    items = asyncio.run(drain(scheduler_of(engine), GenerateArgs("d", prompt_text="abc")))
    assert [r.sampling.max_tokens for r in engine.requests.values()] == [17]
    assert len(items) == 17 and items[-1].chunk.finish_reason == "length"
    engine = ScriptedEngine(max_context=20)
    asyncio.run(drain(scheduler_of(engine, max_request_tokens=10), GenerateArgs("n", prompt_text="abc", n=2)))
    assert [r.sampling.max_tokens for r in engine.requests.values()] == [5, 5]  # 10 tokens a request, in all
    (refused,) = asyncio.run(drain(scheduler_of(ScriptedEngine(), max_request_tokens=1),
                                   GenerateArgs("many", prompt_text="abc", n=2)))
    assert isinstance(refused, StreamError) and refused.field == "n"

    async def two_at_once(scheduler: Scheduler) -> tuple[list[Any], list[Any]]:
        first = asyncio.create_task(drain(scheduler, GenerateArgs("first", prompt_text="abc")))
        while scheduler._shares.of("").tokens != 3 + 17:  # until admitted, holding its prompt and resolved max_tokens
            await asyncio.sleep(0.005)
        second = await drain(scheduler, GenerateArgs("second", prompt_text="abc"))
        return await first, second

    # the client's share counts the value: alone past max_client_tokens it runs (a client holding nothing is within
    # its share), beside its first request it is refused
    first, second = asyncio.run(two_at_once(scheduler_of(ScriptedEngine(max_context=20), max_client_tokens=10)))
    assert len(first) == 17 and first[-1].chunk.finish_reason == "length"
    assert isinstance(second[0], StreamError) and second[0].code == "capacity" and "this request's 20" in second[0].message


def test_tokenizing_a_long_prompt_leaves_the_event_loop_and_short_prompts_free() -> None:
    """A long prompt whose tokenizer does not return: meanwhile another request is admitted, tokenized and answered
    (on the short prompts' own thread), then the long one goes on."""
    tokenizer = CountingTokenizer(slow_from=SHORT_PROMPT_BYTES + 1)
    scheduler = make_scheduler(engine_with(tokenizer))
    long_prompt = "y" * (SHORT_PROMPT_BYTES + 1)

    async def scenario() -> tuple[list[Any], list[Any], bool]:
        slow = asyncio.create_task(drain(scheduler, GenerateArgs("long", prompt_text=long_prompt,
                                                                 sampling=SamplingParams(max_tokens=2))))
        while not tokenizer.started.is_set():
            await asyncio.sleep(0.005)
        quick = await asyncio.wait_for(drain(scheduler, GenerateArgs("short", prompt_text="abc",
                                                                     sampling=SamplingParams(max_tokens=2))), 5)
        still_waiting = not slow.done()
        tokenizer.release.set()
        return quick, await slow, still_waiting

    quick, slow, still_waiting = asyncio.run(scenario())
    assert still_waiting and quick[-1].chunk.finish_reason == "length"
    assert isinstance(slow[-1], IndexedChunk) and slow[-1].chunk.finish_reason == "length"
    assert tokenizer.threads == ["specserve-tokenize-0", "specserve-tokenize-short-0"]
    assert scheduler._live == 0


def test_long_prompts_tokenize_the_shortest_first() -> None:
    order: list[int] = []
    gate = threading.Event()
    trimmed: list[int] = []
    lane = prompt_tokens._Lane(1, "test-lane", trimmed.append)
    try:
        first = lane.submit(10, gate.wait)  # holds the one thread
        time.sleep(0.05)
        futures = [lane.submit(size, lambda size=size: order.append(size)) for size in (300, 100, 200)]
        gate.set()
        for future in (first, *futures):
            future.result(5)
        assert order == [100, 200, 300]
        assert sorted(trimmed) == [10, 100, 200, 300]  # each job's size, for the heap trim after long ones
    finally:
        lane.close()


def test_a_request_gone_while_its_prompt_waits_is_not_tokenized() -> None:
    gate = threading.Event()
    lane = prompt_tokens._Lane(1, "test-lane", lambda size: None)
    ran: list[str] = []
    try:
        lane.submit(1, gate.wait)
        waiting = lane.submit(2, lambda: ran.append("tokenized"))
        assert waiting.cancel()
        gate.set()
        lane.submit(3, lambda: ran.append("next")).result(5)
        assert ran == ["next"]
    finally:
        lane.close()


# -- the bound a vocabulary gives ----------------------------------------------------------------------------------
def fast_tokenizer(normalizer: Any = None, pre_tokenizer: Any = None, model: Any = None) -> PreTrainedTokenizerFast:
    inner = Tokenizer(model or models.BPE({"a": 0, "b": 1, "ab": 2, "aab": 3, "<unk>": 4}, [("a", "b"), ("a", "ab")],
                                          unk_token="<unk>"))
    if normalizer is not None:
        inner.normalizer = normalizer
    if pre_tokenizer is not None:
        inner.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=inner)


def test_bytes_per_token_of_smollm2(smollm2_dir: Path) -> None:
    """Byte-level BPE, no normalizer: its longest token, a newline and 80 spaces."""
    assert bytes_per_token(AutoTokenizer.from_pretrained(smollm2_dir)) == 81


def test_bytes_per_token_by_what_the_tokenizer_does_to_text() -> None:
    assert bytes_per_token(fast_tokenizer()) == 5  # "<unk>" decodes to 5 bytes, "aab" to 3
    assert bytes_per_token(fast_tokenizer(normalizers.NFKC())) == 20  # a 4-byte character may become one byte
    assert bytes_per_token(fast_tokenizer(normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]))) == 80
    assert bytes_per_token(fast_tokenizer(normalizers.Replace(" ", "\u2581"))) == 5  # longer, not shorter
    assert bytes_per_token(fast_tokenizer(pre_tokenizer=pre_tokenizers.Metaspace())) == 5
    for deleting in ({"normalizer": normalizers.Strip()}, {"normalizer": normalizers.Replace("a", "")},
                     {"normalizer": normalizers.BertNormalizer()}, {"pre_tokenizer": pre_tokenizers.Whitespace()},
                     {"model": models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")}):
        assert bytes_per_token(fast_tokenizer(**deleting)) is None, deleting  # a token may stand for any length
    assert bytes_per_token(ScriptedTokenizer()) is None  # not a fast tokenizer


@pytest.mark.parametrize("per_token", [None, 2.5])
def test_token_ids_and_unknown_tokenizers_pass_the_bound(per_token: float | None) -> None:
    bound = PromptBound(per_token)
    bound.check(GenerateArgs("ids", prompt_token_ids=tuple(range(100))), max_context=16)  # the engine counts them
    if per_token is None:
        bound.check(GenerateArgs("text", prompt_text="x" * 10_000), max_context=16)
