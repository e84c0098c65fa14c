"""Tests of the acceptance contracts: exactness (statistical), greedy and typical (deterministic), seeding.

Statistical method (every exactness test below):
  Pearson's chi-square goodness-of-fit test of an empirical token distribution against the exact
  target, at alpha = 0.001 per check (the chance a correct implementation fails one check, for a
  random seed). The p-value is the chi-square survival function Q(df/2, X^2/2), computed with
  torch.special.gammaincc (no scipy). A token observed where the target has probability 0 fails at once.

Sample size: N = 50,000 rounds per case. For any alternative pi_1 with total-variation distance
delta from the target pi_0 (on its support), the noncentrality is
  lambda = N * sum_v (pi_1(v) - pi_0(v))^2 / pi_0(v) >= N * (sum_v |pi_1(v) - pi_0(v)|)^2 = 4 N delta^2
(Cauchy-Schwarz), so delta = 0.02 gives lambda >= 80. The power of the test is then >= 0.999 for a
single token (V = 6, df = 5, critical value 20.5) and >= 0.997 for a pair of tokens (df = 35,
critical value 66.6), from the noncentral chi-square distribution (checked by simulation).
The smallest expected cell count is above 5, so the chi-square approximation holds.

Each case runs up to k + 3 checks; over all 15 cases that is ~75 checks, so for random seeds the
family-wise error rate is at most ~7.5% (Bonferroni). The generators are seeded, so each run is
deterministic: a failure is reproducible, not a flake. Power checks at the end show the same
checks reject wrong implementations.

Setting: V = 6 and per-position distributions p_t, q_t that are fixed (not conditioned on history),
so plain sampling from p emits token t ~ p_t independently of the earlier tokens. Drafts are sampled
the way a drafter does, x_t ~ q_t with `sample_with_uniforms`, and generation runs round after
round (a round that stops early is followed by the next round at the next position) until every
sequence has k + 1 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve_types.api import Contract, SamplingParams
from specserve_types.round_messages import VerifyItem
from verifier_service import contracts
from verifier_service.contracts import (
    block_accept,
    exact_accept,
    greedy_accept,
    residual_distribution,
    verify_exact,
    verify_greedy,
    verify_typical,
)
from verifier_service.sampling import request_uniforms, sample_with_uniforms, transform_logits
from verifier_service.worker import decide

V = 6
N = 50_000
ALPHA = 1e-3
POSITIONS = 8


MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one (Pearson's approximation needs it)


def chi_square_pvalue(tokens: torch.Tensor, target: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of integer samples `tokens` against probabilities `target` (flat).

    A sample where the target is 0 fails at once (p-value 0). Cells expected fewer than MIN_EXPECTED times are pooled
    into one cell: the statistic's chi-square law holds only for cells of enough expected counts, and one sample in
    a cell expected 0.01 times would add ~100 to it (a correct sampler then failed far more often than alpha)."""
    counts = torch.bincount(tokens.flatten(), minlength=target.numel()).double()
    target = target.flatten().double()
    support = target > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = target[support] / target[support].sum() * counts.sum()
    counts = counts[support]
    sparse = expected < MIN_EXPECTED
    if sparse.sum() > 1:
        expected = torch.cat([expected[~sparse], expected[sparse].sum().view(1)])
        counts = torch.cat([counts[~sparse], counts[sparse].sum().view(1)])
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = int(expected.numel()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def _rows(seed: int, zero_at: list[list[int]]) -> torch.Tensor:
    """POSITIONS distributions over V tokens, bounded away from 0 except at `zero_at[t]`."""
    weights = torch.rand(POSITIONS, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    for t, zeros in enumerate(zero_at):
        weights[t, zeros] = 0.0
    return weights / weights.sum(-1, keepdim=True)


P_PARTIAL = _rows(1, [[t % V] for t in range(POSITIONS)])
Q_PARTIAL = _rows(2, [[(t + 1) % V, (t + 3) % V] for t in range(POSITIONS)])
P_HIGH = _rows(3, [[0, 1, 2]] * POSITIONS)  # support {3, 4, 5}
Q_LOW = _rows(4, [[3, 4, 5]] * POSITIONS)  # support {0, 1, 2}
LATE = 2  # the position where "late_rejection" has disjoint p and q

SCENARIOS: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
    "p_equals_q": (P_PARTIAL, P_PARTIAL),
    "partial_overlap": (P_PARTIAL, Q_PARTIAL),
    "disjoint": (P_HIGH, Q_LOW),
    "late_rejection": (
        torch.cat([P_PARTIAL[:LATE], P_HIGH[LATE : LATE + 1], P_PARTIAL[LATE + 1 :]]),
        torch.cat([P_PARTIAL[:LATE], Q_LOW[LATE : LATE + 1], Q_PARTIAL[LATE + 1 :]]),
    ),
    "point_mass": (P_PARTIAL, None),  # n-gram drafts: x_t = POINT_MASS_DRAFTS[t], q = None
}
POINT_MASS_DRAFTS = torch.tensor([2, 1, 5, 3, 1, 4, 2, 0])  # P_PARTIAL[t] is 0 at t % V: the draft at t = 1 always fails


def generate(
    p_rows: torch.Tensor, q_rows: torch.Tensor | None, k: int, length: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run N sequences round by round with `exact_accept` until each has `length` tokens.

    Returns (tokens [N, length], accepted_len of each sequence's first round [N]).
    """
    tokens = torch.full((N, length), -1, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    first_accepted_len = torch.full((N,), -1, dtype=torch.long)
    while bool((filled < length).any()):
        for t in filled[filled < length].unique().tolist():
            rows = (filled == t).nonzero().squeeze(-1)
            B = rows.numel()
            if q_rows is None:
                x, q = POINT_MASS_DRAFTS[t : t + k].expand(B, k), None
            else:
                q = q_rows[t : t + k].expand(B, k, V)
                x = torch.stack([sample_with_uniforms(q[:, i], torch.rand(B, generator=generator)) for i in range(k)], 1)
            p = p_rows[t : t + k + 1].expand(B, k + 1, V)
            u = torch.rand(B, k, generator=generator, dtype=torch.float64)
            u_next = torch.rand(B, k + 1, generator=generator, dtype=torch.float64)
            accepted_len, next_token = exact_accept(x.reshape(B, k), q, p, u, u_next)
            if t == 0:
                first_accepted_len[rows] = accepted_len
            emitted = torch.cat([x.reshape(B, k), torch.zeros(B, 1, dtype=torch.long)], 1)
            emitted[torch.arange(B), accepted_len] = next_token
            for j in range(min(k + 1, length - t)):
                keep = accepted_len >= j
                tokens[rows[keep], t + j] = emitted[keep, j]
            filled[rows] = t + accepted_len + 1
    return tokens, first_accepted_len


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_exact_emits_the_target_distribution(scenario: str, k: int) -> None:
    """Each emitted token t ~ p_t; the first two jointly ~ p_1 x p_2; after an accepted x_1, token 2 ~ p_2.

    Chi-square at alpha = 0.001 per check, N = 50,000 (power >= 0.997 against a 0.02 TV shift; module docstring).
    """
    p_rows, q_rows = SCENARIOS[scenario]
    tokens, first_accepted_len = generate(p_rows, q_rows, k, k + 1, torch.Generator().manual_seed(17 + k))

    if scenario == "p_equals_q":
        assert bool((first_accepted_len == k).all()), "p == q accepts every draft"
    if scenario == "disjoint":
        assert bool((first_accepted_len == 0).all()), "a draft outside p's support is always rejected"
    if scenario == "point_mass":
        assert bool((first_accepted_len <= 1).all()) and bool((first_accepted_len == 1).any())
    if scenario == "late_rejection":
        assert bool((first_accepted_len == min(LATE, k)).all())

    for t in range(k + 1):
        assert chi_square_pvalue(tokens[:, t], p_rows[t]) > ALPHA, f"token {t + 1} is not ~ p_{t + 1}"
    pair = tokens[:, 0] * V + tokens[:, 1]
    assert chi_square_pvalue(pair, torch.outer(p_rows[0], p_rows[1])) > ALPHA, "tokens 1, 2 not ~ p_1 x p_2"
    after_accept = first_accepted_len >= 1
    if int(after_accept.sum()) >= 1000:
        assert chi_square_pvalue(tokens[after_accept, 1], p_rows[1]) > ALPHA, "token 2 | x_1 accepted not ~ p_2"


def test_power_correction_from_p_instead_of_residual_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails a wrong implementation that samples the correction from p instead of r.

    Its first token follows min(p, q) + (1 - sum min(p, q)) p, which is >= 0.02 in TV from p_1 here, where the
    check has power >= 0.999; a p-value above 0.001 would mean the test cannot tell.
    """
    p1, q1 = P_PARTIAL[0], Q_PARTIAL[0]
    overlap = torch.minimum(p1, q1)
    wrong = overlap + (1 - overlap.sum()) * p1
    assert 0.5 * float((wrong - p1).abs().sum()) >= 0.02
    monkeypatch.setattr(contracts, "residual_distribution", lambda p, q: p)
    tokens, _ = generate(P_PARTIAL, Q_PARTIAL, 1, 1, torch.Generator().manual_seed(5))
    assert chi_square_pvalue(tokens[:, 0], p1) < ALPHA


def test_power_drafts_not_sampled_from_the_q_passed_in_are_rejected() -> None:
    """An interface bug the engine could make: drafts sampled at temperature 1, q passed at temperature 0.7.

    The exact contract needs x ~ q for the very q it is given. Here the first token's exact distribution,
    q_s(v) min(1, p(v)/q_c(v)) + (1 - sum_x q_s(x) min(1, p(x)/q_c(x))) r_c(v), is 0.021 in TV from p_1: at the
    0.02 design limit, where the check has power >= 0.999. The check must reject it.
    """
    logits = torch.log(Q_PARTIAL[:1].float())
    q_sampled = transform_logits(logits, SamplingParams(temperature=1.0))[0]
    q_claimed = transform_logits(logits, SamplingParams(temperature=0.7))[0]
    p1 = P_PARTIAL[0].float()
    accept = q_sampled * torch.clamp(p1 / q_claimed, max=1)
    wrong = accept + (1 - accept.sum()) * residual_distribution(p1, q_claimed)
    assert 0.5 * float((wrong - p1).abs().sum()) >= 0.02

    generator = torch.Generator().manual_seed(6)
    x = sample_with_uniforms(q_sampled.expand(N, V), torch.rand(N, generator=generator)).view(N, 1)
    u, u_next = torch.rand(N, 1, generator=generator), torch.rand(N, 2, generator=generator)
    accepted_len, next_token = exact_accept(x, q_claimed.expand(N, 1, V), P_PARTIAL[:2].expand(N, 2, V), u, u_next)
    first = torch.where(accepted_len >= 1, x[:, 0], next_token)
    assert chi_square_pvalue(first, p1) < ALPHA


def test_verify_exact_seeded_per_request_path_emits_p_1() -> None:
    """The per-request path with hashed seeds: first token ~ p_1 over 10,000 requests (seeds 0..9,999).

    Chi-square at alpha = 0.001; N = 10,000 gives lambda >= 4 N delta^2 >= 49 for a TV shift >= 0.035, power >= 0.99.
    """
    p, q = P_PARTIAL[:3].float(), Q_PARTIAL[:2].float()
    first = []
    for seed in range(10_000):
        u = request_uniforms(seed, 40, 2, "draft")
        drafts = [int(sample_with_uniforms(q[i : i + 1], u[i : i + 1])[0]) for i in range(2)]
        first.append(verify_exact(drafts, q, p, seed, 40).tokens[0])
    assert chi_square_pvalue(torch.tensor(first), p[0]) > ALPHA


def test_verify_exact_is_the_core_with_the_request_uniforms() -> None:
    p, q = P_PARTIAL[:4].float(), Q_PARTIAL[:3].float()
    drafts = [1, 2, 4]
    for seed in range(50):
        verdict = verify_exact(drafts, q, p, seed, 7)
        u = request_uniforms(seed, 7, 3, "accept").view(1, 3)
        u_next = request_uniforms(seed, 7, 4, "residual").view(1, 4)
        accepted_len, next_token = exact_accept(torch.tensor([drafts]), q[None], p[None], u, u_next)
        assert (verdict.accepted_len, verdict.next_token) == (int(accepted_len), int(next_token))
        assert verdict.tokens == [*drafts[: verdict.accepted_len], verdict.next_token]
        assert verdict.contract == "exact" and verdict.proposed == 3
        assert verdict.bonus == (verdict.accepted_len == 3)


def test_exact_edge_cases() -> None:
    p = P_PARTIAL[:2].float()
    # q(x) = 0 for the drafted token: rejected, no crash, the correction comes from r = max(0, p - q) / Z.
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    verdict = verify_exact([3], q, p, seed=3, position=0)
    assert verdict.accepted_len == 0 and residual_distribution(p[0], q[0])[verdict.next_token] > 0
    # Z == 0 (p == q): the residual falls back to p.
    assert torch.equal(residual_distribution(p, p), p)
    # A float-error rejection with p ~= q: the next token still lies in p's support.
    p_tiny = P_PARTIAL[:2].clone()
    q_tiny = p_tiny[:1].clone()
    q_tiny[0, 2] += 1e-12
    q_tiny[0, 3] -= 1e-12
    u, u_next = torch.tensor([[1 - 2**-53]], dtype=torch.float64), torch.tensor([[0.999, 0.5]], dtype=torch.float64)
    accepted_len, next_token = exact_accept(torch.tensor([[2]]), q_tiny[None], p_tiny[None], u, u_next)
    assert int(accepted_len) == 0 and p_tiny[0, int(next_token)] > 0
    # k = 0 is plain decoding: the bonus from p_1.
    verdict = verify_exact([], None, p[:1], seed=3, position=9)
    assert (verdict.accepted_len, verdict.bonus, verdict.tokens) == (0, True, [verdict.next_token])
    # Point mass with p(x) = 1: always accepted.
    one_hot = torch.eye(V)[[4, 1]]
    assert verify_exact([4], None, one_hot, seed=0, position=0).tokens == [4, 1]


def test_exact_at_temperature_zero_is_greedy() -> None:
    """With one-hot p and q (temperature 0) the exact contract makes the greedy decisions."""
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        p = transform_logits(torch.randn(4, V, generator=g), greedy)
        q = transform_logits(torch.randn(3, V, generator=g), greedy)
        drafts = q.argmax(-1).tolist()
        assert verify_exact(drafts, q, p, seed=1, position=0).tokens == verify_greedy(drafts, p).tokens


def test_greedy_deterministic_cases() -> None:
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 0.0],  # argmax 1
            [2.0, 0.0, 2.0, 1.0],  # tie between 0 and 2 -> 0
            [0.0, 0.0, 0.0, 5.0],  # argmax 3
            [1.0, 0.0, 0.0, 0.0],  # bonus row: argmax 0
        ]
    )
    assert verify_greedy([1, 0, 3], logits).tokens == [1, 0, 3, 0]  # all accepted + bonus
    verdict = verify_greedy([1, 2, 3], logits)  # 2 != argmax (tie -> 0)
    assert (verdict.accepted_len, verdict.next_token, verdict.tokens, verdict.bonus) == (1, 0, [1, 0], False)
    assert verify_greedy([2, 0, 3], logits).tokens == [1]  # first position rejected
    assert verify_greedy([], logits[:1]).tokens == [1]  # k = 0
    assert verify_greedy([1, 0, 3], logits.softmax(-1)).tokens == [1, 0, 3, 0]  # probs give the same answer
    accepted_len, next_token = greedy_accept(torch.tensor([[1, 0, 3], [2, 0, 3]]), torch.stack([logits, logits]))
    assert accepted_len.tolist() == [3, 0] and next_token.tolist() == [0, 1]


