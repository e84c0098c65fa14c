"""The suffix-tree drafter's trie and proposals (drafter_service/suffix_tree.py), on small token sequences."""

from __future__ import annotations

import random

import pytest

from drafter_service.suffix_tree import SuffixCache, SuffixTrie


def paths(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count."""
    return trie.paths()


def brute_force(sequences: list[list[int]], max_depth: int) -> dict[tuple[int, ...], int]:
    """Count every substring of length <= max_depth: what the trie must hold."""
    out: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + max_depth) + 1):
                out[tuple(seq[i:j])] = out.get(tuple(seq[i:j]), 0) + 1
    return out


def test_counts_are_the_substring_counts_however_the_tokens_arrive() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    whole, piecewise = SuffixTrie(max_depth=5), SuffixTrie(max_depth=5)
    for i, seq in enumerate(seqs):
        whole.extend(i, seq)
        cut = rng.randrange(len(seq) + 1)
        piecewise.extend(i, seq[:cut])
        for token in seq[cut:]:
            piecewise.extend(i, [token])
    assert paths(whole) == paths(piecewise) == brute_force(seqs, 5)


def test_removing_every_sequence_leaves_an_empty_trie() -> None:
    rng = random.Random(1)
    trie = SuffixTrie(max_depth=4)
    seqs = {i: [rng.randrange(3) for _ in range(20)] for i in range(6)}
    for i, seq in seqs.items():
        trie.extend(i, seq)
    trie.remove(2)
    assert paths(trie) == brute_force([s for i, s in seqs.items() if i != 2], 4)
    for i in seqs:
        trie.remove(i)
    assert trie.root.children == {} and 3 not in trie


def test_proposal_is_the_continuations_of_the_longest_match_ranked_by_frequency() -> None:
    a, b, c, d, e = range(5)
    trie = SuffixTrie()
    context = [a, b, c, d, a, b, c, d, a, b, c, e, a, b, c]
    trie.extend(0, context)
    proposal = trie.propose(context, budget=8)
    assert proposal is not None and proposal.match_len == 3  # "a b c"; "e a b c" has no continuation yet
    tree = proposal.tree
    root_children = [tree.tokens[n] for n in tree.children(-1)]
    assert root_children == [d, e]  # d followed "a b c" twice, e once: ranked by count
    first, second = tree.children(-1)
    assert proposal.scores[first] == pytest.approx(2 / 4) and proposal.scores[second] == pytest.approx(1 / 4)
    assert proposal.chain(3) == [d, a, b]
    assert all(parent < i for i, parent in enumerate(tree.parents))
    for node in range(-1, len(tree)):  # siblings by descending score; a child never above its parent
        kids = tree.children(node)
        assert [proposal.scores[k] for k in kids] == sorted((proposal.scores[k] for k in kids), reverse=True)
        if node >= 0:
            assert all(proposal.scores[k] <= proposal.scores[node] for k in kids)


def test_budget_min_score_and_no_match() -> None:
    trie = SuffixTrie(max_depth=6)
    trie.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])
    assert len(trie.propose([1, 2], budget=2).tree) == 2  # type: ignore[union-attr]
    pruned = trie.propose([1, 2], budget=50, min_score=0.2)
    assert pruned is not None and min(pruned.scores) > 0.2
    assert trie.propose([9], budget=4) is None  # the token never occurred
    assert trie.propose([1, 2], budget=0) is None
    deep = trie.propose([1, 2], budget=100)
    assert deep is not None and deep.tree.depth() + deep.match_len <= 6  # paths never exceed max_depth


def test_cache_uses_the_request_or_the_global_outputs_and_evicts_the_oldest() -> None:
    cache = SuffixCache(max_outputs=2)
    cache.extend("r1", [7, 8, 9])
    assert cache.propose("r1", [7, 8, 9], budget=4) is None  # nothing ever followed 9 or "8 9"
    cache.finish("r0", [1, 2, 3, 4])  # an earlier output: "1 2" was followed by 3
    assert cache.propose("r1", [5, 1, 2], budget=4).chain(2) == [3, 4]  # type: ignore[union-attr]
    cache.extend("r1", [7, 8, 9, 7, 8, 6])
    assert cache.propose("r1", [7, 8], budget=1).tree.tokens in ((9,), (6,))  # type: ignore[union-attr]
    cache.finish("r1", [6, 6])
    cache.finish("r2", [0, 0])  # a third output: r0's is evicted
    assert "r1" not in cache.requests
    assert cache.propose("r3", [1, 2], budget=4) is None
    assert cache.propose("r3", [6], budget=4).tree.tokens == (6,)  # type: ignore[union-attr]


def test_equal_counts_go_to_the_most_recent_continuation() -> None:
    trie = SuffixTrie()
    trie.extend(0, [1, 2, 1, 3, 1])  # after 1: 2, then 3 (one each)
    proposal = trie.propose([1, 2, 1, 3, 1], budget=3)
    assert proposal is not None and proposal.chain(1) == [3]
    # every node scores 1/3 (3's child 1 follows 3 always): the most recent first
    assert proposal.tree.tokens == (3, 1, 2) and proposal.tree.parents == (-1, 0, -1)
