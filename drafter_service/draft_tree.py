"""A draft model's token tree, grown level by level (EAGLE-2's expand-then-rerank, Li et al. 2024, "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees"): the tree branches where the draft is unsure.

    level 1      the root's TOP_C likeliest tokens under the draft's distribution q (after the request's sampling
                 transform; softmax of the logits at temperature 0), each scored by its q
    level d + 1  the `width` best-scored nodes of level d are fed to the draft model (one forward for the whole
                 tree so far: the runtime's tree mask) and each gets its TOP_C likeliest children, scored by
                 score(parent) * q(child): the draft's probability of the whole path
    result       the `budget` best-scored nodes of every level (a parent scores at least its children, so the
                 selection is a tree), ordered by level, siblings by q: the proposer's rank order
    stop         with the item's `stop_below` (auto, greedy; as a chain's), no level is fed whose best path the
                 draft gives less than that probability: the nodes below it would rarely be accepted, and each
                 level costs a draft step. The tree keeps the level it has (its siblings are where a tree pays).

The children of a node are its q's top choices, a function of the context and not random draws, so the verifier
accepts them with the deterministic-sibling rule (verifier_service/tree_contracts.py): exact whatever q is, and
no q travels. Where the draft is confident, a node's first child takes nearly all of its parent's score and the
budget goes deep; where it is unsure the siblings score alike and the budget goes wide.

KV: the catch-up tokens are written to their slots (kept, as for a chain); the fed nodes go to scratch slots after
them (`slot_mapping[len(input_ids):]`, width * (k - 1) of them), rewritten at each level (a node attends only to
its ancestors, and the pool's past is all-or-nothing), never committed: the accepted path is fed again with the
next round's catch-up. Owner: the draft worker, for one propose call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runtime.batch import SeqInput
from specserve_types.round_messages import ProposeItem

TOP_C = 4  # children per expanded node


@dataclass(frozen=True)
class Candidate:
    token: int
    parent: int  # candidate index, -1: the root
    depth: int  # 1: the root's children
    score: float  # the draft's probability of the path to it
    rank: int  # among its siblings, by q


class DraftTree:
    def __init__(self, item: ProposeItem) -> None:
        assert item.tree_nodes > 0 and item.tree_width > 0, "a chain item"
        self.item = item
        self.candidates: list[Candidate] = []
        self.fed: list[int] = []  # candidate indices in feeding order (scratch slot order)

    def add_children(self, parent: int, q: torch.Tensor) -> None:
        """`parent`'s (-1: the root's) likeliest children under q [V] (probabilities)."""
        base = 1.0 if parent < 0 else self.candidates[parent].score
        depth = 1 if parent < 0 else self.candidates[parent].depth + 1
        values, tokens = torch.topk(q.float(), min(TOP_C, self.item.tree_nodes, q.shape[-1]))
        for rank, (value, token) in enumerate(zip(values.tolist(), tokens.tolist(), strict=True)):
            if value <= 0.0:
                break
            self.candidates.append(Candidate(int(token), parent, depth, base * value, rank))

    def frontier(self, depth: int) -> list[int]:
        """The `tree_width` best-scored candidates of `depth`, to be expanded."""
        level = [i for i, c in enumerate(self.candidates) if c.depth == depth]
        return sorted(level, key=lambda i: (-self.candidates[i].score, i))[:self.item.tree_width]

    def sure_enough(self, frontier: list[int]) -> bool:
        """Whether `frontier` is worth a level: its best path at least the item's `stop_below` (0: always)."""
        stop = self.item.stop_below
        return stop <= 0.0 or max((self.candidates[i].score for i in frontier), default=0.0) >= stop

    def step_input(self, frontier: list[int]) -> SeqInput:
        """Feed every node fed so far plus `frontier` (its rows last), each after the catch-up and its ancestors."""
        self.fed += frontier
        item, n_in = self.item, len(self.item.input_ids)
        where = {c: j for j, c in enumerate(self.fed)}
        n = len(self.fed)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for j, c in enumerate(self.fed):
            mask[j, j] = True
            parent = self.candidates[c].parent
            if parent >= 0:
                mask[j] |= mask[where[parent]]
        root = item.past_len + n_in - 1
        return SeqInput(token_ids=[self.candidates[c].token for c in self.fed], past_len=item.past_len + n_in,
                        block_table=item.block_table, slot_mapping=item.slot_mapping[n_in:n_in + n],
                        positions=[root + self.candidates[c].depth for c in self.fed], attn_mask=mask,
                        logits=len(frontier))

    def result(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the `tree_nodes` best-scored candidates, parents first, siblings by rank."""
        chosen = sorted(range(len(self.candidates)),
                        key=lambda i: (-self.candidates[i].score, self.candidates[i].depth, i))[:self.item.tree_nodes]
        kept = set(chosen)
        chosen = [i for i in chosen if self._ancestors_in(i, kept)]
        order = sorted(chosen, key=lambda i: (self.candidates[i].depth, self._path_ranks(i)))
        index = {c: j for j, c in enumerate(order)}
        tokens = [self.candidates[c].token for c in order]
        parents = [-1 if self.candidates[c].parent < 0 else index[self.candidates[c].parent] for c in order]
        return tokens, parents

    def _ancestors_in(self, i: int, kept: set[int]) -> bool:
        parent = self.candidates[i].parent
        while parent >= 0:
            if parent not in kept:
                return False
            parent = self.candidates[parent].parent
        return True

    def _path_ranks(self, i: int) -> tuple[int, ...]:
        ranks: list[int] = []
        while i >= 0:
            ranks.insert(0, self.candidates[i].rank)
            i = self.candidates[i].parent
        return tuple(ranks)


__all__ = ["TOP_C", "Candidate", "DraftTree"]
