"""Suffix-tree drafting (Suffix Decoding, Oliaro et al., arXiv 2411.04975; Arctic Inference's
`suffix_decoding`): candidate continuations as a token tree, scored by how often they followed the context.

    SuffixTrie     every suffix of the sequences added to it, to `max_depth` tokens, with a count per node: the
                   number of times that path occurred. Grows by one token in O(max_depth) (`extend`); a whole
                   sequence can be taken out again (`remove`: the global trie's eviction).
    propose        the longest suffix of the context (up to `max_match` tokens) that is a path of the trie,
                   then best-first expansion from its node: a child's score is its parent's times
                   count(child) / count(parent) (the estimate of the probability that it follows: the
                   context's own occurrence counts, with nothing after it yet, so it errs low), up to
                   `budget` nodes and down to `min_score`. Returns a TokenTree (siblings by score) and the
                   scores, or None where nothing matches.
    SuffixCache    a trie per request (its prompt and output, growing as tokens are committed) and a global
                   trie of earlier outputs (bounded: the oldest are evicted first); a proposal comes from the
                   one whose best candidate scores higher.

The candidates are a function of the context (no random draws), so the tree is verified with the
deterministic-sibling rule (verifier_service/tree_contracts.py); its best path is the chain a chain-only round
verifies. Owner: the engine thread (no locking).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from verifier_service.tree_contracts import TokenTree

MAX_DEPTH = 24  # the longest path kept: match + continuation
MAX_MATCH = 12  # the longest context suffix looked up


class _Node:
    """count: how often the path occurred; last: the trie's clock when a sequence last passed through it (ties go
    to the most recent). Slotted: a prompt of L tokens makes up to L x max_depth of them."""

    __slots__ = ("children", "count", "last")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.last = 0


@dataclass(frozen=True)
class Proposal:
    tree: TokenTree
    scores: tuple[float, ...]  # per node: the estimated probability that its path follows the context
    match_len: int  # how many context tokens the trie matched

    @property
    def best(self) -> float:
        return max(self.scores, default=0.0)

    def chain(self, k: int) -> list[int]:
        """The best path of at most k tokens: from the root, the highest-scored child each time."""
        out, node = [], -1
        while len(out) < k:
            kids = self.tree.children(node)
            if not kids:
                break
            node = max(kids, key=lambda c: (self.scores[c], -c))
            out.append(self.tree.tokens[node])
        return out


class SuffixTrie:
    def __init__(self, max_depth: int = MAX_DEPTH) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self._open: dict[int, list[_Node]] = {}  # sequence id -> nodes of its open suffixes (longest first)
        self._clock = 0  # tokens added so far
        self._tokens: dict[int, list[int]] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new one starts empty): every suffix ending at each new token,
        up to max_depth long, gets its count raised."""
        own = self._tokens.setdefault(seq_id, [])
        open_nodes = self._open.setdefault(seq_id, [])
        keep, root, clock = self.max_depth - 1, self.root, self._clock
        for token in tokens:
            own.append(token)
            clock += 1
            moved = []
            for node in (*open_nodes[-keep:], root):  # suffixes of length 1..max_depth
                children = node.children
                child = children.get(token)
                if child is None:
                    child = children[token] = _Node()
                child.count += 1
                child.last = clock
                moved.append(child)
            open_nodes = moved
        self._open[seq_id] = open_nodes
        self._clock = clock

    def remove(self, seq_id: int) -> None:
        """Take sequence `seq_id` out: the counts its suffixes added go down; nodes that reach 0 go."""
        tokens = self._tokens.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if tokens is None:
            return
        for start in range(len(tokens)):
            self._decrement(self.root, tokens[start:start + self.max_depth])

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every path of the trie and its count."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self.root)]
        while stack:
            prefix, node = stack.pop()
            for token, child in node.children.items():
                out[prefix + (token,)] = child.count
                stack.append((prefix + (token,), child))
        return out

    @staticmethod
    def _decrement(root: _Node, path: Sequence[int]) -> None:
        node = root
        for token in path:
            child = node.children[token]
            child.count -= 1
            if child.count == 0:
                del node.children[token]
                return
            node = child

    def match(self, context: Sequence[int], max_match: int = MAX_MATCH) -> tuple[_Node, int] | None:
        """The node of the longest suffix of `context` (at most max_match tokens) that is a path, and its
        length; None if not even the last token is."""
        for length in range(min(max_match, len(context), self.max_depth - 1), 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)  # type: ignore[assignment]
                if node is None:
                    break
            else:
                if node.children:
                    return node, length
        return None

    def propose(self, context: Sequence[int], budget: int, min_score: float = 0.0,
                max_match: int = MAX_MATCH, levels: int | None = None) -> Proposal | None:
        """Up to `budget` candidate nodes after `context`, best first, at most `levels` deep (module docstring)."""
        if budget <= 0:
            return None
        found = self.match(context, max_match)
        if found is None:
            return None
        start, match_len = found
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        # (-score, -last, order, parent index, token, node): equal scores go to the most recent continuation, as the
        # n-gram drafter's latest match
        heap: list[tuple[float, int, int, int, int, _Node]] = []
        order = 0

        def push(parent_index: int, parent: _Node, parent_score: float, depth: int) -> None:
            nonlocal order
            if depth >= self.max_depth - match_len or (levels is not None and depth >= levels):
                return
            for token, child in parent.children.items():
                score = parent_score * child.count / parent.count
                if score > min_score:
                    heapq.heappush(heap, (-score, -child.last, order, parent_index, token, child))
                    order += 1

        push(-1, start, 1.0, 0)
        depth_of: list[int] = []
        while heap and len(tokens) < budget:
            negative, _, _, parent_index, token, node = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent_index)
            scores.append(-negative)
            depth_of.append(1 if parent_index < 0 else depth_of[parent_index] + 1)
            push(len(tokens) - 1, node, -negative, depth_of[-1])
        if not tokens:
            return None
        # popped best first: a parent before its children (a child never scores above it), siblings by score
        return Proposal(TokenTree(tuple(tokens), tuple(parents)), tuple(scores), match_len)


