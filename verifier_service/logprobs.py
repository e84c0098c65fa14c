"""Log-probabilities of the tokens a round emits (and of a prompt's), computed by the verifier from the rows it scored.

Which distribution (docs/api.md, "Log-probabilities"):
  raw        the target's log-softmax of its raw logits at that position (the default; OpenAI's and vLLM's)
  processed  the distribution the token was sampled from: the request's logits processors (logit bias, penalties,
             the constraint's mask) and, for a sampled request, its transform (temperature, top-k, top-p, min-p);
             a greedy request's has no temperature: its processed logits' log-softmax. A prompt's are always raw.

Each row is reduced on its own (float32 log-softmax over the vocabulary, then its top alternatives), so a position's
figures depend only on its row of logits: where the forward's rows do not depend on the batch (the kernel paths
that promise it, docs/exactness.md), a token's log-probabilities are bit for bit plain decoding's, whichever drafter,
k, tree or batch emitted it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve_types.api import RowLogprobs, SamplingParams
from verifier_service.sampling import transformed_logits


def row_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> RowLogprobs:
    """rows [r, V] (logits, or -inf where a token is out), tokens [r] (the token at each row) -> RowLogprobs with
    `top` alternatives a row (likeliest first)."""
    count = len(tokens)
    assert rows.shape[0] == count, f"{rows.shape[0]} rows for {count} tokens"
    chosen = np.empty(count, np.float32)
    ids = np.empty((count, top), np.int32)
    values = np.empty((count, top), np.float32)
    ranks = np.empty(count, np.int32)
    for i, token in enumerate(tokens):
        logprobs = torch.log_softmax(rows[i].float(), -1)
        own = logprobs[token]
        chosen[i] = float(own)
        ranks[i] = 1 + int((logprobs > own).sum())
        if top:
            best = torch.topk(logprobs, top)
            ids[i] = best.indices.numpy()
            values[i] = best.values.numpy()
    return RowLogprobs(chosen, ids, values, ranks)


def processed_rows(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The rows whose log-softmax `processed` mode reports, from the processed logits (all processors applied, the
    constraint's mask on every row)."""
    if params.is_greedy:
        return processed
    return transformed_logits(processed, params)


def prompt_logprobs(all_rows: torch.Tensor, input_ids: Sequence[int], top: int) -> RowLogprobs:
    """A prefill's prompt log-probabilities: row i (of the inputs' rows, all_rows' first len(input_ids)) scores
    input i + 1; the first input has none (the caller scores from the sequence's start)."""
    return row_logprobs(all_rows[:len(input_ids) - 1], list(input_ids[1:]), top)
