"""N-gram prompt-lookup drafting: propose the tokens that followed the latest earlier match of the history's suffix.

    history:  a b c d . . . a b c [e f g] . . . x a b c
                                                 ^^^^^ suffix, n = 3
              the latest earlier "a b c" is followed by e f g  ->  propose [e, f, g][:k]

n is tried from max_n down to min_n; the first n with a match wins. The proposal is cut at the end of
the history, so it may hold fewer than k tokens, or none when no n-gram matches. It has no
probabilities: verify it with the exact contract as a point mass (q = None), or with greedy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_N = 3
MIN_N = 1


def propose_ngram(history: Sequence[int], k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> list[int]:
    """Up to k draft tokens for `history` (prompt + output token ids)."""
    assert 1 <= min_n <= max_n, f"need 1 <= min_n <= max_n, got {min_n}, {max_n}"
    if k <= 0:
        return []
    tokens = torch.as_tensor(list(history), dtype=torch.long)
    length = tokens.numel()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        earlier = tokens[:-1].unfold(0, n, 1)  # [length-n, n]: windows starting at 0 .. length-n-1
        starts = (earlier == tokens[-n:]).all(-1).nonzero()
        if starts.numel() > 0:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []
