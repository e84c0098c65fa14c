"""The draft cache's catch-up, priced: whether a round may send a request's missing tokens through the draft model.

A model-drafted round first feeds the draft model every token its cache lacks: a prompt's whole prefill at the
request's first draft, and after a spell of plain or lookup rounds the tokens those rounds committed. A catch-up of
one or two tokens is part of every round's draft step (CostModel.draft_token); each token beyond those costs
CostModel.draft_catch_up_row more, measured from the propose calls that carried such a catch-up. Where the draft
model's forward is compute-bound for many rows (no AMX tiles: a q4 0.5B prefills at ~5 ms a token on an AVX2 CPU
without VNNI, ~0.4 ms on AMX) a prompt's catch-up can cost more than drafting then saves over the whole request:
docs/speculation.md, "The draft cache's catch-up, priced".

    extra  = (catch-up tokens - 2) * draft_catch_up_row
    saved  = tokens_left * (1 / rate(0) - 1 / max_k rate(k))     rates at the steady state (the target catching up
                                                                 one token; spec_policy.expected_rates)
    budget = LOOK_BUDGET * tokens_left / rate(0)                 what a look at the request's own acceptance may cost
    the draft model drafts this round only if extra <= max(saved, budget)

The budget keeps the prompt's round a look at the request's own acceptance where the catch-up is cheap (spec_policy
.choose_k: the engine-wide rate must not keep a request from ever measuring its own): on AMX a 100-token prompt's
draft prefill is ~1% of a 64-token request. A vetoed round drafts from the request's n-gram lookup if it has one,
or decodes plainly. Measured costs only: seeded sampled requests and fixed k never read it (their k depends on
their own history and the command). Before a request's first model round its draft cache's prefix hits are not
known (the draft namespace admits it after the plan: admission.py), so its catch-up is then counted from its first
token: a prompt whose prefix another request left in the draft cache may be priced dearer than it will cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.engine.round_plan import RoundPlan
from cluster.engine.spec_policy import AutoInputs, CostModel, expected_rates

USUAL_CATCH_UP = 2  # tokens every model-drafted round feeds: the last round's bonus token (and its last draft)
# the fewest tokens beyond the usual that time the catch-up: a few tokens add less to a call than its steps' own jitter
# (on AMX 3 tokens add ~1.3 ms to two ~22 ms steps), so their share per token would be mostly noise
TIMED_CATCH_UP = 8
LOOK_BUDGET = 0.05  # of a request's remaining plain decoding, what its draft catch-up may cost without paying back


@dataclass(frozen=True)
class CatchUpPrice:
    extra: float  # seconds the catch-up adds to this round's propose call
    saved: float  # seconds drafting is expected to save over the request's remaining tokens
    budget: float  # seconds a look at the request's own acceptance may cost

    @property
    def pays(self) -> bool:
        return self.extra <= max(self.saved, self.budget)


def price_catch_up(inputs: AutoInputs, tokens: int) -> CatchUpPrice | None:
    """The price of a model-drafted round whose draft cache lacks `tokens` tokens, for a request whose auto k reads
    `inputs` (its own acceptance, the engine's, the measured costs). None: nothing to price (a usual catch-up, the
    catch-up cost or a verify time not measured yet, an unbounded request)."""
    row = inputs.cost.draft_catch_up_row
    if tokens <= USUAL_CATCH_UP or row is None or inputs.tokens_left is None or inputs.k_max == 0:
        return None
    if inputs.cost.verify_time(inputs.batch) is None or inputs.draft_cost_per_token is None:
        return None
    rates = expected_rates(inputs, inputs.k_max, 1)
    left = inputs.tokens_left
    best = max(rates[1:])
    saved = left * (1 / rates[0] - 1 / best) if best > rates[0] else 0.0
    return CatchUpPrice(extra=(tokens - USUAL_CATCH_UP) * row, saved=saved, budget=LOOK_BUDGET * left / rates[0])


def observe_propose(cost: CostModel, plans: Sequence[RoundPlan], steps: int, seconds: float) -> None:
    """A propose call's time into the cost model: a draft step where every plan's catch-up is the usual one, else
    what its tokens beyond the usual added (the call less its steps at the measured step cost), where they are
    enough to time (TIMED_CATCH_UP)."""
    tree = any(p.tree_budget for p in plans)
    extra = sum(max(0, len(p.draft_pending) - USUAL_CATCH_UP) for p in plans)
    if extra == 0:
        cost.observe_draft(steps, seconds, tree=tree)
        return
    step = cost.draft_tree_level if tree and cost.draft_tree_level is not None else cost.draft_token
    if step is not None and extra >= TIMED_CATCH_UP:
        cost.observe_draft_catch_up(extra, seconds - steps * step)
