"""Tool calls on the gRPC surface (cluster/serving/grpc_service.py): ChunkWriter reads each completion's output into
GenerateChunk.tool_calls on the chunk that completes a call (text_delta raw, every cut of the text giving the calls
the HTTP door reads), and the last chunk's finish_reason is "tool_calls" where the HTTP door's would be; then the
same through a grpc.aio server over a fake scheduler (no Ray): the tools reach GenerateArgs, a bad tool is
INVALID_ARGUMENT naming its field. Run inside the loopback-only namespace (scripts/in-netns.sh)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from cluster.client import map_rpc_error
from cluster.serving.grpc_service import ChunkWriter
from cluster.serving.openai_api import Collected, completion_body
from cluster.serving.streams import ChunkStream
from cluster.serving.tool_calls import ToolOutput, parse_tool_calls
from specserve_types.api import InvalidRequestError, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.proto import specserve_pb2_grpc as pb_grpc
from specserve_types.protocol import GenerateArgs, IndexedChunk, StreamError, chunk_from_proto
from tests.cluster.serving.test_grpc_service import CountingLogger, FakeStreams, serve_fake, status_of

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [pb.Tool(name="get_weather", parameters_json=json.dumps(WEATHER)), pb.Tool(name="ping")]
AUTO = ToolOutput()


def chunks_of(text: str, cuts: list[int], reason: str = "eos", index: int = 0) -> list[IndexedChunk]:
    bounds = [0, *cuts, len(text)]
    return [IndexedChunk(index, TokenChunk("r", [at], text[a:b], finish_reason=reason if at == len(cuts) else None,
                                           stats={"prompt_tokens": 3} if at == len(cuts) else None), "greedy")
            for at, (a, b) in enumerate(itertools.pairwise(bounds))]


def written(items: list[IndexedChunk], tools: ToolOutput | None = AUTO) -> list[pb.GenerateChunk]:
    writer = ChunkWriter(tools)
    return [writer.chunk(item) for item in items]


def test_each_call_rides_the_chunk_that_completes_it() -> None:
    text = f"Sure.\n{CALL}\n{CALL2}"
    end_of_first = text.index("</tool_call>") + 5  # inside the first closing tag
    chunks = written(chunks_of(text, [3, end_of_first, len(text) - 2]))
    assert [[c.name for c in chunk.tool_calls] for chunk in chunks] == [[], [], ["get_weather"], ["ping"]]
    assert "".join(chunk.text_delta for chunk in chunks) == text  # the raw text, blocks included
    call = chunks[2].tool_calls[0]
    assert (json.loads(call.arguments), call.id[:5]) == ({"city": "Paris"}, "call_")
    assert [chunk.finish_reason for chunk in chunks] == ["", "", "", "tool_calls"]


@pytest.mark.parametrize(
    ("text", "reason", "tools", "finish"),
    [
        (CALL, "eos", ToolOutput(), "tool_calls"),
        (CALL, "stop", ToolOutput(), "tool_calls"),
        (CALL, "eos", ToolOutput(named=True), "eos"),  # a named function: not "tool_calls", as OpenAI's "stop"
        (CALL, "length", ToolOutput(), "length"),
        ("no calls", "eos", ToolOutput(), "eos"),
        (CALL[:-3], "length", ToolOutput(), "length"),  # an unterminated block is text
        (CALL, "eos", None, "eos"),  # tool_choice "none" or no tools: not read
    ],
)
def test_the_last_chunks_finish_reason(text: str, reason: str, tools: ToolOutput | None, finish: str) -> None:
    chunks = written(chunks_of(text, [len(text) // 2], reason), tools)
    assert chunks[-1].finish_reason == finish
    calls = [call for chunk in chunks for call in chunk.tool_calls]
    assert len(calls) == (1 if tools is not None and text == CALL else 0)


def test_every_cut_gives_the_http_doors_calls() -> None:
    """For any split of the output into chunks, the calls and finish reason are those of the HTTP door's whole
    answer (completion_body), ids aside."""
    rng = random.Random(5)
    for text in (CALL, f"{CALL}\n{CALL2}", f"a <tool_call> b\n{CALL}\nc", f"<tool_call>\n{{bad}}\n</tool_call>\n{CALL2}",
                 f"\n\n{CALL}\n\n"):
        collected = Collected(1)
        for item in chunks_of(text, []):
            collected.add(item)
        (whole,) = completion_body("r", "m", collected, chat=True, tools=ToolOutput())["choices"]
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", [])]
        assert want == [(c.name, c.arguments) for c in parse_tool_calls(text).calls]
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
            chunks = written(chunks_of(text, cuts))
            assert [(c.name, c.arguments) for chunk in chunks for c in chunk.tool_calls] == want, (text, cuts)
            assert chunks[-1].finish_reason == ("tool_calls" if whole["finish_reason"] == "tool_calls" else "eos")


def test_completions_read_their_own_output() -> None:
    first, second = chunks_of(CALL, [20], index=0), chunks_of("just text", [4], index=1)
    chunks = written([first[0], second[0], first[1], second[1]])
    assert [(c.index, [t.name for t in c.tool_calls], c.finish_reason) for c in chunks] == [
        (0, [], ""), (1, [], ""), (0, ["get_weather"], "tool_calls"), (1, [], "eos")]


def test_without_tools_the_chunk_is_as_before() -> None:
    (item,) = chunks_of(CALL, [])
    assert written([item], None) == [pb.GenerateChunk(
        request_id="r", token_ids=[0], text_delta=CALL, finish_reason="eos", contract="greedy",
        stats_json='{"prompt_tokens": 3}')]


# -- through a server ------------------------------------------------------------------------------------------
class Script:
    """A scheduler stream stand-in: the given chunks, in order."""

    def __init__(self, items: list[IndexedChunk]) -> None:
        self._items = iter(items)

    def __aiter__(self) -> AsyncIterator[IndexedChunk]:
        return self

    async def __anext__(self) -> IndexedChunk:
        await asyncio.sleep(0)
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


class ScriptedStreams(FakeStreams):
    def __init__(self, text: str, cuts: list[int], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.text, self.cuts = text, cuts

    async def open(self, args: GenerateArgs, timeout_s: float | None = None) -> tuple[StreamError | None,
                                                                                        ChunkStream]:
        self.opened.append(args)
        if self.refuse is not None:
            return self.refuse, ChunkStream()
        items = [item for index in range(args.n) for item in chunks_of(self.text, self.cuts, index=index)]
        return None, ChunkStream(Script(items), abort=lambda: self.aborted.append(args.request_id))


def test_a_tools_request_through_the_server() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        stub = pb_grpc.SpecServeStub(channel)
        request = pb.GenerateRequest(chat=True, text="weather in Paris?", tools=TOOLS, n=2,
                                     tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False)
        chunks = [chunk_from_proto(c) async for c in stub.Generate(request)]
        for index in (0, 1):
            mine = [c for c in chunks if c.index == index]
            assert [call.name for c in mine for call in c.tool_calls] == ["get_weather"]
            assert mine[-1].chunk.finish_reason == "tool_calls"
            assert "".join(c.chunk.text_delta for c in mine) == CALL
        plain = [c async for c in stub.Generate(pb.GenerateRequest(chat=True, text="hi"))]
        assert all(not c.tool_calls for c in plain) and plain[-1].finish_reason == "eos"
        error = await status_of(stub.Generate(pb.GenerateRequest(
            chat=True, text="hi", tools=[pb.Tool(name="f", parameters_json="{oops")])))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("tools[0].parameters_json: is not valid JSON")
        mapped = map_rpc_error(error)
        assert isinstance(mapped, InvalidRequestError) and mapped.field == "tools[0].parameters_json"
        error = await status_of(stub.Generate(pb.GenerateRequest(
            chat=True, text="hi", tools=TOOLS, tool_choice=pb.ToolChoice(function="nope"))))
        assert error.details() == "tool_choice: names function 'nope', which is not in tools"
        error = await status_of(stub.Generate(pb.GenerateRequest(text="hi", tools=TOOLS)))
        assert error.details() == "tools: tools need chat=true"

    streams = ScriptedStreams(CALL, [10, 40])
    serve_fake(streams, test)
    tools_args, plain_args = streams.opened
    assert json.loads(tools_args.tools) == [{"type": "function", "function": {"name": "get_weather",
                                                                               "parameters": WEATHER}},
                                            {"type": "function", "function": {"name": "ping"}}]
    assert tools_args.constraint is not None and tools_args.constraint.field == "tools"
    assert (plain_args.tools, plain_args.constraint) == ("", None)


def test_the_engines_refusal_of_a_tools_grammar_names_tools() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        error = await status_of(pb_grpc.SpecServeStub(channel).Generate(pb.GenerateRequest(
            chat=True, text="hi", tools=[pb.Tool(name="f", parameters_json='{"type": "frob"}')],
            tool_choice=pb.ToolChoice(mode="required"))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("tools: does not compile")

    serve_fake(ScriptedStreams(CALL, [], refuse=StreamError("invalid", "does not compile: bad schema", "tools")), test)
