"""Tests of the sampling transform (penalties, temperature, top-k, top-p, min-p), inverse-CDF sampling and seeding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specserve_types.api import SamplingParams
from verifier_service.sampling import (
    Stream,
    apply_penalties,
    argmax_rows,
    penalized_logits_for_positions,
    request_generator,
    request_uniforms,
    sample_token,
    sample_with_uniforms,
    top_p_drop,
    transform_logits,
)

V = 12


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


# ---------------------------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(2)
    prompts, outputs = [[1, 2, 2, 7], [0, 11]], [[3, 1], [5, 5, 5, 9]]
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3)
    ours = apply_penalties(logits, prompts, outputs, params)
    processor = RepetitionPenaltyLogitsProcessor(1.3)
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):  # HF: over prompt + output ids
        reference = processor(torch.tensor([prompt + output]), logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], reference)
    untouched = [v for v in range(V) if v not in {1, 2, 7, 3}]
    assert torch.equal(ours[0, untouched], logits[0, untouched])


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(logits, [[4, 4, 6]], [[6, 8, 8, 8]], params)
    expected = logits.clone()
    expected[0, 6] -= 0.5 + 0.25 * 1  # prompt occurrences of 6 do not count
    expected[0, 8] -= 0.5 + 0.25 * 3
    torch.testing.assert_close(ours, expected)  # token 4 (prompt only) is not penalized


def test_no_penalties_is_the_identity() -> None:
    logits = _logits(3)
    assert apply_penalties(logits, [[1]] * 3, [[2]] * 3, SamplingParams()) is logits
    assert penalized_logits_for_positions(logits, [1], [2], [3, 4], SamplingParams()) is logits


@pytest.mark.parametrize(("n_drafts", "m"), [(0, 1), (3, 4), (4, 4), (4, 2)])
def test_row_j_sees_committed_tokens_plus_the_drafts_before_it(n_drafts: int, m: int) -> None:
    """Row j of a verify forward is penalized exactly as plain decoding would after drafts d_0..d_{j-1}."""
    prompt, output, drafts = [1, 2, 3], [3, 5], [5, 7, 5, 9][:n_drafts]
    params = SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    logits = _logits(m, seed=4)
    rows = penalized_logits_for_positions(logits, prompt, output, drafts, params)
    for j in range(m):
        plain = apply_penalties(logits[j : j + 1], [prompt], [output + drafts[:j]], params)
        torch.testing.assert_close(rows[j : j + 1], plain)
    if m > 1:
        assert not torch.equal(rows[0], rows[1])  # d_0 = 5 is penalized from row 1 on


# ---------------------------------------------------------------------------------------------- transform


def _hf_transform(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores.softmax(-1)


def _allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The allowed set of one row, by brute force over tokens sorted by probability (no ties in the test logits)."""
    order = logits.argsort(descending=True).tolist()
    allowed = order[: params.top_k] if params.top_k else order
    probs = (logits[allowed] / params.temperature).softmax(-1)
    mass, kept = 0.0, []
    for token, prob in zip(allowed, probs.tolist(), strict=True):
        kept.append((token, prob))
        mass += prob
        if mass >= params.top_p:
            break
    top = max(prob for _, prob in kept)
    return {token for token, prob in kept if prob >= params.min_p * top}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.1),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_filters_keep_the_allowed_set_and_samples_stay_in_it(params: SamplingParams) -> None:
    logits = _logits(8, seed=1)
    probs = transform_logits(logits, params)
    torch.testing.assert_close(probs, _hf_transform(logits, params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))
    for row in range(8):
        allowed = _allowed(logits[row], params)
        assert set((probs[row] > 0).nonzero().flatten().tolist()) == allowed
        u = torch.rand(5_000, generator=torch.Generator().manual_seed(row), dtype=torch.float64)
        assert set(sample_with_uniforms(probs[row].expand(5_000, V), u).tolist()) <= allowed


