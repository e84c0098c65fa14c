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


def test_the_report_sums_each_config_against_plain() -> None:
    """report() over fake runs (no model): rates, ratios, greedy equality, forced share and the constraint's cost."""
    from types import SimpleNamespace

    from cluster.bench.structured import Run, StructuredBench, StructuredSettings

    bench = object.__new__(StructuredBench)
    bench.s = StructuredSettings(temperatures=(0.0,))
    bench.cases = load_cases(["person"])
    bench.configs = ["plain", "model"]
    bench.llama = None
    bench.base = SimpleNamespace(constraints=ConstraintCompiler(tiny_tokenizer(), VOCAB, [EOS]), vocab_size=VOCAB,
                                 dtypes={"target": "q4"})
    text = json.dumps({"name": "Ada", "age": 36, "email": "a@b.c", "employed": True})
    stats = {"forced": {"proposed": 2, "accepted": 2}, "acceptance": {"proposed": 10, "accepted": 8},
             "constraint_seconds": 0.01, "cut": 1}
    bench.runs = [Run("person", "plain", 0.0, [1] * 40, 2.0, text, "stop", {"constraint_seconds": 0.01}),
                  Run("person", "model", 0.0, [1] * 40, 1.0, text, "stop", stats)]
    rows = {r["config"]: r for r in bench.report()["rows"]}
    assert rows["plain"]["tokens_per_s"] == 20.0 and rows["model"]["vs_plain"] == 2.0
    assert rows["model"]["same_as_plain"] == 1 and rows["model"]["valid"] == 1
    assert rows["model"]["acceptance_rate"] == 0.8 and rows["model"]["forced_share_of_tokens"] == 0.05
    assert rows["model"]["cut"] == 1 and 0 < rows["plain"]["constraint_cost_vs_plain_step"] < 1