def test_typical_threshold_and_label() -> None:
    """Accept while p(x) > min(0.09, 0.3 exp(-H(p))); then the next token ~ p at the first failing position."""
    flat = torch.full((V,), 1.0 / V)  # H = log 6: threshold = min(0.09, 0.3 / 6 = 0.05) = 0.05
    peaked = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])  # H ~ 0.49: threshold = min(0.09, 0.18) = 0.09
    p = torch.stack([flat, peaked, peaked, peaked])
    verdict = verify_typical([3, 0, 1], p, seed=0, position=0)
    assert verdict.accepted_len == 2 and verdict.contract == "typical"  # 1/6 > 0.05; 0.9 > 0.09; 0.02 < 0.09
    assert verdict.tokens[:2] == [3, 0]
    assert verify_typical([3, 0, 0], p, seed=0, position=0).bonus
    # H(wide) ~ 1.42: threshold = min(0.09, 0.3 * 0.241 = 0.072); draft 3 (0.04) fails, the next token ~ wide, not p_2.
    wide = torch.tensor([0.3, 0.3, 0.3, 0.04, 0.03, 0.03])
    p_2 = torch.eye(V)[5]
    nexts = {verify_typical([3], torch.stack([wide, p_2]), seed=s, position=5).next_token for s in range(300)}
    assert {0, 1, 2} <= nexts
    one_hot = transform_logits(torch.randn(3, V, generator=torch.Generator().manual_seed(2)), SamplingParams())
    drafts = one_hot.argmax(-1).tolist()[:2]
    assert verify_typical(drafts, one_hot, seed=0, position=0).tokens == verify_greedy(drafts, one_hot).tokens