class Trie(Protocol):
    """What SuffixCache needs of a trie: SuffixTrie here, or the C++ one (drafter_service/suffix_native.py)."""

    def __contains__(self, seq_id: int) -> bool: ...

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None: ...

    def remove(self, seq_id: int) -> None: ...

    def paths(self) -> dict[tuple[int, ...], int]: ...

    def propose(self, context: Sequence[int], budget: int, min_score: float = 0.0, max_match: int = MAX_MATCH,
                levels: int | None = None) -> Proposal | None: ...


class SuffixCache:
    """A trie per live request and a global trie of finished outputs (at most `max_outputs`, oldest evicted);
    `make_trie(max_depth)` makes each (SuffixTrie, or suffix_native.make_trie: the C++ one)."""

    def __init__(self, max_outputs: int = 256, max_depth: int = MAX_DEPTH,
                 make_trie: Callable[[int], Trie] = SuffixTrie) -> None:
        self.max_outputs = max_outputs
        self.requests: dict[str, Trie] = {}
        self._make_trie = make_trie
        self.global_trie = make_trie(max_depth)
        self._outputs: OrderedDict[int, None] = OrderedDict()
        self._next_id = 0
        self._max_depth = max_depth

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """The request's new committed tokens (its prompt first)."""
        trie = self.requests.get(request_id)
        if trie is None:
            trie = self.requests[request_id] = self._make_trie(self._max_depth)
        trie.extend(0, tokens)

    def forget(self, request_id: str) -> None:
        """The request's trie goes (it left without an output worth keeping, or its id starts over)."""
        self.requests.pop(request_id, None)

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        """The request ended: its trie goes; its output joins the global trie (the oldest leaves past the bound)."""
        self.requests.pop(request_id, None)
        if self.max_outputs <= 0 or not output:
            return
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.global_trie.extend(seq_id, output)
        self._outputs[seq_id] = None
        while len(self._outputs) > self.max_outputs:
            oldest, _ = self._outputs.popitem(last=False)
            self.global_trie.remove(oldest)

    def propose(self, request_id: str, context: Sequence[int], budget: int, min_score: float = 0.0,
                levels: int | None = None, use_global: bool = True) -> Proposal | None:
        """The better of the request's own and the global proposal (by their best node's score; ties: own)."""
        own = self.requests.get(request_id)
        tries = ((own,) if own else ()) + ((self.global_trie,) if use_global else ())
        candidates = [t.propose(context, budget, min_score, levels=levels) for t in tries]
        found = [c for c in candidates if c is not None]
        return max(found, key=lambda c: c.best, default=None)


__all__ = ["MAX_DEPTH", "MAX_MATCH", "Proposal", "SuffixCache", "SuffixTrie", "Trie"]
