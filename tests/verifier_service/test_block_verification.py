"""Block verification (verifier_service/contracts.py `block_accept`): the exact contract's distribution on
history-dependent models, at least token-wise verification's accepted drafts, and the request path.

Statistical method: Pearson's chi-square goodness-of-fit (`chi_square_pvalue` of test_contracts.py) of the
joint distribution of the first three emitted tokens against the exact one, at alpha = 0.001 per check.
Setting: V = 4 and first-order models: the target's and the drafter's distribution at position t depend on the
token before it (p_t(. | prev), q_t(. | prev)), so a draft chain changes the distributions after it, the case
block verification's weights exist for (the contract tests' fixed rows cannot tell a wrong weight from a
right one). The joint of three tokens has 64 cells; N = 50,000 sequences give lambda >= 4 N delta^2 = 80 for a
total-variation shift delta = 0.02, power 0.978 at df = 63 (critical value 103.4; the noncentral
chi-square, simulated). Five scenarios x k = 1, 2, 3, one check each: family-wise error <= 1.5% for random seeds; the
generators are seeded, so a failure is reproducible. The power test runs the same check on a broken rule.
"""

from __future__ import annotations

import pytest
import torch

from specserve_types.api import SamplingParams
from specserve_types.round_messages import VerifyItem
from tests.verifier_service.test_contracts import chi_square_pvalue
from verifier_service import contracts
from verifier_service.contracts import block_accept, exact_accept, verify_exact
from verifier_service.sampling import request_uniforms, sample_with_uniforms, transform_logits
from verifier_service.worker import decide

V = 4
N = 50_000
ALPHA = 1e-3
LENGTH = 3
POSITIONS = LENGTH + 3
CONTEXT = 0  # the token before the first emitted one


def _tables(seed: int, zero: int | None = None, support: tuple[int, ...] | None = None) -> torch.Tensor:
    """[POSITIONS, V (prev), V] conditional distributions, bounded away from 0 except where told."""
    weights = torch.rand(POSITIONS, V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.2
    if zero is not None:  # token (prev + zero) % V impossible after prev
        for prev in range(V):
            weights[:, prev, (prev + zero) % V] = 0.0
    if support is not None:
        outside = [v for v in range(V) if v not in support]
        weights[:, :, outside] = 0.0
    return weights / weights.sum(-1, keepdim=True)


P_MARKOV = _tables(11, zero=1)
Q_MARKOV = _tables(12, zero=2)
SCENARIOS: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
    "p_equals_q": (P_MARKOV, P_MARKOV),
    "partial_overlap": (P_MARKOV, Q_MARKOV),
    "sharper_draft": (P_MARKOV, torch.softmax(4 * torch.log(P_MARKOV.clamp(min=1e-30)), -1)),
    "disjoint": (_tables(13, support=(0, 1)), _tables(14, support=(2, 3))),
    "point_mass": (P_MARKOV, None),  # n-gram-like drafts: a fixed token after each prev
}
POINT_MASS_NEXT = torch.tensor([3, 0, 1, 1])  # the deterministic draft after prev (P_MARKOV: impossible after 0)


