"""The acceptance contracts of a speculative round: exact, greedy, typical.

Symbols as in the papers (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2; Medusa, Cai et al. 2024;
block verification: Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", Alg. 2):
  x_1..x_k    draft tokens of the round, x_i ~ q_i (the drafter's transformed distribution at draft i)
  p_1..p_k+1  target distributions at the same positions (transformed by the same sampling transform);
              p_{k+1} is the distribution after all k drafts, used for the bonus token
  u_i         the uniform of the accept test at draft i;  n = accepted_len = number of drafts accepted

Glossary:
  accepted    a draft token kept as output.
  correction  the token sampled at the first rejected position n+1 (from the residual r, or argmax p).
  bonus       the token sampled from p_{k+1} when all k drafts are accepted.
  verdict     what a contract decided for one request in one round: accepted drafts + one next token.

Each core works on a batch of B rounds of equal k (`*_accept`); the per-request functions
(`verify_*`) draw the request's seeded uniforms and call the core with B = 1, so tests exercise the
same code with large B (greedy: the core and `verify_greedy` both walk each request's rows with
`greedy_walk`, which needs no tensors of its own). Positions and streams of the uniforms: see `verifier_service.sampling`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve_types.api import EXACT_RULES
from verifier_service.sampling import SUPPORT_SHARE, argmax_rows, request_uniforms, sample_with_uniforms

# Medusa's defaults (posterior_threshold=0.09, posterior_alpha=0.3 in medusa/model/utils.py).
POSTERIOR_THRESHOLD = 0.09
POSTERIOR_ALPHA = 0.3


@dataclass(frozen=True)
class Verdict:
    """The outcome of one round for one request; `tokens` = accepted drafts + next_token, in order."""

    accepted_len: int
    next_token: int
    tokens: list[int]
    contract: str
    bonus: bool
    proposed: int

    def __post_init__(self) -> None:
        assert 0 <= self.accepted_len <= self.proposed
        assert self.bonus == (self.accepted_len == self.proposed)
        assert len(self.tokens) == self.accepted_len + 1 and self.tokens[-1] == self.next_token


# ----------------------------------------------------------------------------------------------
# Cores: batches of B rounds with the same k
# ----------------------------------------------------------------------------------------------


def weighted_residual(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Block verification's next-token distribution after a prefix of weight w: max(0, w p - q) / Z over the last
    dim (p, q [B,V], w [B]). Z == 0 only where the prefix could not pass (n = 0 with p_1 == q_1, whose test
    h_1 = 1 always passes): float error, so fall back to p."""
    r = (w.unsqueeze(-1) * p - q).clamp(min=0)
    Z = r.sum(-1, keepdim=True)
    return torch.where(Z > 0, r / Z.clamp(min=torch.finfo(r.dtype).tiny), p)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """r(v) = max(0, p(v) - q(v)) / Z over the last dim; where Z == 0 (p == q: a rejection only float error
    can produce) fall back to p. (Block verification's `weighted_residual` at weight 1.)"""
    return weighted_residual(p, q, torch.ones(p.shape[:-1], dtype=p.dtype, device=p.device))


