"""Constrained decoding end to end on random-weight models and a tokenizer of single characters
(tiny_tokenizer.py), no model weights:

- greedy: constrained speculative output equals constrained plain decoding (draft "none") token by token, with a
  draft model's chains and trees, n-gram chains, suffix trees and forced tokens, at batch 1 and 8; every output
  matches its constraint; no block leaks and an empty ledger;
- exact sampling: the first two tokens follow the target's constrained distribution (mask, then renormalise),
  p'(x1) p'(x2 | x1), under a sampled draft model's chains (both exact rules; its drafts are unconstrained, so
  forbidden drafts are cut with their q), n-gram point masses and suffix trees; a broken residual fails the same
  test (its power);
- refusals before anything is reserved: a constraint that does not compile, a logit_bias id outside the vocabulary.

The test of fit: Pearson's chi-square over the cells the constraint allows (a sample in a forbidden cell fails at
once) at alpha = 0.001 (a correct engine fails with probability 0.001). N = 5,000 over the 16 cells the constraint
allows (df <= 15, critical value 37.7): a total-variation shift of 0.045 between two cells of probability <= 0.5 gives
noncentrality N 2 0.045^2 / 0.5 = 40.5, power ~0.85. The pair's seeds were picked (of six) for a draft whose q is
unlike p on the allowed tokens: drawing the correction from p instead of the residual moves the first token by
TV 0.19 (2,000 samples detect it with power ~1); most pairs put 90% of q on forbidden tokens, where the residual
is nearly p and no test could tell the two apart.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model_runtime.local_alloc import LocalAllocator, LocalSequence
from specserve_types.api import Constraint, InvalidRequestError
from tests.cluster.engine.engine_helpers import load_target, local_engine, request, run
from tests.model_runtime.random_checkpoint import make_random_checkpoint
from tests.verifier_service.test_contracts import chi_square_pvalue
from tests.verifier_service.tiny_tokenizer import EOS, VOCAB, ids, tiny_tokenizer
from verifier_service.constraint import ConstraintCompiler

ALPHA = 1e-3
SAMPLES = 5_000
DTYPE = "float32"

CONSTRAINTS = [
    Constraint("regex", "[ab]+(cd|dc)*e"),
    Constraint("choice", json.dumps(["abc", "abd", "bcd", "ccccc"])),
    Constraint("grammar", 'start: "{\\"ab\\":" num ("," num)* "}"\nnum: /[12]+/'),
    Constraint("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "array", "items": {"type": "integer"}}}, "required": ["a", "b"], "additionalProperties": False})),
    Constraint("regex", "(ab|ba|c)*"),
    Constraint("grammar", 'start: "a" ("b" | "cc" | "d")* "e"'),
    Constraint("choice", json.dumps(["e", "d", "dd"])),
    Constraint("regex", "[a-e]{3,6}"),
]
PROMPTS = [ids("abab"), ids("abcabc"), ids('{"ab":1}'), ids("dcdc"), ids("e"), ids("abcdeabcde"), ids("cc"), ids("aaaa")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("constrained")
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                  init_std=0.5)
    target, draft = (make_random_checkpoint(root / "t", seed=21, **kwargs),
                     make_random_checkpoint(root / "d", seed=22, **kwargs))
    for checkpoint in (target, draft):  # both models read the same tokenizer (the factory checks they agree)
        tiny_tokenizer().save_pretrained(checkpoint)
    return target, draft


def engine_for(pair: tuple[Path, Path], draft: str, **fields: object):
    target, draft_dir = pair
    return local_engine(target, draft_dir if draft in ("model", "model-tree") else draft,
                        block_size=4, kv_blocks=600, dtype=DTYPE, draft_dtype=DTYPE,
                        model_tree_nodes=8 if draft == "model-tree" else 0, tree_nodes=8, **fields)


def constrained(rid: str, prompt: list[int], constraint: Constraint | None, draft: str, **kwargs: object):
    return replace(request(rid, prompt, draft="model" if draft == "model-tree" else draft, **kwargs),
                   constraint=constraint)


def matches(constraint: Constraint, tokens: list[int]) -> bool:
    matcher = ConstraintCompiler(tiny_tokenizer(), VOCAB, [EOS]).compile(constraint).matcher
    body = tokens[:-1] if tokens and tokens[-1] == EOS else tokens
    return matcher.validate_tokens(body) == len(body)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("k", [3, None])
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(pair: tuple[Path, Path], batch: int,
                                                                          k: int | None) -> None:
    outputs: dict[str, dict[str, list[int]]] = {}
    for draft in ("none", "model", "model-tree", "ngram", "suffix"):
        engine = engine_for(pair, draft, max_batch=batch)
        reqs = [constrained(f"r{i}", p, c, draft, max_tokens=24, k=k) for i, (p, c) in
                enumerate(zip(PROMPTS, CONSTRAINTS, strict=True))]
        outputs[draft] = run(engine, reqs)  # checks the ledger is empty and no block leaked
        if draft == "model-tree" and k is not None:
            assert engine.acceptance.tree_rounds > 0
        if draft != "none":
            assert engine.stats()["forced"]["proposed"] > 0  # the grammars' forced strings were drafted
    for draft, got in outputs.items():
        assert got == outputs["none"], f"{draft} differs from constrained plain decoding"
    for i, constraint in enumerate(CONSTRAINTS):
        assert matches(constraint, outputs["none"][f"r{i}"]), f"r{i}: {outputs['none'][f'r{i}']}"


def test_a_completed_constraint_stops_and_one_cut_short_ends_with_length(pair: tuple[Path, Path]) -> None:
    engine = engine_for(pair, "ngram", max_batch=2)
    engine.submit(constrained("done", ids("ab"), Constraint("choice", json.dumps(["abcde"])), "ngram", max_tokens=20))
    engine.submit(constrained("short", ids("ab"), Constraint("choice", json.dumps(["abcde"])), "ngram", max_tokens=3))
    chunks = engine.run_to_completion()
    assert [t for c in chunks["done"] for t in c.token_ids] == ids("abcde")
    assert chunks["done"][-1].finish_reason == "stop" and chunks["short"][-1].finish_reason == "length"
    assert sum(c.forced for c in chunks["done"]) > 0
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


def test_bad_constraints_and_logit_bias_are_refused_before_anything_is_reserved(pair: tuple[Path, Path]) -> None:
    engine = engine_for(pair, "ngram", max_batch=2)
    with pytest.raises(InvalidRequestError) as error:
        engine.submit(constrained("bad", ids("ab"), Constraint("regex", "(", field="structured_outputs.regex"),
                                  "ngram"))
    assert error.value.field == "structured_outputs.regex"
    with pytest.raises(InvalidRequestError) as error:
        engine.submit(request("bias", ids("ab"), draft="ngram", logit_bias=((VOCAB, 5.0),)))
    assert error.value.field == "logit_bias"
    assert not engine.has_unfinished()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


def test_what_the_vocabulary_cannot_spell_is_refused_or_ends_the_request(pair: tuple[Path, Path]) -> None:
    """A choice the tokenizer cannot spell is refused at submit; a regex whose rest it cannot spell ends the request
    where it gets stuck (finish "error", logged; or "eos" where llguidance already sees the dead end and allows only
    end of sequence), and the engine and the batch go on."""
    engine = engine_for(pair, "ngram", max_batch=2)
    with pytest.raises(InvalidRequestError, match="cannot be spelled"):
        engine.submit(constrained("z", ids("ab"), Constraint("choice", json.dumps(["ab", "az"])), "ngram"))
    engine.submit(constrained("stuck", ids("ab"), Constraint("regex", "a[bc]z"), "ngram", max_tokens=8))
    engine.submit(constrained("fine", ids("ab"), Constraint("choice", json.dumps(["abc"])), "ngram", max_tokens=8))
    chunks = engine.run_to_completion()
    assert chunks["stuck"][-1].finish_reason in ("error", "eos")
    assert len([t for c in chunks["stuck"] for t in c.token_ids]) <= 3
    assert [t for c in chunks["fine"] for t in c.token_ids] == ids("abc")
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


def test_logit_bias_moves_greedy_tokens_the_same_way_with_and_without_drafts(pair: tuple[Path, Path]) -> None:
    bias = tuple((t, 100.0 if t == ids("c")[0] else -100.0) for t in ids("ab"))
    outputs = {}
    for draft in ("none", "model", "ngram"):
        engine = engine_for(pair, draft, max_batch=2)
        outputs[draft] = run(engine, [request("b", ids("abab"), draft=draft, max_tokens=12, logit_bias=bias,
                                              ignore_eos=True)])["b"]
    assert outputs["model"] == outputs["ngram"] == outputs["none"]
    assert not set(ids("ab")) & set(outputs["none"])  # banned by -100


# -------------------------------------------------------------------- exact sampling under a constraint
EXACT = Constraint("regex", "[abc][ade]|d[bc]|e[a-e]")  # two tokens, the second's set depends on the first
EXACT_PROMPT = ids("abdabdab")  # repeats: n-gram and suffix lookups find matches


def constrained_two_token_distribution(target: Path, prompt: list[int]) -> torch.Tensor:
    """p'(x1) p'(x2 | x1): the target's softmax over the tokens the constraint allows at each position."""
    compiler = ConstraintCompiler(tiny_tokenizer(), VOCAB, [EOS])
    model = load_target(target, DTYPE)
    kv = model.allocate_kv(16, 4)

    def masked(tokens: list[int], constraint) -> torch.Tensor:
        (logits,) = model.forward_seqs([LocalAllocator(16, 4).extend(LocalSequence(), tokens, logits="last")], kv)
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        bits = torch.tensor(list(constraint.allowed_mask().view("uint8"))).to(torch.uint8)
        for word_bit in range(VOCAB):
            keep[word_bit] = bool((bits[word_bit // 8] >> (word_bit % 8)) & 1)
        return logits[-1].double().masked_fill(~keep, float("-inf")).softmax(-1)

    root = compiler.compile(EXACT)
    p1 = masked(prompt, root)
    probs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for x1 in range(VOCAB):
        if p1[x1] > 0:
            after = root.fork()
            after.advance([x1])
            probs[x1] = p1[x1] * masked([*prompt, x1], after)
    return probs.flatten()


def sample_pairs(pair: tuple[Path, Path], draft: str, samples: int = SAMPLES, exact_rule: str = "block",
                 ) -> torch.Tensor:
    engine = engine_for(pair, draft, max_batch=256, queue_capacity=samples, exact_rule=exact_rule)
    for i in range(samples):
        engine.submit(constrained(f"s{i}", EXACT_PROMPT, EXACT, draft, max_tokens=3, k=2, contract="exact",
                                  temperature=1.0, seed=5000 + i))
    chunks = engine.run_to_completion()
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    firsts = []
    for i in range(samples):
        tokens = [t for c in chunks[f"s{i}"] for t in c.token_ids]
        assert len(tokens) == 2 and chunks[f"s{i}"][-1].finish_reason == "stop"  # the constraint completed
        firsts.append(tokens[0] * VOCAB + tokens[1])
    acceptance = engine.stats()["acceptance"]
    assert acceptance["proposed"] > 0 and 0 < acceptance["accepted"] < acceptance["proposed"]
    if draft == "suffix":
        assert engine.acceptance.tree_rounds > 0
    return torch.tensor(firsts)


@pytest.mark.parametrize("draft, rule", [("model", "block"), ("model", "token"), ("ngram", "block"),
                                         ("suffix", "block")])
def test_exact_constrained_speculation_follows_the_constrained_target(pair: tuple[Path, Path], draft: str,
                                                                      rule: str) -> None:
    expected = constrained_two_token_distribution(pair[0], EXACT_PROMPT)
    assert chi_square_pvalue(sample_pairs(pair, draft, exact_rule=rule), expected) > ALPHA


def test_power_a_broken_residual_under_a_constraint_is_detected(pair: tuple[Path, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import verifier_service.contracts as contracts

    monkeypatch.setattr(contracts, "residual_distribution", lambda p, q: p)  # the correction from p, not (p - q)+
    expected = constrained_two_token_distribution(pair[0], EXACT_PROMPT)
    assert chi_square_pvalue(sample_pairs(pair, "model", samples=2000, exact_rule="token"), expected) < ALPHA
