"""The gRPC fields of constrained decoding (issue 69): GenerateRequest.constraint (json_schema, json_object, regex,
choice, grammar) and logit_bias, GenerateChunk.forced; their conversion both ways and their errors (the field named,
`constraint.KIND`, as INVALID_ARGUMENT details start)."""

from __future__ import annotations

import json

import pytest

from specserve_types.api import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    MAX_LOGIT_BIAS,
    Constraint,
    InvalidRequestError,
    TokenChunk,
)
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import (
    JSON_OBJECT_SCHEMA,
    GenerateArgs,
    IndexedChunk,
    ServerDefaults,
    args_from_proto,
    choice_constraint,
    chunk_from_proto,
    chunk_to_proto,
    constraint_from_proto,
    constraint_to_proto,
    json_schema_constraint,
    logit_bias_pairs,
)

DEFAULTS = ServerDefaults("smollm2-135m", draft="ngram")
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'


def wire(request: pb.GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest.FromString(request.SerializeToString())


@pytest.mark.parametrize(
    ("message", "kind", "value", "field"),
    [
        (pb.Constraint(json_schema=SCHEMA), "json", SCHEMA, "constraint.json_schema"),
        (pb.Constraint(json_schema="{}"), "json", "{}", "constraint.json_schema"),
        (pb.Constraint(json_object=True), "json", JSON_OBJECT_SCHEMA, "constraint.json_object"),
        (pb.Constraint(regex=r"\d{3}-\d{4}"), "regex", r"\d{3}-\d{4}", "constraint.regex"),
        (pb.Constraint(choice=pb.Choices(choices=["yes", "no", "é"])), "choice", '["yes", "no", "é"]',
         "constraint.choice"),
        (pb.Constraint(grammar='start: "a" | "b"\n'), "grammar", 'start: "a" | "b"\n', "constraint.grammar"),
    ],
)
def test_every_constraint_kind_round_trips(message: pb.Constraint, kind: str, value: str, field: str) -> None:
    request = wire(pb.GenerateRequest(text="x", constraint=message))
    args = args_from_proto(request, DEFAULTS)
    assert args.constraint == Constraint(kind, value, field)
    assert args.constraint.field == field  # the engine's compile errors name it
    back = constraint_from_proto(constraint_to_proto(args.constraint))
    assert back is not None and (back.kind, back.value) == (kind, value)


def test_choice_value_is_the_json_list() -> None:
    constraint = constraint_from_proto(pb.Constraint(choice=pb.Choices(choices=["a b", '"q"', "ü"])))
    assert constraint is not None and json.loads(constraint.value) == ["a b", '"q"', "ü"]
    assert list(constraint_to_proto(constraint).choice.choices) == ["a b", '"q"', "ü"]


def test_no_constraint_is_free_text() -> None:
    assert args_from_proto(pb.GenerateRequest(text="x"), DEFAULTS).constraint is None
    empty = wire(pb.GenerateRequest(text="x", constraint=pb.Constraint()))  # a message with no kind set
    assert empty.HasField("constraint") and args_from_proto(empty, DEFAULTS).constraint is None
    assert GenerateArgs("r", prompt_text="x").constraint is None


def test_logit_bias_round_trips_sorted_as_pairs() -> None:
    request = pb.GenerateRequest(text="x")
    request.logit_bias.update({50: -100.0, 3: 2.5, 7: 0.1})
    args = args_from_proto(wire(request), DEFAULTS)
    assert args.sampling.logit_bias == ((3, 2.5), (7, 0.1), (50, -100.0))  # double on the wire: 0.1 stays 0.1
    assert args.sampling.has_logit_bias
    assert args_from_proto(pb.GenerateRequest(text="x"), DEFAULTS).sampling.logit_bias == ()


def test_forced_round_trips_on_the_chunk() -> None:
    chunk = TokenChunk("req-1", [5, 6, 7], "abc", proposed=4, accepted=3, forced=2, finish_reason="stop")
    message = chunk_to_proto(IndexedChunk(0, chunk, "exact"))
    assert message.forced == 2
    assert chunk_from_proto(pb.GenerateChunk.FromString(message.SerializeToString())) == IndexedChunk(0, chunk, "exact")
    assert chunk_from_proto(pb.GenerateChunk(request_id="r")).chunk.forced == 0  # an older server's chunk


def test_old_clients_and_old_field_numbers_are_unchanged() -> None:
    """Backwards compatibility: the new fields take new numbers; the old ones keep theirs."""
    numbers = {f.name: f.number for f in pb.GenerateRequest.DESCRIPTOR.fields}
    assert {k: numbers[k] for k in ("text", "token_ids", "stop", "ignore_eos", "contract", "k", "draft", "n")} == {
        "text": 1, "token_ids": 2, "stop": 19, "ignore_eos": 20, "contract": 30, "k": 31, "draft": 32, "n": 33}
    assert (numbers["logit_bias"], numbers["constraint"]) == (21, 40)
    chunk_numbers = {f.name: f.number for f in pb.GenerateChunk.DESCRIPTOR.fields}
    assert (chunk_numbers["offset"], chunk_numbers["forced"]) == (10, 11)


def bias(entries: dict[int, float]) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="x")
    request.logit_bias.update(entries)
    return request


@pytest.mark.parametrize(
    ("request_", "field", "says"),
    [
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(json_schema="{not json")), "constraint.json_schema",
         "not valid JSON"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(json_schema='"a string"')), "constraint.json_schema",
         "JSON Schema is an object"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(json_schema="")), "constraint.json_schema",
         "not valid JSON"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(json_object=False)), "constraint.json_object",
         "must be true"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(regex="")), "constraint.regex", "non-empty"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(grammar="")), "constraint.grammar", "non-empty"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(regex="a" * (MAX_CONSTRAINT_CHARS + 1))),
         "constraint.regex", "longer than"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(choice=pb.Choices()), ), "constraint.choice",
         "at least one"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(choice=pb.Choices(choices=["a", ""]))),
         "constraint.choice", "non-empty string"),
        (pb.GenerateRequest(text="x", constraint=pb.Constraint(
            choice=pb.Choices(choices=[str(i) for i in range(MAX_CHOICES + 1)]))), "constraint.choice", "at most"),
        (bias({5: 100.5}), "logit_bias", "must be in [-100, 100]"),
        (bias({5: float("nan")}), "logit_bias", "finite"),
        (bias({-1: 1.0}), "logit_bias", ">= 0"),
        (bias({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias", "at most"),
    ],
)
def test_bad_constraint_fields_name_the_field(request_: pb.GenerateRequest, field: str, says: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        args_from_proto(wire(request_), DEFAULTS)
    assert info.value.field == field and says in info.value.message, info.value


def test_helpers_take_python_values() -> None:
    assert json_schema_constraint({"type": "integer"}).value == '{"type": "integer"}'
    assert json_schema_constraint(True, "f").field == "f"
    assert choice_constraint(("a", "b")).value == '["a", "b"]'
    with pytest.raises(InvalidRequestError, match="list of strings"):
        choice_constraint("ab")
    assert logit_bias_pairs({"12": 1, 3: -2.0}) == ((3, -2.0), (12, 1.0))  # JSON's string keys
    assert logit_bias_pairs([(4, 1.0)]) == ((4, 1.0),)
    for bad in ({"x": 1.0}, {" 1": 1.0}, {1.5: 1.0}, {True: 1.0}, {1: "1"}, {1: True}, [(1, 1.0), (1, 2.0)]):
        with pytest.raises(InvalidRequestError) as info:
            logit_bias_pairs(bad)  # type: ignore[arg-type]
        assert info.value.field == "logit_bias"
