"""Engine warm-up: measure what auto speculation needs before the first user request arrives.

Auto picks k from the verify time per number of scored tokens and the draft time per step
(cluster/engine/spec_policy.py). Measured only from live traffic, a request spends its first rounds on
warm-up (plain decoding, then k=2) and never sees the costs of the k it does not try: on Qwen-1.5B
scoring 3 tokens costs ~1.1x one token but 5 tokens ~2x. `warm_up` runs a synthetic request per k in
0..k_max through the normal round path (ledger, drafter, verifier: in process or in the cluster),
keeps the cost model it filled and discards everything else it touched (acceptance, totals, events).

The k are visited in passes, forward then backward (`schedule`), so each row count's samples are spread over the
whole warm-up: a burst of load on a shared machine (another process starting, a replica deploying beside it)
inflates a few samples of several row counts rather than all of one. With every k timed in one stretch, a burst
made one 8-request `bench serve` run time 1 row at 57 ms and 2 rows at 46 (the same engine in process: 44 and
52), and its auto drafted 277 tokens in 281 rounds where the in-process engine drafted 168 in 304.

The prompt is periodic, so n-gram lookup always finds a continuation and proposes exactly k tokens,
and the repeated prompt is a shared prefix in the ledger after the first request (prefilled once). With a draft
model, a last request on a prompt of its own times what a prompt's catch-up costs the draft model (catch_up.py):
the first one's ran before a draft step was measured, which the catch-up's cost is told apart from.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

if TYPE_CHECKING:
    from cluster.engine.engine import SpecEngine

log = logging.getLogger("specserve.engine")

PERIOD = 8  # tokens in the repeated pattern
REPEATS = 6
PASSES = 3  # visits of every k
ROUNDS_PER_VISIT = 2  # speculative rounds of one visit's request (after its prompt's round)


def schedule(k_max: int, passes: int = PASSES) -> list[int]:
    """The k of each warm-up request in order: 0..k_max, then k_max..0, and so on."""
    forward = list(range(k_max + 1))
    return [k for p in range(passes) for k in (forward if p % 2 == 0 else forward[::-1])]


def warm_up(engine: SpecEngine, rounds_per_visit: int = ROUNDS_PER_VISIT, passes: int = PASSES) -> dict[str, object]:
    """Run on the engine's own thread before serving; returns the cost model it measured (the median of every
    sample of a row count, and of the draft step)."""
    assert not engine.has_unfinished(), "warm up an idle engine"
    start = time.perf_counter()
    vocab = engine.vocab_size
    pattern = [(1000 + 37 * i) % vocab for i in range(PERIOD)]
    prompt = tuple(pattern * REPEATS)
    draft = "model" if engine.drafter is not None else "ngram"
    # estimates are the medians of the samples (spec_policy.CostModel); its rounds are not the users': no spans,
    # no metrics
    with engine.cost.warming_up(), engine.unobserved():
        visits = [(k, prompt) for k in schedule(engine.config.k_max, passes)]
        if engine.drafter is not None and engine.config.k_max:  # a prompt of its own: its draft catch-up timed
            visits.append((1, tuple((t + PERIOD * 61) % vocab for t in prompt)))
        for k, tokens in visits:
            request = GenerationRequest(
                f"_warm-up-{k}-{time.monotonic_ns()}", tokens,
                SamplingParams(max_tokens=(k + 1) * rounds_per_visit + 1, ignore_eos=True),
                SpecParams(contract="greedy", k=k, draft=draft if k else "none"))
            engine.submit(request)
            while engine.has_unfinished():
                engine.step()
    engine.reset_statistics()
    costs = {"draft_token_seconds": engine.cost.draft_token, "draft_catch_up_row_seconds": engine.cost.draft_catch_up_row,
             "verify_seconds_by_tokens": dict(sorted(engine.cost.verify_by_tokens.items()))}
    log.info("warm-up in %.1f s: %s", time.perf_counter() - start, costs)
    return costs