def _item(contract: Contract, seed: int, k: int, temperature: float) -> tuple[VerifyItem, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, V, generator=g)
    q = torch.softmax(torch.randn(k, V, generator=g), -1)
    drafts = [int(sample_with_uniforms(q[i : i + 1], request_uniforms(seed, 11 + i, 1, "draft"))[0]) for i in range(k)]
    item = VerifyItem(f"r{seed}", input_ids=[1, 2], draft_ids=drafts, draft_probs=q.numpy(), past_len=9,
                      block_table=[0], slot_mapping=list(range(2 + k)), sampling=SamplingParams(temperature=temperature),
                      contract=contract, seed=seed, position=11)
    return item, logits


@pytest.mark.parametrize(("contract", "temperature"), [("exact", 1.0), ("greedy", 0.0), ("typical", 0.8),
                                                       ("exact", 0.0)])
def test_decide_applies_the_items_contract(contract: Contract, temperature: float) -> None:
    """The production path (verifier_service.worker.decide) gives what the contract itself gives for the
    transformed probabilities, at the first draft position past_len + len(input_ids)."""
    for seed in range(20):
        item, logits = _item(contract, seed, k=3, temperature=temperature)
        verdict = decide(item, logits)
        if temperature == 0.0:
            expected = verify_greedy(item.draft_ids, logits)
            assert verdict.tokens == expected.tokens and verdict.accepted_len == expected.accepted_len
            assert verdict.contract == contract
            continue
        p = transform_logits(logits, item.sampling)
        if contract == "exact":
            expected = verify_exact(item.draft_ids, torch.from_numpy(item.draft_probs), p, seed, 11)
        else:
            expected = verify_typical(item.draft_ids, p, seed, 11)
        assert verdict == expected


