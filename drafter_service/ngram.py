"""N-gram prompt-lookup drafting: propose the tokens that followed the latest earlier match of the history's suffix.

    history:  a b c d . . . a b c [e f g] . . . x a b c
                                                 ^^^^^ suffix, n = 3
              the latest earlier "a b c" is followed by e f g  ->  propose [e, f, g][:k]

n is tried from max_n down to min_n; the first n with a match wins. The proposal is cut at the end of
the history, so it may hold fewer than k tokens, or none when no n-gram matches. It has no
probabilities: verify it with the exact contract as a point mass (q = None), or with greedy.

One vector compare of the history against its last token finds every candidate end, and each longer n keeps the
candidates whose earlier tokens match too. A request's history lives in a `TokenHistory` (an array appended to as
its tokens grow), so a round costs that compare, not a conversion of the whole list (docs/forward.md, "A long
output's Python").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_N = 3
MIN_N = 1


def propose_ngram(history: Sequence[int] | np.ndarray, k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> list[int]:
    """Up to k draft tokens for `history` (prompt + output token ids; a `TokenHistory.view` or any sequence)."""
    assert 1 <= min_n <= max_n, f"need 1 <= min_n <= max_n, got {min_n}, {max_n}"
    tokens = history if isinstance(history, np.ndarray) else np.asarray(history, dtype=np.int64)
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # window ends e <= length - 2 whose token is the last one
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            found = found[tokens[found - back] == tokens[length - 1 - back]]
        if found.size:
            follow = int(found[-1]) + 1
            return tokens[follow:follow + k].tolist()
    return []


class TokenHistory:
    """A request's token ids as an array, appended to as they grow (the ids are append-only: request_state.py's
    `token_ids`); one owner, the request's state."""

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int64)
        self._length = 0

    def view(self, token_ids: Sequence[int]) -> np.ndarray:
        """The array of `token_ids` (a view, valid until the next call): only the ids added since the last call
        are copied."""
        n = len(token_ids)
        if n < self._length:  # not the sequence it mirrored: start again
            self._length = 0
        if n > len(self._buffer):
            grown = np.empty(max(n, 2 * len(self._buffer)), dtype=np.int64)
            grown[:self._length] = self._buffer[:self._length]
            self._buffer = grown
        if n > self._length:
            self._buffer[self._length:n] = token_ids[self._length:n]
            self._length = n
        return self._buffer[:n]
