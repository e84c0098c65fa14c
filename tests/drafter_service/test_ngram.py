"""Tests of the n-gram prompt-lookup proposer."""

from __future__ import annotations

import random

import numpy as np
import pytest

from drafter_service.ngram import TokenHistory, propose_ngram


def brute_force(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule read literally: for n from the longest down, the latest start s < len - n whose n tokens are the
    last n, and what follows them."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        for s in range(len(history) - n - 1, -1, -1):
            if history[s:s + n] == history[len(history) - n:]:
                return history[s + n:s + n + k] if k > 0 else []
    return []


def test_proposes_what_followed_the_latest_earlier_match() -> None:
    history = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 1, 2, 3]
    assert propose_ngram(history, k=3) == [7, 6, 5]  # the latest earlier "1 2 3", not the first
    assert propose_ngram(history, k=1) == [7]


def test_falls_back_to_shorter_ngrams() -> None:
    assert propose_ngram([4, 5, 6, 1, 7, 8, 2, 6], k=2) == [1, 7]  # "8 2 6", "2 6" unseen; "6" at index 2
    assert propose_ngram([4, 5, 6, 1, 7, 8, 5, 6], k=2) == [1, 7]  # "8 5 6" unseen; "5 6" at index 1
    assert propose_ngram([4, 5, 6, 1, 6, 8, 5, 6], k=2, max_n=1) == [8, 5]  # n = 1 only: the latest "6" is at 4
    assert propose_ngram([4, 5, 6, 1, 6, 8, 5, 6], k=2, max_n=2) == [1, 6]  # the longer "5 6" wins over it


def test_no_match_or_nothing_to_match() -> None:
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([], k=3) == []
    assert propose_ngram([5], k=3) == []
    assert propose_ngram([5, 5], k=3) == [5]
    assert propose_ngram([1, 2, 1, 2], k=0) == []
    assert propose_ngram([1, 2, 1, 2], k=3, min_n=3) == []  # "2 1 2" never occurred earlier


def test_proposal_is_cut_at_the_end_of_the_history() -> None:
    assert propose_ngram([1, 2, 1, 2, 1, 2], k=4) == [1, 2]  # latest earlier "2 1 2" starts at 1, followed by 1 2
    assert propose_ngram([7, 3, 7], k=5) == [3, 7]
    assert propose_ngram([1, 2, 3, 1, 2, 3], k=8, max_n=2) == [1, 2, 3]  # "2 3" at index 1


def test_rejects_bad_ngram_bounds() -> None:
    with pytest.raises(AssertionError):
        propose_ngram([1, 2], k=1, max_n=1, min_n=2)
    with pytest.raises(AssertionError):
        propose_ngram([1, 2], k=1, min_n=0)


def test_every_history_as_the_rule_reads() -> None:
    """Random histories over small vocabularies (matches everywhere, and none), every n range and k, through a list
    and through a TokenHistory grown a token at a time."""
    rng = random.Random(11)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 50, 151936])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        history = TokenHistory()
        for length in range(len(ids) + 1):
            prefix = ids[:length]
            view = history.view(prefix)
            for max_n, min_n in ((3, 1), (3, 3), (2, 1), (1, 1), (5, 2)):
                k = rng.randrange(0, 7)
                want = brute_force(prefix, k, max_n, min_n)
                assert propose_ngram(prefix, k, max_n, min_n) == want, (prefix, k, max_n, min_n)
                assert propose_ngram(view, k, max_n, min_n) == want, (prefix, k, max_n, min_n)


def test_the_history_copies_only_new_ids() -> None:
    """It mirrors the list through growth past its buffer, and starts again for a shorter list."""
    history, ids = TokenHistory(), list(range(1000))
    for n in (0, 1, 255, 256, 257, 700, 1000):
        view = history.view(ids[:n])
        assert view.dtype == np.int64 and view.tolist() == ids[:n]
    assert history.view([7, 8]).tolist() == [7, 8]
    assert history.view([7, 8, 9]).tolist() == [7, 8, 9]
