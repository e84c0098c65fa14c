"""schemathesis over the OpenAI routes' schema: every operation, positive and negative data, bounded examples.

Used by live_api/test_http_fuzz.py (the live cluster, through its /openapi.json) and by
tests/cluster/serving/test_http_api.py (the same routes over a scripted scheduler, no Ray).

Checks: not_a_server_error (no 5xx), status_code_conformance and content_type_conformance (only documented
codes and media types), response_schema_conformance (bodies and each SSE event match their models), and
negative_data_rejection (schema-invalid bodies answer 4xx). `fuzz_constraints` draws the constraint fields
(response_format, structured_outputs, guided_*, logit_bias, tools, a tool-calling history) in every request: each
answer is a 200 matching its model or a 400 naming the field. Generation is derandomized (the same examples every
run). Positive cases are kept short (max_tokens, max_completion_tokens <= SHORT_TOKENS, n <= SHORT_N) because
the schema, rightly, allows 8192 tokens and 16 completions, and every other one that leaves `stream` unset is
streamed (hypothesis seldom sets one of ~35 optional fields, and SSE events have their own schema); negative
cases are sent as generated (they are refused before generating anything).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
SHORT_TOKENS = 4
SHORT_N = 2


def keep_short(case: Case, stream: bool) -> None:
    """Bound a positive case's generation, and stream it if `stream` and it does not say (it stays schema-valid)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if body.get("stream") is None and (stream or body.get("stream_options") is not None):
        body["stream"] = True  # hypothesis seldom draws one of 35 optional fields: half the cases stream
    body["max_tokens"] = min(body.get("max_tokens") or SHORT_TOKENS, SHORT_TOKENS)
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = min(body["max_completion_tokens"], SHORT_TOKENS)
    if body.get("n") is not None:
        body["n"] = min(body["n"], SHORT_N)


def fuzz_operation(operation: APIOperation, mode: GenerationMode, max_examples: int, seen: dict[str, int],
                   call: dict[str, Any]) -> None:
    """`max_examples` cases of `operation` in `mode`, each sent and checked; counts them in `seen[mode]`."""

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case) -> None:
        if mode is GenerationMode.POSITIVE:
            keep_short(case, stream=seen[mode.value] % 2 == 1)
        response = case.call(**call)
        case.validate_response(response, checks=CHECKS)
        seen[mode.value] += 1

    run()


