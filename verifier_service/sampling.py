"""The request's sampling transform (penalties, temperature, top-k, top-p, min-p) and seeded sampling.

Both the draft logits (q) and the target logits (p) go through the same two steps, row by row:

    logits --apply_penalties / penalized_logits_for_positions--> penalized logits
           --transform_logits--> probs   (temperature 0: one-hot at argmax)

Glossary:
  history    the tokens a row conditions on: prompt + committed output + the draft tokens before it.
  position   index of a token in the request's full sequence (prompt + output); the token decided
             after `n` tokens of history sits at position `n`.
  stream     which random draw at a position: "draft" (x ~ q), "accept" (the uniform u of the
             accept test), "residual" (the correction or bonus token, and plain decoding).
  seed       every request has one: the engine assigns a random seed at admission to a request that
             sent none, so all randomness below is a pure function of (seed, position, stream).

Randomness is counter-based: `request_generator(seed, position, stream)` seeds a fresh CPU generator
from a hash of the triple, so a draw does not depend on batch composition, on other requests, on
which process or device runs it, or on how many draws happened before. Tokens are drawn by inverse
CDF from one float64 uniform per token (`sample_with_uniforms`), which is batch-friendly and exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from specserve_types.api import SamplingParams

Stream = Literal["draft", "accept", "residual"]
STREAMS: tuple[str, ...] = ("draft", "accept", "residual")


# ----------------------------------------------------------------------------------------------
# Penalties (on raw logits, before temperature)
# ----------------------------------------------------------------------------------------------


def penalize(logits: torch.Tensor, seen: torch.Tensor, output_counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Repetition penalty (HF) over `seen` [n,V] (prompt + output), then frequency and presence (OpenAI) over output counts.

        repetition:  l_v <- l_v / rho  if l_v > 0 else l_v * rho          for v in prompt + output
        OpenAI:      l_v <- l_v - c_v * alpha_freq - [c_v > 0] * alpha_presence,  c_v = output count of v
    """
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        rho = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits < 0, logits * rho, logits / rho), logits)
    counts = output_counts.to(logits.dtype)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)


