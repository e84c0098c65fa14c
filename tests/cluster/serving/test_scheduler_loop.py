"""The Scheduler replica's logic without Ray: admission, streaming, cancellation, failed rounds.

A scripted engine emits one token per round per running request (token = position), so every
expected stream is exact.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

import pytest

from cluster.serving.config import load_config
from cluster.serving.scheduler import Scheduler
from kv_manager.schema import AuditReport
from specserve_types.api import (
    CapacityError,
    Constraint,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TokenChunk,
)
from specserve_types.protocol import GenerateArgs, IndexedChunk, StreamError

ROUND_S = 0.01  # a scripted round takes this long, so streams can be cancelled mid-way


class ScriptedTokenizer:
    def __len__(self) -> int:
        return 1000

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 1000 for c in text]}


class ScriptedEngine:
    """One token per round per request; `fail_next_round` makes the next step raise."""

    def __init__(self, max_context: int = 64) -> None:
        self.tokenizer = ScriptedTokenizer()
        self.kv = self
        self.max_context = max_context
        self.running: dict[str, list[int]] = {}
        self.requests: dict[str, GenerationRequest] = {}
        self.aborts: collections.deque[str] = collections.deque()
        self.aborted: list[str] = []
        self.fail_next_round = False
        self.held_blocks: set[str] = set()  # stands in for the KV ledger

    def check(self, request: GenerationRequest) -> None:
        if len(request.prompt_token_ids) + request.sampling.max_tokens > self.max_context:
            raise InvalidRequestError("prompt", "longer than the context")
        if request.prompt_token_ids[0] == ord("!"):
            raise CapacityError("engine full")

    def submit_group(self, requests: list[GenerationRequest]) -> None:
        for request in requests:  # all or none, as the engine's
            self.check(request)
        for request in requests:
            self.submit(request)

    def submit(self, request: GenerationRequest) -> None:
        self.check(request)
        self.requests[request.request_id] = request
        self.running[request.request_id] = []
        self.held_blocks.add(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.aborts)

    def audit(self) -> AuditReport:
        return AuditReport(counts={})

    def step(self) -> list[TokenChunk]:
        time.sleep(ROUND_S)
        chunks = []
        while self.aborts:
            rid = self.aborts.popleft()
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)
                self.held_blocks.discard(rid)
                chunks.append(TokenChunk(rid, [], finish_reason="abort"))
        if self.fail_next_round and self.running:
            self.fail_next_round = False
            raise RuntimeError("verifier died")
        for rid, out in list(self.running.items()):
            request = self.requests[rid]
            out.append(len(request.prompt_token_ids) + len(out))
            done = len(out) == request.sampling.max_tokens
            chunks.append(TokenChunk(rid, [out[-1]], str(out[-1]), proposed=1, accepted=0,
                                     finish_reason="length" if done else None,
                                     stats={"seed": request.sampling.seed} if done else None))
            if done:
                del self.running[rid]
                self.held_blocks.discard(rid)
        return chunks

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.running)}


def make_scheduler(engine: ScriptedEngine, queue_capacity: int = 8) -> Scheduler:
    config = load_config(model="smollm2-135m", draft="ngram", queue_capacity=queue_capacity, max_batch=1)
    return Scheduler(config, None, None, engine_builder=lambda cfg, drafter, verifier, observer: engine)


def args(rid: str, prompt: str = "abc", max_tokens: int = 3, n: int = 1, seed: int | None = None) -> GenerateArgs:
    return GenerateArgs(rid, prompt_text=prompt, sampling=SamplingParams(max_tokens=max_tokens, seed=seed), n=n)


def wait_until(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def drain(scheduler: Scheduler, request: GenerateArgs) -> list[Any]:
    return [item async for item in scheduler.generate(request)]


def test_stream_in_order_with_final_stats() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)
    items = asyncio.run(drain(scheduler, args("r1", "abc", max_tokens=3)))
    assert [item.chunk.token_ids for item in items] == [[3], [4], [5]]
    assert all(isinstance(item, IndexedChunk) and item.chunk.request_id == "r1" for item in items)
    assert items[-1].chunk.finish_reason == "length" and items[-1].chunk.stats["prompt_tokens"] == 3
    assert items[-1].contract == "greedy"
    assert scheduler._live == 0 and not engine.held_blocks


def test_n_completions_interleave_with_distinct_seeds() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)
    items = asyncio.run(drain(scheduler, args("r2", "ab", max_tokens=2, n=3, seed=10)))
    finals = {item.index: item.chunk.stats["seed"] for item in items if item.chunk.finished}
    assert finals == {0: 10, 1: 11, 2: 12}
    assert sorted(engine.requests) == ["r2#0", "r2#1", "r2#2"]


def test_each_completion_carries_the_constraint_and_logit_bias() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)
    constraint = Constraint("choice", '["yes", "no"]', "constraint.choice")
    request = GenerateArgs("r9", prompt_text="ab", n=2, constraint=constraint,
                           sampling=SamplingParams(max_tokens=1, logit_bias=((5, -100.0),)))
    asyncio.run(drain(scheduler, request))
    assert sorted(engine.requests) == ["r9#0", "r9#1"]
    for sent in engine.requests.values():
        assert sent.constraint == constraint and sent.sampling.logit_bias == ((5, -100.0),)


def test_refusals_arrive_as_first_item() -> None:
    engine = ScriptedEngine(max_context=8)
    scheduler = make_scheduler(engine)
    (too_long,) = asyncio.run(drain(scheduler, args("r3", "abcdefgh", max_tokens=4)))
    assert too_long == StreamError("invalid", "longer than the context", "prompt")
    (full,) = asyncio.run(drain(scheduler, args("r4", "!x", max_tokens=1)))
    assert full.code == "capacity"
    assert scheduler._live == 0 and scheduler._counters["rejected_invalid"] == 1


def test_queue_capacity_refuses_at_once() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine, queue_capacity=2)

    async def scenario() -> tuple[list[Any], list[Any]]:
        first = scheduler.generate(args("a", max_tokens=60, n=2))  # takes both slots
        head = await first.__anext__()
        refused = await drain(scheduler, args("b", max_tokens=1))
        await first.aclose()  # the client goes away: both completions are aborted
        await asyncio.sleep(0.2)
        return [head], refused

    (head,), refused = asyncio.run(scenario())
    assert isinstance(head, IndexedChunk)
    assert len(refused) == 1 and refused[0].code == "capacity" and "queue_capacity=2" in refused[0].message
    assert scheduler._live == 0
    assert wait_until(lambda: sorted(engine.aborted) == ["a#0", "a#1"] and not engine.held_blocks)
    # capacity is back: a new request runs
    assert asyncio.run(drain(scheduler, args("c", max_tokens=2)))[-1].chunk.finish_reason == "length"


def test_cancel_mid_stream_aborts_only_that_request() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> list[Any]:
        cancelled = asyncio.create_task(drain(scheduler, args("x", max_tokens=50)))
        survivor = asyncio.create_task(drain(scheduler, args("y", max_tokens=20)))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return await survivor

    survivor = asyncio.run(scenario())
    assert [item.chunk.token_ids[0] for item in survivor] == list(range(3, 23))
    assert wait_until(lambda: engine.aborted == ["x"])
    assert scheduler._counters["aborted"] == 1 and not engine.held_blocks


def test_failed_round_fails_live_requests_and_the_loop_goes_on() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)
    engine.fail_next_round = True
    items = asyncio.run(drain(scheduler, args("f", max_tokens=3)))
    assert items[-1].chunk.finish_reason == "error" and "verifier died" in items[-1].chunk.stats["error"]
    assert wait_until(lambda: "f" not in engine.running and not engine.held_blocks)
    assert asyncio.run(drain(scheduler, args("g", max_tokens=2)))[-1].chunk.finish_reason == "length"
    stats = asyncio.run(scheduler.stats())
    assert stats["scheduler"]["failed_rounds"] == 1 and stats["scheduler"]["errored"] == 1


def test_engine_construction_failure_is_reported() -> None:
    config = load_config(model="smollm2-135m", draft="ngram")

    def broken(cfg: Any, drafter: Any, verifier: Any, observer: Any) -> ScriptedEngine:
        raise FileNotFoundError("weights missing")

    with pytest.raises(RuntimeError, match="weights missing"):
        Scheduler(config, None, None, engine_builder=broken)


class ScriptedVerifier:
    on_sent: Any = None  # set by the engine loop (EngineLoop.hold_chunks_until)


class VerifyingEngine(ScriptedEngine):
    """Calls its verifier adapter's `on_sent` mid-round, as the cluster engine's verify call does, and records
    how many chunks the loop had delivered then and at each round's start."""

    def __init__(self, delivered: list[TokenChunk]) -> None:
        super().__init__()
        self.verifier = ScriptedVerifier()
        self.delivered = delivered
        self.at_start: list[int] = []
        self.at_sent: list[int] = []

    def step(self) -> list[TokenChunk]:
        self.at_start.append(len(self.delivered))
        if self.running:
            self.verifier.on_sent()
            self.at_sent.append(len(self.delivered))
        return super().step()