def exact_accept(
    x: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, u: torch.Tensor, u_next: torch.Tensor,
    inject_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for B rounds of k drafts.

      accept x_i with prob min(1, p_i(x_i) / q_i(x_i)):  u_i * q_i(x_i) < p_i(x_i),  stop at the first reject
      n = accepted_len;  next ~ r(v) = max(0, p_{n+1}(v) - q_{n+1}(v)) / Z,  with q_{k+1} = 0 so the bonus ~ p_{k+1}

    x [B,k] long; q [B,k,V] probs, or None = point mass q_i(x_i) = 1 (n-gram drafts); p [B,k+1,V] probs;
    u [B,k] uniforms of the accept tests; u_next [B,k+1] the uniform for a next token at each possible
    position n+1. A draft with q_i(x_i) = 0 (cannot happen for x_i ~ q_i) is rejected. x, q, p share a device;
    the uniforms may live on the CPU. Returns (accepted_len [B], next_token [B]).

    `inject_bias` (off in production; `specserve check exact --inject-bias` only) is WRONG on purpose: after
    a rejection the next token comes from p instead of the residual r, which shifts the output towards the
    drafts. It exists so the end-to-end check can show that it detects such a bug.
    """
    B, k = x.shape
    assert p.shape[:2] == (B, k + 1) and u.shape == (B, k) and u_next.shape == (B, k + 1)
    u, u_next = u.to(p.device, torch.float64), u_next.to(p.device, torch.float64)
    if q is None:
        q = F.one_hot(x, p.shape[-1]).to(p.dtype)
    p_x = p[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
    q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
    accepted = (q_x > 0) & (u * q_x < p_x)
    accepted_len = accepted.long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=x.device)
    q_padded = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)  # q_{k+1} = 0
    p_next = p[rows, accepted_len].double()
    r = p_next if inject_bias else residual_distribution(p_next, q_padded[rows, accepted_len].double())
    next_token = sample_with_uniforms(r, u_next[rows, accepted_len])
    return accepted_len, next_token


def block_accept(
    x: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, u: torch.Tensor, u_next: torch.Tensor,
    inject_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al. 2024, Alg. 2) for B rounds of k drafts: the exact contract's output
    distribution, and in expectation at least as many accepted drafts as `exact_accept` (their Theorem 2).

      w_0 = 1,  w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))          the weight of the prefix x_1..x_i
      Z_i = sum_v max(0, w_i p_{i+1}(v) - q_{i+1}(v))              (q_{k+1} = 0, so Z_k = w_k)
      h_i = Z_i / (Z_i + 1 - w_i) for i < k  (1 where Z_i = 0 and w_i = 1),   h_k = w_k
      n = the LAST i in 1..k with u_i <= h_i (0 if none): a later prefix may pass where an earlier draft
          would have been rejected token by token
      next ~ max(0, w_n p_{n+1} - q_{n+1}) / Z_n  (with n = k: p_{k+1}, the bonus)

    Arguments and returns as `exact_accept` (the same uniforms: u_i is the test of the prefix ending at i).
    `inject_bias` (the negative control only): the next token from p_{n+1} instead of the weighted residual.
    """
    B, k = x.shape
    assert p.shape[:2] == (B, k + 1) and u.shape == (B, k) and u_next.shape == (B, k + 1)
    if k == 0:  # no prefix to weigh: the next token ~ p_1 either way
        return exact_accept(x, q, p, u, u_next, inject_bias)
    u, u_next = u.to(p.device, torch.float64), u_next.to(p.device, torch.float64)
    rows = torch.arange(B, device=p.device)
    p_x = p[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(p_x))
    w = [torch.ones(B, dtype=torch.float64, device=p.device)]  # w_0 .. w_k
    for i in range(k):
        w.append(torch.clamp(w[-1] * ratio[:, i], max=1.0))
    weights = torch.stack(w, 1)  # [B, k+1]
    # Z_1 .. Z_{k-1}: one pass over the vocabulary per draft (summed in float64); a point-mass q at x_{i+1} has
    # the closed form w_i (sum p_{i+1} - p_{i+1}(x_{i+1})) + max(0, w_i p_{i+1}(x_{i+1}) - 1), the last term 0
    if q is None:
        Z = weights[:, 1:k] * (p[:, 1:k].sum(-1, dtype=torch.float64) - p_x[:, 1:])
    else:
        Z = (weights[:, 1:k, None].to(p.dtype) * p[:, 1:k] - q[:, 1:k]).clamp(min=0).sum(-1, dtype=torch.float64)
    denominator = Z + 1 - weights[:, 1:k]
    h_inner = torch.where(denominator > 0, Z / denominator.clamp(min=torch.finfo(torch.float64).tiny),
                          torch.ones_like(denominator))
    h = torch.cat([h_inner, weights[:, k:]], 1)  # [B, k]: h_1 .. h_k
    steps = torch.arange(1, k + 1, device=p.device).expand(B, k)
    accepted_len = torch.where(u <= h, steps, torch.zeros_like(steps)).amax(-1)
    # the next token: the residual at n, in float64, for the chosen row only (q_{k+1} = 0: the bonus ~ p_{k+1})
    p_next = p[rows, accepted_len].double()
    if q is None:
        q_next = F.one_hot(torch.cat([x, x[:, :1]], 1)[rows, accepted_len], p.shape[-1]).double()
    else:
        q_next = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], 1)[rows, accepted_len].double()
    q_next = torch.where((accepted_len == k).unsqueeze(-1), torch.zeros_like(q_next), q_next)
    r = p_next if inject_bias else weighted_residual(p_next, q_next, weights[rows, accepted_len])
    return accepted_len, sample_with_uniforms(r, u_next[rows, accepted_len])


