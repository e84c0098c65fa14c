"""Engine warm-up: measure what auto speculation needs before the first user request arrives.

Auto picks k from the verify time per number of scored tokens and the draft time per step
(cluster/engine/spec_policy.py). Measured only from live traffic, a request spends its first rounds on
warm-up (plain decoding, then k=2) and never sees the costs of the k it does not try: on Qwen-1.5B
scoring 3 tokens costs ~1.1x one token but 5 tokens ~2x. `warm_up` runs a synthetic request per k in
0..k_max through the normal round path (ledger, drafter, verifier: in process or in the cluster),
keeps the cost model it filled and discards everything else it touched (acceptance, totals, events).

The prompt is periodic, so n-gram lookup always finds a continuation and proposes exactly k tokens,
and the repeated prompt is a shared prefix in the ledger after the first request (prefilled once).
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


def warm_up(engine: SpecEngine, rounds_per_k: int = 3) -> dict[str, object]:
    """Run on the engine's own thread before serving; returns the cost model it measured."""
    assert not engine.has_unfinished(), "warm up an idle engine"
    start = time.perf_counter()
    vocab = engine.vocab_size
    pattern = [(1000 + 37 * i) % vocab for i in range(PERIOD)]
    prompt = tuple(pattern * REPEATS)
    draft = "model" if engine.drafter is not None else "ngram"
    engine.cost.warm_up_samples = {}  # estimates are the medians of the samples (spec_policy.CostModel)
    with engine.unobserved():  # its rounds are not the users': no spans, no metrics
        try:
            for k in range(engine.config.k_max + 1):
                request = GenerationRequest(
                    f"_warm-up-{k}-{time.monotonic_ns()}", prompt,
                    SamplingParams(max_tokens=(k + 1) * rounds_per_k + 1, ignore_eos=True),
                    SpecParams(contract="greedy", k=k, draft=draft if k else "none"))
                engine.submit(request)
                while engine.has_unfinished():
                    engine.step()
        finally:
            engine.cost.warm_up_samples = None
    engine.reset_statistics()
    costs = {"draft_token_seconds": engine.cost.draft_token,
             "verify_seconds_by_tokens": dict(sorted(engine.cost.verify_by_tokens.items()))}
    log.info("warm-up in %.1f s: %s", time.perf_counter() - start, costs)
    return costs