def run_holding(engine: VerifyingEngine, *workers: Any) -> None:
    """One 4-token request through an EngineLoop that holds each round's chunks until a request to one of
    `workers` is sent (as the Scheduler builds it), until its last chunk is delivered."""
    from cluster.serving.engine_loop import EngineLoop

    loop = EngineLoop(lambda: engine)

    def build() -> VerifyingEngine:
        loop.hold_chunks_until(*workers)
        return engine

    loop._build_engine = build
    loop.start()
    assert loop.wait_ready(5)
    loop.submit(GenerationRequest("r1", (1, 2, 3), SamplingParams(max_tokens=4)), engine.delivered.append).result(5)
    assert wait_until(lambda: len(engine.delivered) == 4)  # the last round's chunk too, with no round after it
    loop.stop()


def test_a_rounds_chunks_go_out_once_the_next_verify_is_sent_and_the_last_before_idling() -> None:
    delivered: list[TokenChunk] = []
    engine = VerifyingEngine(delivered)
    run_holding(engine, engine.verifier)
    assert [c.token_ids for c in delivered] == [[3], [4], [5], [6]] and delivered[-1].finish_reason == "length"
    assert engine.at_start == [0, 0, 1, 2]  # a round's chunk is still held when the next round starts ...
    assert engine.at_sent == [0, 1, 2, 3]  # ... and goes out once that round's verify is sent