def greedy_accept(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while x_i == argmax p_i; next = argmax p_{n+1} (ties -> lowest id). x [B,k]; p [B,k+1,V] logits or probs.
    Each request through `greedy_walk`, as `verify_greedy` takes it."""
    walks = [greedy_walk(drafts, p[b]) for b, drafts in enumerate(x.tolist())]
    return (torch.tensor([n for n, _ in walks], device=x.device),
            torch.tensor([token for _, token in walks], device=x.device))


def greedy_walk(draft_tokens: Sequence[int], p: torch.Tensor) -> tuple[int, int]:
    """One request's greedy rule: (accepted_len, next token). p [k+1,V]; its rows are read one at a time, up to the
    first rejection (the rows after it are never read)."""
    k, n = len(draft_tokens), 0
    while (target := int(argmax_rows(p[n]))) == (draft_tokens[n] if n < k else -1):
        n += 1
    return n, target


def typical_accept(
    x: torch.Tensor, p: torch.Tensor, u_next: torch.Tensor, posterior_threshold: float, posterior_alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa typical acceptance: accept x_i while p_i(x_i) > min(threshold, alpha * exp(-H(p_i))); next ~ p_{n+1}.

    Relaxed: the output distribution is NOT p. x [B,k]; p [B,k+1,V] probs; u_next [B,k+1] as in `exact_accept`.
    """
    B, k = x.shape
    u_next = u_next.to(p.device, torch.float64)
    p_x = p[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1)
    H = torch.special.entr(p[:, :k].double()).sum(-1)
    threshold = torch.clamp(posterior_alpha * torch.exp(-H), max=posterior_threshold)
    accepted_len = (p_x.double() > threshold).long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=x.device)
    return accepted_len, sample_with_uniforms(p[rows, accepted_len], u_next[rows, accepted_len])


# ----------------------------------------------------------------------------------------------
# One request: seeded uniforms, B = 1
# ----------------------------------------------------------------------------------------------


def _verdict(draft_tokens: Sequence[int], accepted_len: torch.Tensor, next_token: torch.Tensor, contract: str) -> Verdict:
    n, token = int(accepted_len[0]), int(next_token[0])
    tokens = [*draft_tokens[:n], token]
    return Verdict(n, token, tokens, contract, bonus=n == len(draft_tokens), proposed=len(draft_tokens))


def _drafts(draft_tokens: Sequence[int], p: torch.Tensor) -> torch.Tensor:
    assert p.dim() == 2 and p.shape[0] == len(draft_tokens) + 1, "p needs k+1 rows for k drafts"
    return torch.as_tensor(list(draft_tokens), dtype=torch.long, device=p.device).view(1, -1)


