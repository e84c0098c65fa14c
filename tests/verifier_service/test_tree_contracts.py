"""Tests of the contracts on token trees (verifier_service/tree_contracts.py).

Deterministic: a chain is the tree with one child per node, and every tree rule then gives its chain
contract's verdict with the same uniforms (greedy, exact with point-mass drafts, exact with sampled drafts);
greedy on a tree follows the target's argmax; malformed trees are refused.

Statistical (the method of test_contracts.py): Pearson's chi-square goodness of fit at alpha = 0.001 per check,
V = 6, N = 12,000 rounds per case. The emitted tokens must follow the target: x1 ~ p0 and, whenever a second
token is emitted after x1 = v, x2 ~ P2[v] (the target after v; a third after (v, w) ~ P3[v, w] on the fixed
tree). A check runs only on a cell with >= 400 samples; with 400 samples and df = 5 the power against a total
variation of 0.2 (lambda >= 4 N tv^2 = 64) is > 0.99 (noncentral chi-square), and the tests at the end show
that the same checks reject a broken rule (`inject_bias`: a rejected candidate is not removed from the target).
Cases: deterministic siblings with a duplicate sibling, a node whose every child has p = 0 (all rejected), and
three levels; sampled siblings (drawn from q without replacement) with p = q, partial overlap and disjoint
supports (every candidate rejected: the correction must be p itself). About 40 checks in all: the family-wise error rate for random seeds is below 4% (Bonferroni); the
generators are seeded, so a run is reproducible.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.verifier_service.test_contracts import chi_square_pvalue
from verifier_service.contracts import verify_exact, verify_greedy, verify_typical
from verifier_service.sampling import sample_with_uniforms
from verifier_service.tree_contracts import TokenTree, tree_exact, verify_tree

V = 6
N = 12_000
ALPHA = 1e-3
MIN_CELL = 400


def rows(seed: int, n: int, zeros: dict[int, list[int]] | None = None) -> torch.Tensor:
    """n distributions over V tokens, bounded away from 0 except at `zeros[row]`."""
    w = torch.rand(n, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.3
    for row, tokens in (zeros or {}).items():
        w[row, tokens] = 0.0
    return w / w.sum(-1, keepdim=True)


# ------------------------------------------------------------------ chains are trees with one branch
@pytest.mark.parametrize("trial", range(40))
def test_a_chain_tree_gives_the_chain_contracts_verdicts(trial: int) -> None:
    g = torch.Generator().manual_seed(trial)
    k = 1 + trial % 5
    p = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 2, -1)
    x = [int(sample_with_uniforms(q[i:i + 1], torch.rand(1, generator=g, dtype=torch.float64))[0]) for i in range(k)]
    chain = TokenTree.chain(x)
    seed, position = 1000 + trial, 7 * trial
    assert verify_tree(chain, p, "greedy").tokens == tuple(verify_greedy(x, p).tokens)
    sampled = verify_tree(chain, p, "exact", seed, position, q=q, siblings="sampled")
    assert sampled.tokens == tuple(verify_exact(x, q[:k], p, seed, position).tokens)
    point = verify_tree(chain, p, "exact", seed, position, siblings="deterministic")
    assert point.tokens == tuple(verify_exact(x, None, p, seed, position).tokens)
    assert sampled.accepted_len == len(sampled.tokens) - 1


def test_greedy_follows_the_argmax_down_the_tree() -> None:
    #        root: children 3, 1 (node 0, 1); node 1: children 4, 2 (nodes 2, 3); node 3: child 0 (node 4)
    tree = TokenTree((3, 1, 4, 2, 0), (-1, -1, 1, 1, 3))
    logits = torch.zeros(6, V)
    logits[0, 1] = logits[2, 2] = logits[4, 0] = logits[5, 5] = 1.0  # argmax: 1 -> 2 -> 0 -> 5 (bonus)
    verdict = verify_tree(tree, logits, "greedy")
    assert verdict.path == (1, 3, 4) and verdict.tokens == (1, 2, 0, 5)
    logits[2] = 0.0
    logits[2, 5] = 1.0  # after 1 the argmax is 5: no such child, so 5 is the correction
    assert verify_tree(tree, logits, "greedy").tokens == (1, 5)


def test_bad_trees_and_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="parent"):
        TokenTree((1, 2), (1, -1))
    with pytest.raises(ValueError, match="parents"):
        TokenTree((1, 2), (-1,))
    tree = TokenTree((1, 2), (-1, 0))
    with pytest.raises(ValueError, match="one row per node"):
        verify_tree(tree, torch.full((2, V), 1 / V), "exact")
    with pytest.raises(ValueError, match="in \\[0, 6\\)"):
        verify_tree(TokenTree((9,), (-1,)), torch.full((2, V), 1 / V), "exact")
    with pytest.raises(ValueError, match="need the q"):
        verify_tree(tree, torch.full((3, V), 1 / V), "exact", siblings="sampled")
    with pytest.raises(ValueError, match="greedy, exact or typical"):
        verify_tree(tree, torch.full((3, V), 1 / V), "median")


@pytest.mark.parametrize("trial", range(20))
def test_typical_on_a_chain_tree_is_the_chain_typical_verdict(trial: int) -> None:
    g = torch.Generator().manual_seed(trial)
    k = 1 + trial % 4
    p = torch.softmax(3 * torch.randn(k + 1, V, generator=g), -1)
    drafts = [int(t) for t in torch.randint(0, V, (k,), generator=g)]
    tree = verify_tree(TokenTree.chain(drafts), p, "typical", seed=trial, position=7)
    chain = verify_typical(drafts, p, trial, 7)
    assert list(tree.tokens) == chain.tokens and tree.accepted_len == chain.accepted_len


def test_typical_takes_the_first_typical_sibling() -> None:
    p = torch.tensor([[0.05, 0.5, 0.45, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.float64)
    verdict = verify_tree(TokenTree((0, 2), (-1, -1)), p, "typical")  # 0 is atypical, 2 passes
    assert verdict.path == (1,) and verdict.tokens == (2, 3)


# ------------------------------------------------------------------ statistical: the emitted tokens follow p
def run_rounds(make: object, n: int, seed: int, inject_bias: bool = False) -> list[tuple[int, ...]]:
    """`make(generator)` -> (tree, p, q, siblings) per round; each round with fresh uniforms."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tree, p, q, siblings = make(g)  # type: ignore[operator]
        u_accept = torch.rand(tree.depth() + 1, max(1, tree.width()), generator=g, dtype=torch.float64)
        u_next = torch.rand(tree.depth() + 1, generator=g, dtype=torch.float64)
        out.append(tree_exact(tree, p, q, siblings, u_accept, u_next, inject_bias=inject_bias).tokens)
    return out


