"""Acceptance contracts on a token tree: several candidate continuations verified in one round.

A tree's nodes are draft tokens; node i's parent is `parents[i]` (-1: the root, the request's last committed
token), parents before children, siblings in the order the proposer ranked them. The target scored every
node in one forward (the runtime's tree mask), so there is a target distribution after the root and after
every node:

    p [N+1, V]   row 0: after the root (depth-1 candidates); row i+1: after node i (node i's children)
    q [N+1, V]   (sampled siblings only) the drafter's distribution at the same parents, from which the
                 children were drawn

Every rule walks down from the root, accepts at most one child per level and ends with one next token (a
correction where every child of the node reached was rejected, a bonus at a leaf). The verdict is the
accepted path and the tokens it emits. A chain is the tree with one child per node: every rule below then
makes the decisions of its chain contract (verifier_service/contracts.py) with the same uniforms.

greedy      follow the target's argmax down the tree; the first node without that child emits the argmax.
            Output equals plain greedy decoding token by token.
exact, deterministic siblings (n-gram / suffix-tree candidates, a draft model's top-k: the children are a
            function of the context, not random draws). At a node with target p, try its children in order:
            accept child c with probability r(c) / sum(r), where r is p with the children tried so far set to
            0; else set r(c) = 0 and go on; if every child is rejected, the next token is drawn from r. This
            is sampling from p by sequential elimination: child j is emitted with probability
            prod_{i<j} (1 - r_i(c_i)/|r_i|) * r_j(c_j)/|r_j| = p(c_j) (the products telescope), and any other
            token v with probability (1 - sum_j p(c_j)) * p(v) / (1 - sum_j p(c_j)) = p(v). A duplicate
            sibling finds r(c) = 0 and is rejected. The next level starts from the accepted child's own p,
            so by induction the emitted tokens follow the target, whatever the tree.
exact, sampled siblings (children drawn from the drafter's q without replacement: child j ~ q_j = q with the
            earlier siblings' tokens removed and renormalized). Recursive rejection sampling (Jeon et al.
            2024, "Recursive Speculative Decoding"; SpecInfer's multi-step speculative sampling is the same
            with replacement): r_1 = p; accept child j with probability min(1, r_j(x_j) / q_j(x_j)); on a
            rejection r_{j+1} = max(0, r_j - q_j) / Z; if every child is rejected, the next token ~ r_{m+1}.
            Given the earlier siblings, x_j ~ q_j, so step j is speculative sampling of r_j against q_j: it
            emits x_j with probability min(r_j, q_j)(x_j) summed over x_j, and on a rejection (probability
            Z = 1 - sum_v min(r_j, q_j)(v)) the rest follows r_{j+1}, by induction; together
            min(r_j, q_j) + Z * (r_j - q_j)+ / Z = r_j. A rejected x_j has r_j(x_j) <= q_j(x_j), so r_{j+1}(x_j)
            = 0: no correction repeats a rejected child. Why without replacement: a duplicate child is a node
            the verify scores for nothing.

Uniforms: the accept test of sibling j at depth d is the j-th draw of the request's generator for
(seed, position + d, "accept"); the next token at depth d uses (seed, position + d, "residual"), as chains do
(verifier_service/sampling.py), so sibling 0 along a chain draws exactly the chain's uniforms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from verifier_service.contracts import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD
from verifier_service.sampling import argmax_rows, request_generator, request_uniforms, sample_with_uniforms

SiblingKind = Literal["deterministic", "sampled"]


@dataclass(frozen=True)
class TokenTree:
    """Candidate tokens as a tree: node i holds `tokens[i]`; its parent is `parents[i]` (-1: the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"tree: node {i}'s parent {parent} is not an earlier node or -1 (the root)")

    @staticmethod
    def chain(tokens: Sequence[int]) -> TokenTree:
        return TokenTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Node `node`'s children (-1: the root's), in rank order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def depth(self) -> int:
        return max(self.depths(), default=0)

    def rank(self, node: int) -> int:
        """Node `node`'s place among its siblings (0: the proposer's first choice)."""
        return sum(1 for i in range(node) if self.parents[i] == self.parents[node])

    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or one of its ancestors (the runtime's tree mask)."""
        mask = torch.zeros(len(self), len(self), dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            mask[i, i] = True
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def width(self) -> int:
        """The most children of one node (uniforms per level)."""
        return max((len(self.children(n)) for n in range(-1, len(self))), default=0)


@dataclass(frozen=True)
class TreeVerdict:
    """One round on a tree: the accepted nodes from the root down, then one next token."""

    path: tuple[int, ...]
    tokens: tuple[int, ...]  # the accepted nodes' tokens, then next_token
    next_token: int
    contract: str

    @property
    def accepted_len(self) -> int:
        return len(self.path)


def _check(tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None) -> None:
    if p.dim() != 2 or p.shape[0] != len(tree) + 1:
        raise ValueError(f"p needs one row per node plus the root's: [{len(tree) + 1}, V], got {list(p.shape)}")
    if q is not None and q.shape != p.shape:
        raise ValueError(f"q must match p's shape {list(p.shape)}, got {list(q.shape)}")
    if any(not 0 <= t < p.shape[-1] for t in tree.tokens):
        raise ValueError(f"tree tokens must be in [0, {p.shape[-1]})")


def _verdict(tree: TokenTree, path: list[int], next_token: int, contract: str) -> TreeVerdict:
    return TreeVerdict(tuple(path), tuple(tree.tokens[n] for n in path) + (next_token,), next_token, contract)


def tree_greedy(tree: TokenTree, p: torch.Tensor) -> TreeVerdict:
    """Follow the target's argmax (ties: the lowest id, as plain greedy decoding) down the tree.
    p [N+1, V] logits or probs."""
    _check(tree, p, None)
    node, path = -1, []
    while True:  # only the rows on the path: most of a tree's rows are never read
        target = int(argmax_rows(p[node + 1]))
        child = next((c for c in tree.children(node) if tree.tokens[c] == target), None)
        if child is None:
            return _verdict(tree, path, target, "greedy")
        path.append(child)
        node = child


def tree_exact(tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None, siblings: SiblingKind,
               u_accept: torch.Tensor, u_next: torch.Tensor, inject_bias: bool = False) -> TreeVerdict:
    """The exact contract on a tree (module docstring). p [N+1, V] target probabilities; q [N+1, V] the
    drafter's (sampled siblings; None for deterministic ones); u_accept [depth + 1, width] and u_next [depth + 1]:
    the uniforms of the accept tests and of the next token at each depth (0-based from the root's children).

    `inject_bias` (tests only) is WRONG on purpose: a rejected candidate stays in the target (no elimination,
    no residual), which pulls the output towards the candidates; the statistical tests must catch it."""
    _check(tree, p, q)
    if siblings == "sampled" and q is None:
        raise ValueError("sampled siblings need the q they were drawn from")
    node, path, depth = -1, [], 0
    while True:
        r = p[node + 1].double().clamp(min=0)
        r = r / r.sum()
        q_left = None if siblings == "deterministic" else q[node + 1].double().clamp(min=0)  # type: ignore[index]
        accepted = None
        for j, child in enumerate(tree.children(node)):
            x, u = tree.tokens[child], float(u_accept[depth, j])
            if q_left is None:  # deterministic: accept with r(x) / |r|, else x leaves r
                if u * float(r.sum()) < float(r[x]):
                    accepted = child
                    break
                if not inject_bias:
                    r = r.clone()
                    r[x] = 0.0
                continue
            total = float(q_left.sum())  # 0: q had no token left to draw this sibling from: it is rejected
            q_j = q_left / total if total > 0 else torch.zeros_like(q_left)
            q_x = float(q_j[x])
            if q_x > 0 and u * q_x < float(r[x]):  # min(1, r/q)
                accepted = child
                break
            residual = (r - q_j).clamp(min=0)
            if residual.sum() > 0 and not inject_bias:  # == 0 only where r == q_j, which no rejection can produce but float error
                r = residual / residual.sum()
            q_left = q_left.clone()
            q_left[x] = 0.0  # without replacement: the next sibling was drawn from q without x
        if accepted is None:
            next_token = int(sample_with_uniforms(r.unsqueeze(0), u_next[depth:depth + 1])[0])
            return _verdict(tree, path, next_token, "exact")
        path.append(accepted)
        node, depth = accepted, depth + 1


def tree_uniforms(seed: int, position: int, tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's seeded uniforms for `tree` at `position` (that of the root's children): u_accept
    [depth + 1, width], u_next [depth + 1] (module docstring, "Uniforms")."""
    levels, width = tree.depth() + 1, max(1, tree.width())
    u_accept = torch.stack([torch.rand(width, dtype=torch.float64, generator=request_generator(
        seed, position + d, "accept", round_start=position)) for d in range(levels)])  # keyed by round, as chains
    return u_accept, request_uniforms(seed, position, levels, "residual")


def tree_typical(tree: TokenTree, p: torch.Tensor, u_next: torch.Tensor,
                 posterior_threshold: float = POSTERIOR_THRESHOLD,
                 posterior_alpha: float = POSTERIOR_ALPHA) -> TreeVerdict:
    """Medusa's typical acceptance on a tree (labeled "typical": the output distribution is NOT p). At each
    node, accept the first child (in the proposer's order) with p(x) > min(threshold, alpha * exp(-H(p))); where
    none passes, the next token ~ p with the uniform of that depth. On a chain: the chain's typical verdict."""
    _check(tree, p, None)
    node, path = -1, []
    while True:
        row = p[node + 1].double()
        threshold = min(posterior_threshold, posterior_alpha * math.exp(-float(torch.special.entr(row).sum())))
        child = next((c for c in tree.children(node) if float(row[tree.tokens[c]]) > threshold), None)
        if child is None:
            depth = len(path)
            next_token = int(sample_with_uniforms(p[node + 1].unsqueeze(0), u_next[depth:depth + 1])[0])
            return _verdict(tree, path, next_token, "typical")
        path.append(child)
        node = child


def verify_tree(tree: TokenTree, p: torch.Tensor, contract: str, seed: int = 0, position: int = 0,
                q: torch.Tensor | None = None, siblings: SiblingKind = "deterministic",
                inject_bias: bool = False) -> TreeVerdict:
    """One request's round on a tree: `greedy` (p: logits or probs), `exact` (p: the transformed target
    probabilities; q with sampled siblings) or `typical`, with the request's seeded uniforms."""
    if contract == "greedy":
        return tree_greedy(tree, p)
    if contract == "exact":
        return tree_exact(tree, p, q, siblings, *tree_uniforms(seed, position, tree), inject_bias=inject_bias)
    if contract == "typical":
        return tree_typical(tree, p, request_uniforms(seed, position, tree.depth() + 1, "residual"))
    raise ValueError(f"contract {contract!r} on a tree: greedy, exact or typical")


__all__ = ["SiblingKind", "TokenTree", "TreeVerdict", "tree_exact", "tree_greedy", "tree_typical", "tree_uniforms",
           "verify_tree"]