class DraftingEngine(VerifyingEngine):
    """Sends each round's propose before its verify, as a serial round with a draft model does: on the engine
    thread, and also from another thread (the draft thread of an overlapped engine), which must release nothing."""

    def __init__(self, delivered: list[TokenChunk]) -> None:
        super().__init__(delivered)
        self.drafter = ScriptedVerifier()
        self.at_propose: list[int] = []
        self.at_other_thread: list[int] = []

    def step(self) -> list[TokenChunk]:
        if self.running:
            other = threading.Thread(target=self.drafter.on_sent)
            other.start()
            other.join()
            self.at_other_thread.append(len(self.delivered))
            self.drafter.on_sent()
            self.at_propose.append(len(self.delivered))
        return super().step()


def test_a_rounds_chunks_go_out_once_the_next_propose_is_sent_from_the_engine_thread() -> None:
    delivered: list[TokenChunk] = []
    engine = DraftingEngine(delivered)
    run_holding(engine, engine.drafter, engine.verifier)
    assert [c.token_ids for c in delivered] == [[3], [4], [5], [6]]
    assert engine.at_other_thread == [0, 0, 1, 2]  # a send from another thread leaves the last round's chunk held
    assert engine.at_propose == [0, 1, 2, 3]  # the propose (before the verify) sends it out