def verify_exact(
    draft_tokens: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, seed: int, position: int,
    inject_bias: bool = False, rule: str = "token", support: torch.Tensor | None = None,
) -> Verdict:
    """Exact contract for one request. q [k,V] or None (point mass); p [k+1,V]; `position` = position of x_1;
    `rule`: "token" (`exact_accept`) or "block" (`block_accept`), the same uniforms.
    `support`: p is given on these token ids only (ascending, the drafts among them; p = 0 on every other token in
    every row, e.g. a constraint's columns): [k+1, len(support)], q still [k,V] (narrowed here, as `on_support`).
    `inject_bias`: the negative control of `specserve check exact` (see `exact_accept`); never in production."""
    if rule not in EXACT_RULES:
        raise ValueError(f"unknown exact rule {rule!r}; known: {', '.join(EXACT_RULES)}")
    x, k = _drafts(draft_tokens, p), len(draft_tokens)
    u = request_uniforms(seed, position, k, "accept", round_start=position).view(1, k)  # fresh per round
    u_next = request_uniforms(seed, position, k + 1, "residual").view(1, k + 1)
    accept = block_accept if rule == "block" else exact_accept
    if support is None:
        assert q is None or q.shape == (k, p.shape[-1])
        x, q, p, ids = on_support(x, q, p)
    else:
        assert p.shape[-1] == len(support) and (q is None or q.shape[0] == k)
        x, q, ids = torch.searchsorted(support, x), None if q is None else q[:, support], support
    accepted_len, next_token = accept(x, None if q is None else q.unsqueeze(0), p.unsqueeze(0), u, u_next, inject_bias)
    return _verdict(draft_tokens, accepted_len, next_token if ids is None else ids[next_token], "exact")


def on_support(x: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One request's round (x [1,k] drafts, q [k,V] or None, p [k+1,V]) on the columns any of its rows can give: the
    tokens with p > 0 or q > 0 in some row, and the drafts; and those columns' token ids (None: the round as it is,
    its support over SUPPORT_SHARE of the vocabulary). Every other token has p = q = 0 in every row, so the rules
    never accept, weigh or sample it: the verdict on the narrowed round, its next token mapped back through the
    ids, is the verdict on the whole one (its sums run over the same nonzero terms; a float sum may round them in
    another order). A constraint, top-k, top-p or min-p leaves a small support, and the round then costs its support's
    columns, not the vocabulary's (docs/speed.md, "Structured output")."""
    most = SUPPORT_SHARE * p.shape[-1]
    support = (p > 0).any(0)
    if int(support.sum()) > most:  # a dense p (sampling without a constraint or a cut): as it is, q unread
        return x, q, p, None
    if q is not None:
        support |= (q > 0).any(0)
    support[x.flatten()] = True
    if int(support.sum()) > most:
        return x, q, p, None
    ids = support.nonzero().flatten()
    return torch.searchsorted(ids, x), None if q is None else q[:, ids], p[:, ids], ids


def verify_greedy(draft_tokens: Sequence[int], p: torch.Tensor) -> Verdict:
    """Greedy contract for one request. p [k+1,V]: logits (preferred: what plain greedy decoding argmaxes) or probs."""
    assert p.dim() == 2 and p.shape[0] == len(draft_tokens) + 1, "p needs k+1 rows for k drafts"
    n, token = greedy_walk(draft_tokens, p)
    return Verdict(n, token, [*draft_tokens[:n], token], "greedy", bonus=n == len(draft_tokens),
                   proposed=len(draft_tokens))


def verify_typical(
    draft_tokens: Sequence[int],
    p: torch.Tensor,
    seed: int,
    position: int,
    posterior_threshold: float = POSTERIOR_THRESHOLD,
    posterior_alpha: float = POSTERIOR_ALPHA,
) -> Verdict:
    """Typical contract for one request (labeled "typical": it changes the output distribution). p [k+1,V] probs."""
    x, k = _drafts(draft_tokens, p), len(draft_tokens)
    u_next = request_uniforms(seed, position, k + 1, "residual").view(1, k + 1)
    accepted_len, next_token = typical_accept(x, p.unsqueeze(0), u_next, posterior_threshold, posterior_alpha)
    return _verdict(draft_tokens, accepted_len, next_token, "typical")