def token_counts(token_ids: Sequence[int], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Count of each token id in `token_ids` as an int64 [V] tensor; ids >= V are ignored (as HF does)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    ids = ids[ids < vocab_size]
    return torch.bincount(ids, minlength=vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    params: SamplingParams,
) -> torch.Tensor:
    """Penalize logits [n,V]; row i's history is `prompt_ids[i]` + `output_ids[i]` (output = generated tokens)."""
    if not params.has_penalties:
        return logits
    n, vocab_size = logits.shape
    assert len(prompt_ids) == n and len(output_ids) == n, "one prompt and one output history per row"
    out = torch.stack([token_counts(o, vocab_size, logits.device) for o in output_ids])
    prompt = torch.stack([token_counts(p, vocab_size, logits.device) for p in prompt_ids])
    return penalize(logits, (prompt + out) > 0, out, params)


def penalized_logits_for_positions(
    logits: torch.Tensor,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    draft_ids: Sequence[int],
    params: SamplingParams,
) -> torch.Tensor:
    """Penalize the m rows one verify forward scores for one request, each with the history plain decoding would see.

    Row j predicts the token after drafts d_0..d_{j-1}, so its output history is output_ids + d_0..d_{j-1}:

        row:      0            1              2                  ...  m-1
        history:  prompt+out   prompt+out+d0  prompt+out+d0 d1   ...  prompt+out+d0..d_{m-2}

    `draft_ids` holds m-1 or m tokens (a trailing one is not seen by any row). The drafter uses the same
    rule with m=1 for each draft step.
    """
    if not params.has_penalties:
        return logits
    m, vocab_size = logits.shape
    assert len(draft_ids) >= m - 1, f"{m} rows need {m - 1} draft tokens, got {len(draft_ids)}"
    drafts = torch.as_tensor(list(draft_ids[: m - 1]), dtype=torch.long, device=logits.device)
    draft_counts = F.one_hot(drafts, vocab_size).cumsum(0)  # [m-1, V]: row j counts d_0..d_j
    draft_counts = torch.cat([draft_counts.new_zeros(1, vocab_size), draft_counts])  # [m, V]: row j counts d_0..d_{j-1}
    out = token_counts(output_ids, vocab_size, logits.device) + draft_counts  # [m, V]
    prompt = token_counts(prompt_ids, vocab_size, logits.device)
    return penalize(logits, (prompt + out) > 0, out, params)


# ----------------------------------------------------------------------------------------------
# Logit bias and constraints (on raw logits: bias before the penalties, the constraint's mask after them)
# ----------------------------------------------------------------------------------------------


def apply_logit_bias(logits: torch.Tensor, logit_bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's logit_bias: each (token, bias) added to that token's logit in every row (float32)."""
    if not logit_bias:
        return logits
    ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long, device=logits.device)
    bias = torch.tensor([b for _, b in logit_bias], dtype=torch.float32, device=logits.device)
    logits = logits.float().clone()
    logits[:, ids] += bias
    return logits


def allowed_tokens(words: torch.Tensor | np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [n, vocab_size] from int32 bitmask words [n, W] (bit i of word w: token 32 w + i), unpacked by numpy's
    C loop (shifting 32 int32 copies in torch cost ~1 ms a row of Qwen's 152k tokens)."""
    array = np.ascontiguousarray(words.numpy() if isinstance(words, torch.Tensor) else words, dtype=np.int32)
    bits = np.unpackbits(array.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).bool()


SUPPORT_SHARE = 0.25  # a row narrowed to its support (a sampled draft, a round: contracts.on_support) up to this share


def allowed_ids(allowed: np.ndarray, vocab_size: int, most: float = SUPPORT_SHARE,
                also: Sequence[int] = ()) -> torch.Tensor | None:
    """The token ids the bitmask words allow, ascending: one row's [W], or any of n rows' [n, W] (their union), with
    the ids `also` added; None where they are over `most` of the vocabulary (a wide row, cheaper dense). Only the
    nonzero words are unpacked: a JSON row allows a few hundred of Qwen's 152k tokens, ~150 of its 4,748 words, and
    unpacking those costs ~1% of unpacking the row (a draft step paid the whole row's unpacking and nonzero, ~10% of
    its own forward, on an AMD EPYC)."""
    words = np.asarray(allowed, dtype=np.int32)
    if words.ndim == 2:
        words = np.bitwise_or.reduce(words, axis=0)
    if int(np.bitwise_count(words.view(np.uint32)).sum()) > most * vocab_size:  # wide: nothing unpacked
        return None
    nonzero = np.flatnonzero(words)
    bits = np.unpackbits(np.ascontiguousarray(words[nonzero]).view(np.uint8).reshape(-1, 4), axis=-1,
                         bitorder="little").astype(bool)
    ids = (nonzero[:, None].astype(np.int64) * 32 + np.arange(32))[bits]
    ids = ids[ids < vocab_size]
    if len(also):  # a few drafts: sorted in where they are missing
        extra = np.setdiff1d(np.asarray(also, dtype=np.int64), ids, assume_unique=False)
        ids = np.sort(np.concatenate([ids, extra])) if len(extra) else ids
    return torch.from_numpy(ids) if len(ids) <= most * vocab_size else None


def sample_on_support(logits: torch.Tensor, ids: torch.Tensor, params: SamplingParams, seed: int, position: int,
                      stream: Stream, round_start: int | None = None) -> tuple[int, torch.Tensor]:
    """A sampled row [V] whose constraint allows only `ids`: its distribution computed on those columns (every other
    token has probability 0 whatever the transform: temperature, top-k, top-p and min-p see the same nonzero
    logits), the token drawn with the request's uniform, and the distribution scattered back to [V] float32 (what
    was sampled from, exactly: the verifier's q). On JSON a row allows a few hundred of Qwen's 152k tokens: a draft
    step's softmax, cumulative sum and copy run on those."""
    narrowed = transform_logits(logits[ids][None], params)[0]
    token = int(ids[sample_token(narrowed, seed, position, stream, round_start)])
    return token, torch.zeros(logits.shape[-1], dtype=narrowed.dtype).index_copy_(0, ids, narrowed)


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor | np.ndarray | None) -> torch.Tensor:
    """The constraint: every token a row's bitmask words [n, W] forbid gets -inf (its probability 0 after any
    transform; greedy's argmax never picks it)."""
    if allowed is None:
        return logits
    keep = allowed_tokens(allowed, logits.shape[-1]).to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))