def test_inject_bias_draws_the_correction_from_p_not_the_residual() -> None:
    """The negative control of `specserve check exact` (off by default): after a rejected draft the next token
    comes from p itself, so it may repeat the rejected draft, which the residual never does."""
    x = torch.tensor([[0]])
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    u, u_next = torch.tensor([[0.9]]), torch.tensor([[0.1, 0.5]])  # 0.9 * q(x) >= p(x): rejected
    assert [int(t) for t in exact_accept(x, None, p, u, u_next)] == [0, 1]  # residual (p - q)+: token 1 only
    assert [int(t) for t in exact_accept(x, None, p, u, u_next, inject_bias=True)] == [0, 0]  # from p: 0.1 -> 0


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_a_small_support_is_verified_on_its_columns_alone(rule: str, point_mass: bool) -> None:
    """on_support: a round whose p and q live on 60 of 4,000 tokens (a constraint's mask, top-k) gives the verdict of
    the whole round, for every seed; a dense round is left as it is."""
    from verifier_service.contracts import on_support

    g = torch.Generator().manual_seed(5)
    vocab, k = 4000, 4
    columns = torch.randperm(vocab, generator=g)[:60]
    p = torch.zeros(k + 1, vocab)
    p[:, columns] = torch.rand(k + 1, 60, generator=g) ** 3
    p /= p.sum(-1, keepdim=True)
    q = None
    if not point_mass:
        q = torch.zeros(k, vocab)
        q[:, columns] = torch.rand(k, 60, generator=g) ** 3
        q /= q.sum(-1, keepdim=True)
    drafts = [int(columns[i]) for i in (0, 3, 7, 11)]
    for seed in range(300):
        narrowed = verify_exact(drafts, q, p, seed, 17, rule=rule)
        x = torch.tensor([drafts])
        u = request_uniforms(seed, 17, k, "accept", round_start=17).view(1, k)
        u_next = request_uniforms(seed, 17, k + 1, "residual").view(1, k + 1)
        accept = block_accept if rule == "block" else exact_accept
        n, token = accept(x, None if q is None else q.unsqueeze(0), p.unsqueeze(0), u, u_next)
        assert (narrowed.accepted_len, narrowed.next_token) == (int(n[0]), int(token[0])), seed
    dense = torch.softmax(torch.randn(k + 1, vocab, generator=g), -1)
    assert on_support(torch.tensor([drafts]), None, dense)[3] is None


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("drafter", ["constrained", "free", "point mass"])
@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}])
def test_a_constrained_round_is_decided_on_its_allowed_columns(rule: str, drafter: str, extra: dict) -> None:
    """decide on a constrained exact round: the logits narrowed to the tokens the mask allows in any row (and the
    drafts), each row masked, transformed and judged there, give the verdict of the dense path (every row masked on
    the whole vocabulary, then `verify_exact`) for every seed; q (the drafter's, under the same constraint or
    drafting freely) may put mass outside those columns, where p = 0 in every row."""
    from verifier_service.sampling import apply_allowed

    g = torch.Generator().manual_seed(9)
    vocab, k = 4096, 3
    rows = [set(torch.randperm(vocab, generator=g)[:40].tolist()) for _ in range(k + 1)]
    words = np.zeros((k + 1, vocab // 32), dtype=np.uint32)
    for row, tokens in enumerate(rows):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    words = words.view(np.int32)
    params = SamplingParams(temperature=0.8, **extra)
    for seed in range(60):
        g = torch.Generator().manual_seed(100 + seed)
        logits = torch.randn(k + 1, vocab, generator=g) * 2
        q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
        if drafter == "constrained":
            q = transform_logits(apply_allowed(torch.randn(k, vocab, generator=g), words[:k]), params)
        drafts = [int(sample_with_uniforms(q[i:i + 1], request_uniforms(seed, 11 + i, 1, "draft"))[0])
                  for i in range(k)]
        item = VerifyItem(f"r{seed}", input_ids=[1, 2], draft_ids=drafts,
                          draft_probs=None if drafter == "point mass" else q.numpy(), past_len=9, block_table=[0],
                          slot_mapping=list(range(2 + k)), sampling=params, contract="exact", seed=seed, position=11,
                          exact_rule=rule, allowed=words)
        p = transform_logits(apply_allowed(logits, words), params)
        dense = verify_exact(drafts, None if drafter == "point mass" else q, p, seed, 11, rule=rule)
        assert decide(item, logits) == dense, seed
        assert dense.next_token in rows[dense.accepted_len]