def worst_pvalue(samples: list[tuple[int, ...]], p0: torch.Tensor, after: dict[tuple[int, ...], torch.Tensor]
                 ) -> tuple[float, int]:
    """The smallest p-value over: x1 against p0, and each emitted continuation of a prefix in `after` (with at
    least MIN_CELL samples) against its target; and how many checks ran."""
    pvalues = [chi_square_pvalue(torch.tensor([s[0] for s in samples]), p0)]
    nexts: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for s in samples:
        for t in range(1, len(s)):
            nexts[s[:t]].append(s[t])
    for prefix, tokens in nexts.items():
        assert prefix in after, f"a continuation after {prefix}, which the tree cannot accept"
        if len(tokens) >= MIN_CELL:
            pvalues.append(chi_square_pvalue(torch.tensor(tokens), after[prefix]))
    return min(pvalues), len(pvalues)


P0 = rows(10, 1)[0]
P2 = rows(11, V)  # the target after a first token v: P2[v]
P3 = rows(12, V * V).view(V, V, V)  # after (v, w)
P4 = rows(14, V ** 3).view(V, V, V, V)  # after (v, w, z)
AFTER = ({(v,): P2[v] for v in range(V)} | {(v, w): P3[v, w] for v in range(V) for w in range(V)}
         | {(v, w, z): P4[v, w, z] for v in range(V) for w in range(V) for z in range(V)})


