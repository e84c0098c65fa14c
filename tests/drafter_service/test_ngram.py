"""Tests of the n-gram prompt-lookup proposer."""

from __future__ import annotations

import pytest

from drafter_service.ngram import propose_ngram


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