def fuzz_schema(schema: BaseSchema, max_examples: int, **call: Any) -> dict[str, dict[str, int]]:
    """Run every operation of `schema` (negative data only where there is a body); `call` goes to
    `case.call` (base_url, timeout). Raises the first failure; returns {operation: {mode: cases run}}."""
    counts: dict[str, dict[str, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        seen = counts.setdefault(operation.label, {"positive": 0, "negative": 0})
        fuzz_operation(operation, GenerationMode.POSITIVE, max_examples, seen, call)
        if operation.method.upper() == "POST":
            fuzz_operation(operation, GenerationMode.NEGATIVE, max_examples, seen, call)
    return counts


# -- constrained decoding's fields ----------------------------------------------------------------------------
# schemathesis draws one of ~45 optional fields now and then; this fuzzer draws the constraint fields in every
# request: two thirds of the requests in forms the server takes (schemas, regexes and grammars that compile, and
# some that do not: the engine's 400s), the rest with wrong values among them.
GOOD_SCHEMAS: list[Any] = [
    {}, {"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
     "$defs": {"P": {"type": "string", "pattern": "^[a-z]{1,3}$"}}},
]
BAD_SCHEMAS: list[Any] = [{"type": "frob"}, {"$ref": "#/nowhere"}, {"type": "string", "pattern": "("},
                          {"minimum": "zero"}]
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)
GOOD_NAMES = ["get_weather", "ping", "a-b_1"]


def _strategies(wild: bool) -> dict[str, Any]:
    """Each field's values: those the server takes (and the engine may refuse), plus wrong ones when `wild`."""
    schema = st.sampled_from(GOOD_SCHEMAS + (BAD_SCHEMAS if wild else []))
    regex = st.sampled_from(["[ab]{1,3}", "yes|no", r"\d+", ".*"] + (["(", "a{2,1}"] if wild else []))
    grammar = st.sampled_from(['start: "a" | "b"', 'start: %json {"type": "integer"}', "start: x\nx: /[0-9]+/"]
                              + (['start: "a" b', "nonsense"] if wild else []))
    # no control characters: SmolLM2's vocabulary cannot spell some ("\x1d"), and a constraint that needs one fails
    # the engine's round (test_openai_constrained.py's test_a_choice_the_vocabulary_cannot_spell)
    choices = st.lists(st.text(st.characters(codec="utf-8", exclude_categories=["C"]), min_size=1, max_size=4),
                       min_size=1, max_size=3)
    name = st.sampled_from(GOOD_NAMES)
    bias_key, bias = st.integers(0, 49_151).map(str), st.floats(-100, 100)
    if wild:
        schema |= st.dictionaries(st.sampled_from(["type", "enum", "const", "items", "x"]), JSON_VALUES, max_size=2)
        choices |= st.sampled_from([[], ["", "a"], "a"])
        name |= st.sampled_from(["bad name", "", "x" * 65])
        bias_key |= st.sampled_from(["-1", "x", "1e3", "99999999999", "05"])
        bias |= st.sampled_from([101, -1000, "1", True, None])
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": name}, optional={"parameters": schema, "description": st.text(max_size=8), "strict": st.booleans()})})
    named = st.builds(lambda function: {"type": "function", "function": {"name": function}}, name)
    return {"schema": schema, "regex": regex, "grammar": grammar, "choices": choices, "name": name,
            "bias": st.dictionaries(bias_key, bias, max_size=3), "named": named,
            "tools": st.lists(tool, min_size=0 if wild else 1, max_size=3,
                              unique_by=None if wild else lambda t: t["function"]["name"])}


@st.composite
def constrained_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """(path, body): a short request with one to three of the constraint fields."""
    wild = draw(st.integers(0, 2)) == 0
    values = _strategies(wild)
    chat = draw(st.booleans())
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, SHORT_TOKENS)), "stream": draw(st.booleans()),
                            "n": draw(st.integers(1, SHORT_N)), "temperature": draw(st.sampled_from([0, 0.8]))}
    body |= {"messages": [{"role": "user", "content": "Weather in Paris? Answer briefly."}]} if chat else \
        {"prompt": "The answer is"}
    formats = ["response_format", "structured_outputs", "guided"]
    others = ["logit_bias", "tools", "history", "logprobs"] if chat else ["logit_bias", "logprobs"]
    fields = draw(st.sets(st.sampled_from(formats + others), min_size=1, max_size=3)) if wild else \
        {*draw(st.sets(st.sampled_from(formats), max_size=1)), *draw(st.sets(st.sampled_from(others), max_size=2))}
    if not fields:
        fields = {"tools" if chat else "logit_bias"}
    if "response_format" in fields:
        json_schema = st.builds(lambda name, schema, strict: {"type": "json_schema", "json_schema": {
            "name": name, "schema": schema, "strict": strict}}, values["name"], values["schema"], st.booleans())
        body["response_format"] = draw(st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | json_schema
                                       | (st.sampled_from([{"type": "xml"}, "json", {}]) if wild else st.nothing()))
    if "structured_outputs" in fields:
        kinds = {"json": values["schema"], "regex": values["regex"], "choice": values["choices"],
                 "grammar": values["grammar"], "json_object": st.just(True)}
        if wild:
            kinds |= {"json_object": st.booleans(), "whitespace_pattern": values["regex"],
                      "json": values["schema"] | st.sampled_from(['{"type": "string"}', "{not json"])}
        keys = draw(st.sets(st.sampled_from(sorted(kinds)), min_size=0 if wild else 1, max_size=2 if wild else 1))
        body["structured_outputs"] = {key: draw(kinds[key]) for key in keys}
    if "guided" in fields:
        key, value = draw(st.sampled_from([("guided_json", values["schema"]), ("guided_regex", values["regex"]),
                                           ("guided_choice", values["choices"]), ("guided_grammar", values["grammar"])]))
        body[key] = draw(value)
    if "logit_bias" in fields:
        body["logit_bias"] = draw(values["bias"])
    if "tools" in fields:
        body["tools"] = draw(values["tools"])
        choices = ["none", "auto", "required", None] + (["sometimes"] if wild else [])
        tool_choice = st.sampled_from(choices) | (values["named"] if wild else st.sampled_from(
            [{"type": "function", "function": {"name": tool["function"]["name"]}} for tool in body["tools"]]))
        body["tool_choice"] = draw(tool_choice)
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.booleans())
        if not wild and body["tool_choice"] not in (None, "none", "auto"):  # a format beside required: refused
            body = {key: value for key, value in body.items() if not key.startswith(("structured", "guided"))}
    if "logprobs" in fields:  # issue 70's fields: chat's logprobs / top_logprobs, completions' logprobs / echo
        count = st.integers(0, 5) | (st.sampled_from([21, -1, 2.5, "3", True]) if wild else st.nothing())
        if chat:
            body["logprobs"] = True if not wild else draw(st.booleans() | st.just(None))
            body["top_logprobs"] = draw(count)
        else:
            body["logprobs"] = draw(count)
            body["echo"] = draw(st.booleans())
            if body["echo"] and draw(st.booleans()):
                body["max_tokens"] = 0  # the prompt scored only
        if draw(st.booleans()):
            body["prompt_logprobs"] = draw(count)
        if draw(st.booleans()):
            body["logprobs_mode"] = draw(st.sampled_from(["raw", "processed"]) | (
                st.sampled_from(["logits", ""]) if wild else st.nothing()))
    if "history" in fields:
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": draw(st.sampled_from(['{"city": "Paris"}', "{}",
                                                                                      "not json"]))}}
        body["messages"] += [{"role": "assistant", "content": draw(st.sampled_from([None, "", "Checking."])),
                              "tool_calls": [call] if not wild else draw(st.sampled_from([[call], [], None]))},
                             {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
        if wild and draw(st.booleans()):
            del body["messages"][-1]["tool_call_id"]
    if wild and draw(st.booleans()):  # a wrong value in one of the fields
        name = draw(st.sampled_from(sorted(set(body) - {"max_tokens", "n", "stream", "temperature"})))
        body[name] = draw(JSON_VALUES | st.just({"type": "function"}))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def check_answer(response: Any, chat: bool, stream: bool) -> str:
    """A 200 whose body (or every SSE event) matches its model, or a 400 naming its field; returns the status."""
    from cluster.serving.openai_models import (
        ChatCompletionChunk,
        ChatCompletionResponse,
        CompletionChunk,
        CompletionResponse,
        ErrorResponse,
    )

    assert response.status_code in (200, 400), (response.status_code, response.text[:300])
    if response.status_code == 400:
        error = ErrorResponse.model_validate(response.json()).error
        assert error.type == "invalid_request_error" and error.param, error
        assert error.message.startswith(f"{error.param}: "), error
        return "400"
    if not stream:
        (ChatCompletionResponse if chat else CompletionResponse).model_validate(response.json())
        return "200"
    events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        payload = json.loads(event)
        assert "error" not in payload, payload
        (ChatCompletionChunk if chat else CompletionChunk).model_validate(payload)
    return "200"


def fuzz_constraints(post: Any, max_examples: int) -> dict[str, int]:
    """`max_examples` constrained requests sent with `post(path, body)` (a response with status_code, text and
    json()), each answered by check_answer; returns how many were answered with each status."""
    seen: dict[str, int] = {}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(request=constrained_bodies())
    def run(request: tuple[str, dict[str, Any]]) -> None:
        path, body = request
        status = check_answer(post(path, body), chat=path.endswith("chat/completions"), stream=body["stream"] is True)
        seen[status] = seen.get(status, 0) + 1

    run()
    return seen