def deterministic_case(name: str) -> tuple[object, dict[tuple[int, ...], torch.Tensor], torch.Tensor]:
    """A fixed tree (a proposer's deterministic candidates), its p rows, and the targets after each prefix."""
    if name == "duplicate sibling":  # root: 2, 4, 2 (a duplicate); node 0 (2): children 1, 5
        tree = TokenTree((2, 4, 2, 1, 5), (-1, -1, -1, 0, 0))
        p0 = P0
    elif name == "every child rejected":  # the root's children have p = 0: each is rejected, the rest of p drawn
        tree = TokenTree((0, 1, 3), (-1, -1, 1))
        p0 = rows(13, 1, {0: [0, 1]})[0]
    else:  # three levels: root 3, 0; node 0 (3): 1, 2; node 2 (1): 4
        tree = TokenTree((3, 0, 1, 2, 4), (-1, -1, 0, 0, 2))
        p0 = P0
    prefixes = {}
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        prefixes[i] = tuple(reversed(path))
    p = torch.stack([p0] + [AFTER[prefix] for prefix in prefixes.values()])
    return (lambda g: (tree, p, None, "deterministic")), AFTER, p0


SAMPLED = {"p = q": lambda: (P0, P0.clone(), P2.clone()),
           "partial overlap": lambda: (rows(20, 1, {0: [0]})[0], rows(21, 1, {0: [1, 3]})[0], rows(22, V, {v: [v] for v in range(V)})),
           "disjoint supports": lambda: (rows(23, 1, {0: [0, 1, 2]})[0], rows(24, 1, {0: [3, 4, 5]})[0], rows(25, V))}


def sampled_case(name: str) -> tuple[object, dict[tuple[int, ...], torch.Tensor], torch.Tensor]:
    """Each round a fresh tree drawn from q: 3 root children without replacement from q0, 2 children of the
    first from Q2[its token]; the target P0 then P2 (their p = q case: P2 = Q2)."""
    p0, q0, q2 = SAMPLED[name]()

    def draw(g: torch.Generator, q: torch.Tensor, m: int) -> list[int]:
        left, out = q.clone(), []
        for _ in range(m):
            if left.sum() <= 0:
                break
            out.append(int(sample_with_uniforms(left.unsqueeze(0), torch.rand(1, generator=g, dtype=torch.float64))[0]))
            left[out[-1]] = 0.0
        return out

    def make(g: torch.Generator) -> tuple[TokenTree, torch.Tensor, torch.Tensor, str]:
        first = draw(g, q0, 3)
        second = draw(g, q2[first[0]], 2)
        tokens = tuple(first + second)
        tree = TokenTree(tokens, tuple([-1] * len(first) + [0] * len(second)))
        p = torch.stack([p0] + [P2[t] for t in first] + [P3[first[0], t] for t in second])
        q = torch.stack([q0] + [q2[t] for t in first] + [torch.zeros(V, dtype=torch.float64)] * len(second))
        return tree, p, q, "sampled"

    return make, AFTER, p0


CASES = [("deterministic", n) for n in ("duplicate sibling", "every child rejected", "three levels")]
CASES += [("sampled", n) for n in SAMPLED]


@pytest.mark.statistical
@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_tree_rules_keep_the_target_distribution(kind: str, name: str) -> None:
    make, after, p0 = (deterministic_case if kind == "deterministic" else sampled_case)(name)
    samples = run_rounds(make, N, seed=CASES.index((kind, name)))
    pvalue, checks = worst_pvalue(samples, p0, after)
    assert pvalue > ALPHA, (pvalue, checks)
    accepted = sum(len(s) > 1 for s in samples)
    if name in ("every child rejected", "disjoint supports"):  # p(candidate) = 0: all rejected, p drawn
        assert accepted == 0 and checks == 1
    else:
        assert accepted > N // 4 and checks >= 3, (accepted, checks)  # the candidates were accepted often


@pytest.mark.statistical
@pytest.mark.parametrize(("kind", "name"), [("deterministic", "duplicate sibling"), ("sampled", "partial overlap")])
def test_power_a_rule_that_keeps_rejected_candidates_is_detected(kind: str, name: str) -> None:
    """The negative control: a rejected candidate stays in the target (`inject_bias`); the same checks fail."""
    make, after, p0 = (deterministic_case if kind == "deterministic" else sampled_case)(name)
    pvalue, _ = worst_pvalue(run_rounds(make, N, seed=5, inject_bias=True), p0, after)
    assert pvalue < ALPHA, pvalue