def joint(p: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the first LENGTH tokens, flattened (index = t1 * V^2 + t2 * V + t3)."""
    first = p[0, CONTEXT]
    return (first[:, None, None] * p[1][:, :, None] * p[2][None, :, :]).flatten()


def generate(p_tab: torch.Tensor, q_tab: torch.Tensor | None, k: int, accept, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences round by round with `accept` (block_accept or exact_accept) until each has LENGTH tokens.
    Returns (tokens [N, LENGTH], accepted drafts of each sequence's first round [N])."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((N, LENGTH), -1, dtype=torch.long)
    last = torch.full((N,), CONTEXT, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    first_round = torch.full((N,), -1, dtype=torch.long)
    while bool((filled < LENGTH).any()):
        for t in filled[filled < LENGTH].unique().tolist():
            rows = (filled == t).nonzero().squeeze(-1)
            B = rows.numel()
            prev = last[rows]
            drafts, q_rows = [], []
            for i in range(k):  # the drafter's chain, each draft after the one before
                if q_tab is None:
                    drafts.append(POINT_MASS_NEXT[prev])
                else:
                    qi = q_tab[t + i][prev]
                    q_rows.append(qi)
                    drafts.append(sample_with_uniforms(qi, torch.rand(B, generator=g, dtype=torch.float64)))
                prev = drafts[-1]
            x = torch.stack(drafts, 1) if k else torch.zeros(B, 0, dtype=torch.long)
            chain = torch.cat([last[rows].unsqueeze(1), x], 1)  # the token before each scored position
            p = torch.stack([p_tab[t + i][chain[:, i]] for i in range(k + 1)], 1)
            q = torch.stack(q_rows, 1) if q_tab is not None and k else None
            u = torch.rand(B, k, generator=g, dtype=torch.float64)
            u_next = torch.rand(B, k + 1, generator=g, dtype=torch.float64)
            n, nxt = accept(x, q, p, u, u_next)
            if t == 0:
                first_round[rows] = n
            emitted = torch.cat([x, torch.zeros(B, 1, dtype=torch.long)], 1)
            emitted[torch.arange(B), n] = nxt
            for j in range(min(k + 1, LENGTH - t)):
                keep = n >= j
                tokens[rows[keep], t + j] = emitted[keep, j]
            last[rows] = nxt
            filled[rows] = t + n + 1
    return tokens, first_round


def _flat(tokens: torch.Tensor) -> torch.Tensor:
    return tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_block_verification_emits_the_targets_joint_distribution(scenario: str, k: int) -> None:
    """The first three tokens ~ the target's joint (chi-square, alpha 0.001, 64 cells, N = 50,000)."""
    p_tab, q_tab = SCENARIOS[scenario]
    tokens, first_round = generate(p_tab, q_tab, k, block_accept, seed=100 + k)
    assert bool((tokens >= 0).all())
    if scenario == "p_equals_q":
        assert bool((first_round == k).all()), "p == q accepts every draft"
    if scenario == "disjoint":
        assert bool((first_round == 0).all()), "drafts outside p's support are never accepted"
    assert chi_square_pvalue(_flat(tokens), joint(p_tab)) > ALPHA


@pytest.mark.parametrize("scenario", ["partial_overlap", "sharper_draft", "point_mass"])
def test_block_verification_accepts_at_least_what_token_verification_does(scenario: str) -> None:
    """E[accepted] of block >= token-wise (Sun et al., Theorem 2), k = 3, each sequence's first round on the same
    drafts and uniforms: the block mean may not fall below the token mean by 4 standard errors of the paired
    difference (a correct rule fails this with probability < 1e-4); where the draft is sharper than the target
    (drafts the target rates lower, in runs) the gain must exceed 4 standard errors (measured +0.10 of 2.07)."""
    p_tab, q_tab = SCENARIOS[scenario]
    _, block = generate(p_tab, q_tab, 3, block_accept, seed=7)
    _, token = generate(p_tab, q_tab, 3, exact_accept, seed=7)
    diff = (block - token).double()
    z = float(diff.mean()) / (float(diff.std()) / N ** 0.5)
    assert z > (4.0 if scenario == "sharper_draft" else -4.0), (float(block.double().mean()), float(token.double().mean()))


def test_power_a_residual_without_the_prefix_weight_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails a block rule whose correction ignores the prefix weight (max(0, p - q), the
    token-wise residual, after a block decision): the joint is then biased, and the p-value must fall below
    alpha (partial overlap, k = 3)."""
    real = contracts.block_accept

    def unweighted(x, q, p, u, u_next, inject_bias=False):
        n, _ = real(x, q, p, u, u_next)
        rows = torch.arange(x.shape[0])
        q_full = torch.cat([q, torch.zeros_like(q[:, :1])], 1) if q is not None else None
        residual = contracts.residual_distribution(p[rows, n].double(), q_full[rows, n].double())
        return n, sample_with_uniforms(residual, u_next.double()[rows, n])

    tokens, _ = generate(*SCENARIOS["sharper_draft"], 3, unweighted, seed=5)
    assert chi_square_pvalue(_flat(tokens), joint(SCENARIOS["sharper_draft"][0])) < ALPHA


def test_edge_cases() -> None:
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]], dtype=torch.float64)
    u, u_next = torch.tensor([[0.99]], dtype=torch.float64), torch.tensor([[0.3, 0.3]], dtype=torch.float64)
    # a draft of probability 0 under p: never accepted; the correction from max(0, p - q) = p's other token
    n, nxt = block_accept(torch.tensor([[2]]), None, p, u, u_next)
    assert (int(n), int(nxt)) == (0, 0)
    # k = 0: the next token ~ p_1
    n, nxt = block_accept(torch.zeros(1, 0, dtype=torch.long), None, p[:, :1], torch.zeros(1, 0), u_next[:, :1])
    assert (int(n), int(nxt)) == (0, 0)
    # q == p: the weight stays 1, every prefix passes whatever the uniforms
    q = p[:, :1].clone()
    n, nxt = block_accept(torch.tensor([[1]]), q, p, torch.tensor([[1.0]], dtype=torch.float64), u_next)
    assert (int(n), int(nxt)) == (1, 1)
    # a later prefix may pass where the first test fails: w = (0.5, 1.0) after a cheap first draft
    p3 = torch.tensor([[[0.5, 0.5, 0, 0], [0, 0.2, 0.8, 0], [0.25, 0.25, 0.25, 0.25]]], dtype=torch.float64)
    q3 = torch.tensor([[[0.0, 1.0, 0, 0], [0, 0.1, 0.9, 0]]], dtype=torch.float64)
    x3 = torch.tensor([[1, 1]])
    n_tok, _ = exact_accept(x3, q3, p3, torch.tensor([[0.9, 0.1]], dtype=torch.float64), torch.zeros(1, 3))
    n_blk, _ = block_accept(x3, q3, p3, torch.tensor([[0.9, 0.1]], dtype=torch.float64), torch.zeros(1, 3))
    assert (int(n_tok), int(n_blk)) == (0, 2)


def test_verify_exact_block_rule_is_the_core_with_the_request_uniforms() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 7, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(3, 7, generator=g, dtype=torch.float64), -1)
    drafts = [1, 4, 2]
    verdict = verify_exact(drafts, q, p, seed=9, position=30, rule="block")
    u = request_uniforms(9, 30, 3, "accept").view(1, 3)
    u_next = request_uniforms(9, 30, 4, "residual").view(1, 4)
    n, nxt = block_accept(torch.tensor([drafts]), q.unsqueeze(0), p.unsqueeze(0), u, u_next)
    assert (verdict.accepted_len, verdict.next_token, verdict.contract) == (int(n), int(nxt), "exact")
    with pytest.raises(ValueError, match="unknown exact rule"):
        verify_exact(drafts, q, p, seed=9, position=30, rule="blocky")


@pytest.mark.parametrize("rule", ["block", "token"])
def test_decide_applies_the_items_exact_rule(rule: str) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 9, generator=g)
    sampling = SamplingParams(temperature=0.8, seed=5)
    probs = torch.softmax(torch.randn(3, 9, generator=g), -1)
    item = VerifyItem("r", [1], [2, 3, 4], probs.numpy(), 10, [0], list(range(4)), sampling, "exact", 5, 11,
                      exact_rule=rule)
    verdict = decide(item, logits)
    expected = verify_exact([2, 3, 4], probs, transform_logits(logits, sampling), 5, 11, rule=rule)
    assert (verdict.accepted_len, verdict.tokens) == (expected.accepted_len, expected.tokens)
