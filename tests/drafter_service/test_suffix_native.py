"""The C++ suffix trie (drafter_service/native/suffix_trie.cpp) against the Python one it replaces: the same counts,
the same proposals token for token and score for score, through extends in pieces, removals (the global trie's
eviction) and every budget, depth and score bound the drafter uses."""

from __future__ import annotations

import random

import pytest

from drafter_service import suffix_native
from drafter_service.suffix_drafts import SuffixDrafter
from drafter_service.suffix_tree import SuffixCache, SuffixTrie
from tests.drafter_service.test_suffix_tree import brute_force, paths


@pytest.fixture(scope="module")
def module():  # noqa: ANN201
    built = suffix_native._module()
    assert built is not None, suffix_native.status()  # a C++ compiler is part of the setup: it must build
    return built


def same_proposal(native: suffix_native.NativeTrie, python: SuffixTrie, context: list[int], **kw: object) -> None:
    a, b = native.propose(context, **kw), python.propose(context, **kw)  # type: ignore[arg-type]
    assert (a is None) == (b is None), (context, kw)
    if a is not None and b is not None:
        assert (a.tree, a.scores, a.match_len) == (b.tree, b.scores, b.match_len), (context, kw)


def test_counts_and_proposals_equal_the_python_tries(module: object) -> None:
    rng = random.Random(7)
    for max_depth in (2, 5, 24):
        native, python = suffix_native.NativeTrie(module, max_depth), SuffixTrie(max_depth)  # type: ignore[arg-type]
        live: list[int] = []
        for seq_id in range(40):
            vocab = rng.choice([3, 6, 50])  # few tokens: long repeats, ties and branches
            seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
            cut = rng.randrange(len(seq) + 1)
            for trie in (native, python):  # in two pieces, as a request's prompt and then its output
                trie.extend(seq_id, seq[:cut])
                trie.extend(seq_id, seq[cut:])
            live.append(seq_id)
            if len(live) > 6:  # evicted as the global trie evicts, oldest first or at random
                gone = live.pop(rng.randrange(len(live)) if rng.random() < 0.3 else 0)
                native.remove(gone)
                python.remove(gone)
                assert gone not in native and gone not in python
            assert all(s in native and s in python for s in live)
            assert native.paths() == paths(python), (max_depth, seq_id)
            for _ in range(5):
                context = seq[: rng.randrange(1, len(seq) + 1)] if rng.random() < 0.7 else \
                    [rng.randrange(vocab) for _ in range(rng.randrange(1, 15))]
                same_proposal(native, python, context, budget=rng.choice([0, 1, 4, 16, 64]),
                              min_score=rng.choice([0.0, 0.02, 0.3]), max_match=rng.choice([1, 3, 12]),
                              levels=rng.choice([None, 1, 3, 8]))


def test_removing_every_sequence_frees_every_node(module: object) -> None:
    trie = suffix_native.NativeTrie(module, 6)  # type: ignore[arg-type]
    seqs = [[random.Random(i).randrange(4) for _ in range(30)] for i in range(5)]
    for i, seq in enumerate(seqs):
        trie.extend(i, seq)
    assert trie.paths() == brute_force(seqs, 6)
    for i in range(len(seqs)):
        trie.remove(i)
    trie.remove(99)  # unknown: nothing happens
    assert trie.paths() == {} and trie.live_nodes() == 1  # the root alone


def test_the_drafter_runs_the_native_trie_where_it_builds(module: object) -> None:
    drafter = SuffixDrafter()
    assert isinstance(drafter.cache.global_trie, suffix_native.NativeTrie)
    assert "C++" in suffix_native.status()
    prompt = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3, 9, 1, 2]
    got = drafter.propose("r", prompt, budget=8, levels=3)
    want = SuffixCache().requests.setdefault("r", SuffixTrie())
    want.extend(0, prompt)
    expected = want.propose(prompt, 8, drafter.min_score, levels=3)
    assert got is not None and expected is not None
    assert (got.tree, got.scores) == (expected.tree, expected.scores)
