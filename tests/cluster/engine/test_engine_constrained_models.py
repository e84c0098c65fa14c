"""Constrained greedy decoding on the real SmolLM2 weights and tokenizer, chat prompts of several kinds under a JSON
schema, a regex, a choice and a grammar: speculative output (SmolLM2 drafting for itself, n-gram chains, suffix trees)
equals constrained plain decoding token by token, at batch 1 and 8, on every kernel path this CPU can run (the
path is in the test id); every output matches its constraint; no leaked block, an empty ledger."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specserve_types.api import Constraint
from tests.cluster.engine.engine_helpers import local_engine, request, run
from tests.cluster.engine.test_engine_precision import kernel_path  # noqa: F401 (the fixture)
from verifier_service.constraint import ConstraintCompiler

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
CASES = [  # (chat prompt, constraint)
    ("Describe a person as JSON with their name, age and hobbies.", Constraint("json", json.dumps(PERSON))),
    ("Is the sky blue? Answer yes or no.", Constraint("choice", json.dumps(["yes", "no", "maybe"]))),
    ("What is 12 times 12?", Constraint("regex", r"The answer is [0-9]{1,4}\.")),
    ("Name three colors.", Constraint("grammar", 'start: color (", " color)*\ncolor: "red" | "green" | "blue" | '
                                                 '"yellow" | "purple"')),
    ("Write a JSON object with a key 'ok' set to true.", Constraint("json", '{"type": "object"}')),
    ("Give me a US phone number.", Constraint("regex", r"\(\d{3}\) \d{3}-\d{4}")),
    ("List two fruits as a JSON array of strings.",
     Constraint("json", json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}))),
    ("Which is larger, 7 or 9?", Constraint("choice", json.dumps(["7", "9"]))),
]


def constrained_run(smollm2_dir: Path, draft: str, batch: int) -> dict[str, list[int]]:
    engine = local_engine(smollm2_dir, smollm2_dir if draft == "model" else draft, max_batch=batch, block_size=16,
                          kv_blocks=256, tree_nodes=16)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                    add_generation_prompt=True, return_dict=False)
               for text, _ in CASES]
    reqs = [replace(request(f"r{i}", list(p), max_tokens=24, k=None, draft=draft), constraint=c)
            for i, (p, (_, c)) in enumerate(zip(prompts, CASES, strict=True))]
    got = run(engine, reqs)  # the ledger empty and no block leaked
    compiler = ConstraintCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    for r in reqs:
        assert r.constraint is not None
        matcher = compiler.compile(r.constraint).matcher
        body = [t for t in got[r.request_id] if t not in engine.eos_token_ids]
        assert matcher.validate_tokens(body) == len(body), (r.request_id, engine.tokenizer.decode(body))
    return got


@pytest.mark.model
@pytest.mark.parametrize("batch", [1, 8])
def test_constrained_speculation_equals_constrained_plain_on_smollm2(smollm2_dir: Path, kernel_path: str,  # noqa: F811
                                                                     batch: int) -> None:
    plain = constrained_run(smollm2_dir, "none", batch)
    for draft in ("model", "ngram", "suffix"):
        assert constrained_run(smollm2_dir, draft, batch) == plain, draft