def test_transform_is_one_function_of_the_row_for_p_and_q() -> None:
    """The same row gives the same probs whether it is a target row or a draft row, alone or in any batch."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
    target, draft = _logits(4, seed=2), _logits(3, seed=3)
    draft[1] = target[2]
    p, q = transform_logits(target, params), transform_logits(draft, params)
    assert torch.equal(p[2], q[1])
    assert torch.equal(transform_logits(target[2:3], params)[0], p[2])


def _kept_by_brute_force(row: torch.Tensor, top_p: float) -> set[int]:
    """Top-p's kept set of one row by the definition: most likely first, down to the first token whose mass with
    the ones before reaches top_p, and every token tied with it (float64 sums, as the rule states)."""
    probs = row.double().softmax(-1)
    mass, last = 0.0, None
    for token in probs.argsort(descending=True, stable=True).tolist():
        mass += float(probs[token])
        last = token
        if mass >= top_p:
            break
    return set((probs >= probs[last]).nonzero().flatten().tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_over_a_large_vocabulary_keeps_the_rule_s_set_alone_or_in_any_batch(top_p: float) -> None:
    """Rows whose nucleus needs more than the first 64 candidates (flat rows) beside peaked ones: each row's set is
    the rule's, and the same alone as in the batch (the candidate count grows for the batch, not the row)."""
    vocab = 4096
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(3, vocab, generator=g) * 0.1
    peaked = torch.randn(3, vocab, generator=g) * 6
    logits = torch.cat([peaked, flat])
    dropped = top_p_drop(logits, top_p)
    for row in range(logits.shape[0]):
        kept = set((~dropped[row]).nonzero().flatten().tolist())
        assert kept == _kept_by_brute_force(logits[row], top_p)
        assert torch.equal(top_p_drop(logits[row : row + 1], top_p)[0], dropped[row])
    assert (~dropped[3:]).sum(-1).min() > 64  # the flat rows did need the wider candidates


def test_top_p_keeps_every_token_tied_with_the_last_one_it_needs() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]))
    assert (~top_p_drop(logits, 0.5)).nonzero()[:, 1].tolist() == [0, 1, 2]  # 0.4 + 0.2 reaches 0.5: both 0.2s
    assert (~top_p_drop(logits, 0.4)).nonzero()[:, 1].tolist() == [0]
    assert (~top_p_drop(logits, 1.0 - 1e-9)).nonzero()[:, 1].tolist() == [0, 1, 2, 3, 4]


