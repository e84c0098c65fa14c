"""verifier_service/constraint.py: compiling each kind (and refusing what does not compile, naming the field), the rows'
masks along a chain's and a tree's prefixes, the cuts, forced tokens, and the matcher left where it was."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specserve_types.api import Constraint, InvalidRequestError, SamplingParams
from tests.verifier_service.tiny_tokenizer import EOS, VOCAB, ids, tiny_tokenizer
from verifier_service.constraint import ConstraintCompiler, logit_bias_errors, mask_words


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    return ConstraintCompiler(tiny_tokenizer(), VOCAB, [EOS])


def allowed(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return {int(i) for i in np.nonzero(bits)[0]}


def test_each_kind_compiles_and_constrains(compiler: ConstraintCompiler) -> None:
    regex = compiler.compile(Constraint("regex", "[ab]c"))
    assert allowed(regex.allowed_mask()) == set(ids("ab"))
    choice = compiler.compile(Constraint("choice", json.dumps(["ab", "cd"])))
    assert allowed(choice.allowed_mask()) == set(ids("ac"))
    grammar = compiler.compile(Constraint("grammar", 'start: "{" /[12]+/ "}"'))
    assert grammar.forced(4) == ids("{")
    schema = compiler.compile(Constraint("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                               "required": ["a"], "additionalProperties": False})))
    schema.advance(ids('{"a":1'))
    assert set(ids("12}")) <= allowed(schema.allowed_mask())
    schema.advance(ids("}"))
    assert schema.done and allowed(schema.allowed_mask()) == {EOS}  # completed: only end of sequence
    assert regex.allowed_mask().shape == (mask_words(VOCAB),)


@pytest.mark.parametrize("constraint, reason", [
    (Constraint("regex", "(ab", field="structured_outputs.regex"), "does not compile"),
    (Constraint("grammar", "start: missing", field="guided_grammar"), "does not compile"),
    (Constraint("json", '{"type": "nonsense"}', field="response_format"), "does not compile"),
    (Constraint("json", "[1, 2", field="response_format"), "not valid JSON"),
    (Constraint("choice", "[]", field="structured_outputs.choice"), "non-empty list"),
])
def test_what_does_not_compile_is_refused_naming_its_field(compiler: ConstraintCompiler, constraint: Constraint,
                                                            reason: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        compiler.compile(constraint)
    assert error.value.field == constraint.field and reason in error.value.message


def test_constraint_and_logit_bias_bounds() -> None:
    with pytest.raises(InvalidRequestError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(InvalidRequestError, match="longer"):
        Constraint("regex", "a" * (64 * 1024 + 1))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(InvalidRequestError, match="unique"):
        SamplingParams(logit_bias=((3, 1.0), (3, 2.0)))
    assert logit_bias_errors(((3, 1.0), (VOCAB, 1.0)), VOCAB) is not None
    assert logit_bias_errors(((3, 1.0),), VOCAB) is None


def test_a_chain_s_rows_follow_its_own_prefix_and_cut_where_it_is_forbidden(compiler: ConstraintCompiler) -> None:
    c = compiler.compile(Constraint("regex", "a[bc]d"))
    point = c.chain_masks(ids("ab") + ids("e") + ids("d"), with_q=False)
    assert point.keep == (0, 1)  # point mass: cut at the first forbidden draft (its position draws from p)
    assert [allowed(row) for row in point.allowed] == [set(ids("a")), set(ids("bc")), set(ids("d"))]
    with_q = c.chain_masks(ids("ab") + ids("e") + ids("d"), with_q=True)
    assert with_q.keep == (0, 1, 2)  # with q: the forbidden draft stays (its residual needs q); after it, nothing
    assert allowed(with_q.allowed[3]) == set(range(mask_words(VOCAB) * 32))  # never read for a token
    whole = c.chain_masks(ids("abd"), with_q=False)
    assert whole.keep == (0, 1, 2) and allowed(whole.allowed[3]) == {EOS}
    assert allowed(c.allowed_mask()) == set(ids("a"))  # the matcher is where it was


def test_a_tree_loses_forbidden_nodes_with_their_subtrees(compiler: ConstraintCompiler) -> None:
    c = compiler.compile(Constraint("regex", "a(bd|cd)"))
    c.advance(ids("a"))
    #        root(a) -> b(0) -> d(2), e(3);  c(1) -> d(4);  e(5) -> d(6)
    tokens = ids("b") + ids("c") + ids("d") + ids("e") + ids("d") + ids("e") + ids("d")
    parents = (-1, -1, 0, 0, 1, -1, 5)
    rows = c.tree_masks(tokens, parents)
    assert rows.keep == (0, 1, 2, 4)
    assert [allowed(r) for r in rows.allowed] == [set(ids("bc")), set(ids("d")), set(ids("d")), {EOS}, {EOS}]
    assert allowed(c.allowed_mask()) == set(ids("bc"))


def test_forced_tokens_and_the_cache(compiler: ConstraintCompiler) -> None:
    grammar = Constraint("grammar", 'start: "{\\"ab\\":" /[12]+/ "}"')
    first = compiler.compile(grammar)
    assert first.forced(3) == ids('{"a')
    assert first.forced(99) == ids('{"ab":')
    first.advance(ids('{"ab":1'))
    second = compiler.compile(grammar)  # a fresh copy of the cached matcher: the first one's moves are its own
    assert second.forced(1) == ids("{") and first.forced(4) == []
    fork = first.fork()
    fork.advance(ids("}"))
    assert fork.done and not first.done