def allows(allowed: np.ndarray, tokens: torch.Tensor) -> torch.Tensor:
    """bool [n]: whether row i's bitmask words allow tokens[i]."""
    ids = tokens.cpu().numpy().astype(np.int64)
    words = allowed[np.arange(len(ids)), ids // 32].astype(np.int64) & 0xFFFFFFFF
    return torch.from_numpy(((words >> (ids % 32)) & 1).astype(bool))


def allows_columns(allowed: np.ndarray, columns: torch.Tensor) -> torch.Tensor:
    """bool [n, len(columns)]: whether row i's bitmask words [n, W] allow each of the token ids `columns`."""
    ids = columns.cpu().numpy().astype(np.int64)
    words = np.asarray(allowed)[:, ids // 32].astype(np.int64) & 0xFFFFFFFF
    return torch.from_numpy(((words >> (ids % 32)) & 1).astype(bool))


def greedy_allowed(logits: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """Logits whose every row's argmax is the constrained argmax: a row whose own argmax the constraint allows is
    left as it is (the first maximum among the allowed tokens is then that one), the others masked. Greedy rounds read
    one argmax a row, and a model writing JSON mostly picks allowed tokens, so most rows cost one bit test."""
    off = ~allows(allowed, argmax_rows(logits))
    if not bool(off.any()):
        return logits
    rows = off.nonzero().flatten()
    logits = logits.clone()
    logits[rows] = apply_allowed(logits[rows], allowed[rows.numpy()])
    return logits


# ----------------------------------------------------------------------------------------------
# Transform: temperature, top-k, top-p, min-p  ->  probabilities
# ----------------------------------------------------------------------------------------------


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over its last dimension, the token plain greedy decoding takes: the first maximum (ties ->
    the lowest token id; a NaN counts as the maximum), the same index `torch.argmax` gives. Through
    `torch.max(dim)`, which returns that index too at about a third of the CPU argmax kernel's cost; greedy rounds
    and draft steps take one per row they read (docs/forward.md, "The greedy token: argmax rows")."""
    return logits.max(-1).indices


def transform_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Penalized logits [n,V] -> probs [n,V] float32, the same function for target (p) and draft (q).

    Order as in HF generate: temperature, top-k, top-p, min-p. Temperature 0 is greedy: a one-hot at
    argmax (ties -> lowest token id, as torch.argmax). Top-k keeps ties with the k-th logit; top-p keeps
    the smallest set of most likely tokens whose mass reaches top_p (at least one); min-p keeps tokens
    with prob >= min_p * max prob.
    """
    vocab_size = logits.shape[-1]
    if params.is_greedy:
        return F.one_hot(argmax_rows(logits), vocab_size).float()
    return transformed_logits(logits, params).softmax(-1)


def transformed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A sampled request's logits [n,V] after temperature, top-k, top-p and min-p (float32, -inf for the tokens they
    drop): `transform_logits` is their softmax."""
    assert not params.is_greedy, "temperature 0 has no distribution to transform"
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(top_p_drop(logits, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def top_p_drop(logits: torch.Tensor, top_p: float, first_candidates: int = 64) -> torch.Tensor:
    """bool [n,V]: the tokens top-p drops from each row of `logits` [n,V] (float32, -inf for tokens already out).

    A row keeps its most likely tokens down to the first whose mass (with every more likely one's) reaches
    top_p, and every token tied with that one: the rule of top-k's ties, so the set does not depend on how a
    sort orders equal values. The masses are float64 sums in descending order over `torch.topk`'s candidates
    (64, then 4x as many for rows whose candidates hold less than top_p, up to the vocabulary), not a sort of the
    whole vocabulary: a row's set depends only on the row (tests/verifier_service/test_sampling.py).
    """
    probs = logits.double().softmax(-1)
    vocab_size = probs.shape[-1]
    width = min(vocab_size, first_candidates)
    while True:
        ranked = torch.topk(probs, width, dim=-1).values  # descending
        mass = ranked.cumsum(-1)
        if width == vocab_size or bool((mass[..., -1] >= top_p).all()):
            break
        width = min(vocab_size, width * 4)
    first_reaching = (mass < top_p).sum(-1, keepdim=True).clamp(max=width - 1)  # its rank in each row
    return probs < ranked.gather(-1, first_reaching)


# ----------------------------------------------------------------------------------------------
# Seeded sampling
# ----------------------------------------------------------------------------------------------


def request_generator(seed: int, position: int, stream: Stream, round_start: int | None = None) -> torch.Generator:
    """A CPU generator seeded by a hash of (seed, position, stream[, round_start]): one independent stream per draw.

    `round_start` (the position of the round's first draft) keys the draws a round may look at beyond the tokens it
    emits: block verification tests every prefix of the chain (its accept uniforms) and its verdict depends on every
    draft (their draft uniforms), so a later round drafting and testing the same positions must draw afresh; a draw
    keyed by position alone would be conditioned on the earlier round's verdict (u_i > h_i is known for every prefix
    longer than the kept one)."""
    assert stream in STREAMS, f"unknown stream {stream!r}; known: {STREAMS}"
    key = f"{seed}:{position}:{stream}" + ("" if round_start is None else f"@{round_start}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits
    return generator


def request_uniforms(seed: int, first_position: int, count: int, stream: Stream,
                     round_start: int | None = None) -> torch.Tensor:
    """float64 [count]: the uniform u in [0, 1) of `stream` at positions first_position .. first_position+count-1
    (of the round starting at `round_start`, for the draws keyed by round: `request_generator`)."""
    draws = [
        torch.rand((), dtype=torch.float64, generator=request_generator(seed, first_position + i, stream, round_start))
        for i in range(count)
    ]
    return torch.stack(draws) if draws else torch.empty(0, dtype=torch.float64)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: token_i = min{v : sum_{w<=v} probs_i[w] > u_i * sum(probs_i)}; probs [n,V], u [n] -> [n].

    `probs` need not be normalized. A token of probability 0 is never returned.
    """
    cdf = probs.double().cumsum(-1)
    target = u.to(cdf.device, torch.float64) * cdf[..., -1]
    token = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    vocab_ids = torch.arange(probs.shape[-1], device=probs.device)
    last_positive = torch.where(probs > 0, vocab_ids, 0).amax(-1)  # guards u * total rounding up to total
    return torch.minimum(token, last_positive)


def sample_token(probs: torch.Tensor, seed: int, position: int, stream: Stream, round_start: int | None = None) -> int:
    """Draw one token from probs [V] with the request's uniform of `stream` at `position` (of `round_start`'s round)."""
    u = request_uniforms(seed, position, 1, stream, round_start)
    return int(sample_with_uniforms(probs.unsqueeze(0), u)[0])