def test_temperature_zero_is_a_one_hot_at_the_lowest_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    probs = transform_logits(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.5))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 49152, 151936])
def test_argmax_rows_is_torch_argmax_with_ties_nan_and_infinities(vocab: int, dtype: torch.dtype) -> None:
    """The greedy token (argmax_rows, through torch.max) is torch.argmax's on every row: the first maximum where
    values tie (few distinct values: ties everywhere), a NaN counted as the maximum, rows all -inf, strided rows."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-2, 3, (6, vocab), generator=gen).to(dtype)
    x[1] = float("-inf")
    x[2, vocab // 2] = float("nan")
    x[3, -1] = float("inf")
    for rows in (x, x[1:], x[::2], x[4]):
        assert torch.equal(argmax_rows(rows), rows.argmax(-1))


# ---------------------------------------------------------------------------------------------- sampling and seeds


def test_inverse_cdf_never_returns_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    for u in (0.0, 0.5, 1 - 2**-53):
        tokens = sample_with_uniforms(probs, torch.tensor([u, u], dtype=torch.float64)).tolist()
        assert tokens[0] in (1, 3) and tokens[1] == 2
    assert sample_with_uniforms(probs[:1], torch.tensor([0.49])).item() == 1
    assert sample_with_uniforms(probs[:1], torch.tensor([0.51])).item() == 3


def test_inverse_cdf_sampling_follows_probs() -> None:
    """Chi-square goodness of fit at alpha = 0.001 (N = 50,000: power >= 0.999 against a 0.02 TV shift, df = 5)."""
    probs = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    u = torch.rand(50_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(sample_with_uniforms(probs.expand(50_000, 6), u), minlength=6).double()
    expected = probs.double() * 50_000
    statistic = ((counts - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64), statistic / 2)
    assert p_value > 1e-3


def test_seeded_draws_depend_only_on_seed_position_and_stream() -> None:
    def draw(seed: int, position: int, stream: Stream) -> float:
        return torch.rand(1, generator=request_generator(seed, position, stream)).item()

    assert draw(7, 3, "accept") == draw(7, 3, "accept")
    assert len({draw(7, 3, "accept"), draw(7, 4, "accept"), draw(8, 3, "accept"), draw(7, 3, "residual")}) == 4
    window = request_uniforms(7, 10, 4, "draft")  # draws are keyed by position, not by how many came before
    assert torch.equal(window[2:], request_uniforms(7, 12, 2, "draft"))
    assert request_uniforms(7, 10, 0, "draft").numel() == 0
    probs = torch.softmax(_logits(1)[0], -1)
    assert sample_token(probs, 7, 12, "draft") == sample_with_uniforms(probs[None], window[2:3]).item()
    with pytest.raises(AssertionError):
        request_generator(7, 3, "bonus")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- logit bias and the constraint's mask
def _words(allowed_rows: list[set[int]], vocab: int) -> np.ndarray:
    words = np.zeros((len(allowed_rows), (vocab + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed_rows):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    return words.view(np.int32)


def test_the_mask_keeps_exactly_the_allowed_tokens_and_the_bias_adds() -> None:
    from verifier_service.sampling import allowed_tokens, apply_allowed, apply_logit_bias

    vocab = 70  # three words, the last one partial
    rows = [{0, 31, 32, 69}, {5}, set(range(vocab))]
    keep = allowed_tokens(_words(rows, vocab), vocab)
    assert [set(torch.nonzero(k).flatten().tolist()) for k in keep] == rows
    logits = torch.randn(3, vocab)
    masked = apply_allowed(logits, _words(rows, vocab))
    assert torch.equal(torch.isfinite(masked), keep) and torch.equal(masked[keep], logits[keep])
    biased = apply_logit_bias(logits, ((3, -100.0), (7, 2.5)))
    assert torch.equal(biased[:, 3], logits[:, 3] - 100) and torch.equal(biased[:, 7], logits[:, 7] + 2.5)
    assert torch.equal(biased[:, 4], logits[:, 4])


def test_greedy_allowed_gives_the_masked_argmax_masking_only_rows_that_need_it() -> None:
    from verifier_service.sampling import apply_allowed, greedy_allowed

    g = torch.Generator().manual_seed(3)
    vocab = 300
    for trial in range(50):
        logits = torch.randn(6, vocab, generator=g)
        logits[:, 7] = logits[:, 9] = logits.max() + 1  # ties: the lowest allowed id wins
        rows = [set(torch.randperm(vocab, generator=g)[:1 + trial].tolist()) | ({7, 9} if r % 2 else set())
                for r in range(6)]
        words = _words(rows, vocab)
        assert torch.equal(argmax_rows(greedy_allowed(logits, words)), argmax_rows(apply_allowed(logits, words)))
    logits = torch.randn(2, vocab, generator=g)
    everything = _words([set(range(vocab))] * 2, vocab)
    assert greedy_allowed(logits, everything) is logits  # no row's argmax forbidden: nothing masked, no copy


# ---------------------------------------------------------------------- a sampled row on its allowed columns
@pytest.mark.parametrize("extra", [{}, {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.05}])
def test_sample_on_support_is_the_dense_masked_distribution(extra: dict) -> None:
    """A constrained row sampled on its allowed ids: the same distribution as the dense masked row (to float32
    rounding, scattered back to the vocabulary), and with the same uniforms the same tokens (a uniform within
    rounding of a boundary aside: none in 400 draws)."""
    from verifier_service.sampling import allowed_ids, apply_allowed, sample_on_support

    vocab = 5024  # a whole number of 32-bit words
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(vocab, generator=gen) * 3
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[torch.randperm(vocab, generator=gen)[:300]] = True
    words = np.packbits(keep.numpy(), bitorder="little").view(np.int32)
    ids = allowed_ids(words, vocab)
    assert ids is not None and torch.equal(ids, keep.nonzero().flatten())
    assert allowed_ids(np.packbits(np.ones(vocab, bool), bitorder="little").view(np.int32), vocab) is None  # wide
    params = SamplingParams(temperature=0.7, **extra)
    dense = transform_logits(apply_allowed(logits[None], words[None]), params)[0]
    for seed in range(400):
        token, q = sample_on_support(logits, ids, params, seed, 11, "draft", round_start=9)
        assert token == sample_token(dense, seed, 11, "draft", round_start=9)
        assert keep[token]
    torch.testing.assert_close(q, dense, atol=1e-6, rtol=1e-5)
    assert float(q[~keep].abs().sum()) == 0.0


def test_allowed_ids_unpacks_the_union_of_rows_and_adds_the_extra_ids() -> None:
    """allowed_ids on several rows' words: the ids any row allows (bits past the vocabulary ignored), with `also`
    added, ascending; allows_columns reads each row's bits at those ids as the dense mask has them."""
    from verifier_service.sampling import allowed_ids, allowed_tokens, allows_columns

    vocab = 5000  # not a whole number of words: the last word's high bits lie past the vocabulary
    rows = [{0, 31, 32, 4999}, {7, 31, 2048}, set()]
    words = _words(rows, 5024)
    words[0, -1] |= np.int32(1 << 30)  # token 5022: past the vocabulary
    ids = allowed_ids(words, vocab, also=[17, 7])
    assert ids is not None and ids.tolist() == [0, 7, 17, 31, 32, 2048, 4999]
    assert allowed_ids(words[1], vocab).tolist() == [7, 31, 2048]  # one row
    dense = allowed_tokens(words, 5024)[:, :vocab]
    assert torch.equal(allows_columns(words, ids), dense[:, ids])
    assert allowed_ids(words, vocab, most=6 / vocab) is None  # over the share: None
