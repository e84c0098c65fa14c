"""cluster/bench/structured.py: its five cases are valid JSON Schemas of different shapes, each one compiles as the
engine compiles response_format (llguidance, on a tokenizer of single characters), and unknown cases are refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.bench.structured import _valid, load_cases
from specserve_types.api import Constraint
from tests.verifier_service.tiny_tokenizer import EOS, VOCAB, tiny_tokenizer
from verifier_service.constraint import ConstraintCompiler


def test_the_cases_are_five_shapes_of_valid_schemas_that_compile() -> None:
    cases = load_cases()
    assert len(cases) == 5 and len({c.shape for c in cases}) == 5 and len({c.id for c in cases}) == 5
    compiler = ConstraintCompiler(tiny_tokenizer(), VOCAB, [EOS])
    for case in cases:
        jsonschema.validators.validator_for(case.schema).check_schema(case.schema)
        compiler.compile(Constraint("json", json.dumps(case.schema)))
    assert [c.id for c in load_cases(["books", "person"])] == ["person", "books"]
    with pytest.raises(ValueError, match="unknown cases"):
        load_cases(["nope"])


def test_validity_is_json_that_matches_its_schema() -> None:
    (person,) = load_cases(["person"])
    good = {"name": "Ada", "age": 36, "email": "ada@example.com", "employed": True}
    assert _valid(json.dumps(good), person.schema, jsonschema)
    assert not _valid(json.dumps({**good, "age": "36"}), person.schema, jsonschema)
    assert not _valid('{"name": "Ada"', person.schema, jsonschema)
