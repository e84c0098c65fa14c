"""The client's keyword arguments of constrained decoding (cluster/client.py: build_request, constraint_of) and the
per-completion `forced` count of `collect`: what a caller writes becomes the server's GenerateArgs."""

from __future__ import annotations

import pytest

from cluster.client import build_request, collect
from specserve_types.api import Constraint, InvalidRequestError, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import JSON_OBJECT_SCHEMA, IndexedChunk, ServerDefaults, args_from_proto

DEFAULTS = ServerDefaults("m", draft="ngram")


def served(**fields: object) -> tuple[pb.GenerateRequest, Constraint | None, tuple[tuple[int, float], ...]]:
    request = pb.GenerateRequest.FromString(build_request("x", **fields).SerializeToString())
    args = args_from_proto(request, DEFAULTS)
    return request, args.constraint, args.sampling.logit_bias


@pytest.mark.parametrize(
    ("fields", "which", "kind", "value"),
    [
        ({"json_schema": '{"type": "integer"}'}, "json_schema", "json", '{"type": "integer"}'),
        ({"json_schema": {"type": "array", "items": {"type": "string"}}}, "json_schema", "json",
         '{"type": "array", "items": {"type": "string"}}'),
        ({"json_object": True}, "json_schema", "json", JSON_OBJECT_SCHEMA),
        ({"regex": "[a-z]+"}, "regex", "regex", "[a-z]+"),
        ({"choice": ["red", "green"]}, "choice", "choice", '["red", "green"]'),
        ({"grammar": 'start: "x"+\n'}, "grammar", "grammar", 'start: "x"+\n'),
        ({"constraint": Constraint("regex", "a|b")}, "regex", "regex", "a|b"),
        ({"constraint": Constraint("choice", '["a", "b"]')}, "choice", "choice", '["a", "b"]'),
    ],
)
def test_constraint_kwargs_reach_the_server(fields: dict, which: str, kind: str, value: str) -> None:
    request, constraint, _ = served(**fields)
    assert request.constraint.WhichOneof("kind") == which
    assert constraint is not None and (constraint.kind, constraint.value) == (kind, value)


def test_no_constraint_and_none_values_stay_unset() -> None:
    request, constraint, bias = served(regex=None, json_object=False, logit_bias=None, max_tokens=5)
    assert not request.HasField("constraint") and constraint is None and bias == ()
    assert request.max_tokens == 5


@pytest.mark.parametrize("logit_bias", [{50: -100, 3: 2.5}, {"50": -100, "3": 2.5}, [(50, -100.0), (3, 2.5)]])
def test_logit_bias_as_a_dict_or_pairs(logit_bias: object) -> None:
    request, _, bias = served(logit_bias=logit_bias)
    assert dict(request.logit_bias) == {3: 2.5, 50: -100.0}
    assert bias == ((3, 2.5), (50, -100.0))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"regex": "a", "choice": ["b"]}, "constraint"),
        ({"constraint": Constraint("regex", "a"), "json_object": True}, "constraint"),
        ({"constraint": "a|b"}, "constraint"),
        ({"choice": []}, "choice"),
        ({"choice": "ab"}, "choice"),
        ({"json_schema": "{oops"}, "json_schema"),
        ({"regex": 5}, "regex"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ],
)
def test_bad_kwargs_raise_before_anything_is_sent(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        build_request("x", **fields)
    assert info.value.field == field


def test_collect_sums_forced_per_completion() -> None:
    chunks = [IndexedChunk(0, TokenChunk("r", [1, 2], "ab", proposed=3, accepted=1, forced=1), "greedy"),
              IndexedChunk(1, TokenChunk("r", [5], "e", proposed=2, accepted=2, forced=2, finish_reason="stop"),
                           "greedy"),
              IndexedChunk(0, TokenChunk("r", [3], "c", proposed=2, accepted=2, forced=2, finish_reason="stop"),
                           "greedy")]
    samples = collect(iter(chunks))
    assert {i: (s["proposed"], s["accepted"], s["forced"]) for i, s in samples.items()} == {0: (5, 3, 3),
                                                                                          1: (2, 2, 2)}
