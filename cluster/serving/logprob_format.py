"""Log-probabilities in the shapes clients read (docs/api.md, "Log-probabilities"), from the engine's rows
(specserve_types.api.RowLogprobs) and the token texts the scheduler sends with them (token_pieces.py):

    chat_logprobs        OpenAI chat: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]
    completion_logprobs  OpenAI completions (legacy): {tokens, token_logprobs, top_logprobs, text_offset}; with the
                         prompt (echo) its tokens first, the first one's log-probability and alternatives null. Each
                         position's alternatives hold its own token too (as vLLM's: up to n + 1 entries)
    vllm_prompt_logprobs vLLM's prompt_logprobs: null, then per token {id: {logprob, rank, decoded_token}} for the
                         token itself and its alternatives

A log-probability is the float32 the verifier computed, written as the shortest decimal that reads back to the same
float32 (-0.1, not -0.10000000149011612), so a client recovers the bits by rounding what it reads to float32; a token the processed distribution excludes (-inf) shows as -9999.0,
as vLLM shows it (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specserve_types.api import RowLogprobs

Pieces = Mapping[int, tuple[str, Sequence[int]]]  # token id -> (text, UTF-8 bytes)
FLOOR = -9999.0  # vLLM's stand-in for -inf


def shortest(value: float) -> float:
    """The float32 `value` as the shortest decimal that reads back to it (-9999.0 for -inf)."""
    return FLOOR if value < FLOOR else float(str(np.float32(value)))


def _entries(rows: RowLogprobs) -> list[tuple[float, list[tuple[int, float]]]]:
    return [(shortest(lp), [(t, shortest(v)) for t, v in top]) for lp, top in rows.entries()]


def chat_logprobs(token_ids: Sequence[int], rows: RowLogprobs, pieces: Pieces) -> list[dict[str, Any]]:
    out = []
    for token, (logprob, top) in zip(token_ids, _entries(rows), strict=True):
        text, data = pieces[token]
        out.append({"token": text, "logprob": logprob, "bytes": list(data),
                    "top_logprobs": [{"token": pieces[t][0], "logprob": lp, "bytes": list(pieces[t][1])}
                                     for t, lp in top]})
    return out


def _tops(token: int, logprob: float, top: list[tuple[int, float]], pieces: Pieces) -> dict[str, float]:
    found = {pieces[t][0]: lp for t, lp in top}
    found.setdefault(pieces[token][0], logprob)
    return found


def completion_logprobs(token_ids: Sequence[int], rows: RowLogprobs, pieces: Pieces, text_start: int = 0,
                        prompt: tuple[Sequence[int], RowLogprobs] | None = None) -> dict[str, Any]:
    """The legacy shape for `token_ids` (and, with `prompt` = (prompt ids, their rows from the second on), the prompt
    before them, its offsets from 0); `text_start`: where the first output token's text starts in the choice's
    text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = 0 if prompt is not None else text_start

    def add(token: int, logprob: float | None, tops: dict[str, float] | None) -> None:
        nonlocal at
        text = pieces[token][0]
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(tops)
        offsets.append(at)
        at += len(text)

    if prompt is not None:
        prompt_ids, prompt_rows = prompt
        add(prompt_ids[0], None, None)
        for token, (logprob, top) in zip(prompt_ids[1:], _entries(prompt_rows), strict=True):
            add(token, logprob, _tops(token, logprob, top, pieces))
        at = text_start
    for token, (logprob, top) in zip(token_ids, _entries(rows), strict=True):
        add(token, logprob, _tops(token, logprob, top, pieces))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def vllm_prompt_logprobs(prompt_ids: Sequence[int], rows: RowLogprobs, pieces: Pieces) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    ranks = rows.ranks.tolist()
    for token, (logprob, top), rank in zip(prompt_ids[1:], _entries(rows), ranks, strict=True):
        entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": pieces[token][0]}}
        for place, (t, lp) in enumerate(top, start=1):
            entry.setdefault(str(t), {"logprob": lp, "rank": place, "decoded_token": pieces[t][0]})
        out.append(entry)
    return out


def ids_of(rows: RowLogprobs | None) -> set[int]:
    """The alternatives' ids (whose texts a client needs beside the tokens')."""
    return set() if rows is None else set(rows.top_ids.ravel().tolist())
