"""A drafter that answers garbage (ids outside the vocabulary, more or fewer drafts than asked) is refused:
the engine treats it as a failed drafter (plain decoding, the fallback recorded with its reason), and the
output stays plain greedy decoding with nothing left in the ledger. The chaos fault `drafter.garbage`
(drafter_service/deployment.py `garbage_drafts`) makes the same answers in a live Drafter replica."""

from __future__ import annotations

import pytest

from cluster.engine.engine import SpecEngine
from drafter_service.deployment import garbage_drafts
from specserve_types.round_messages import ProposeBatch, ProposeOutput, ProposeResult
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, fake_engine, fake_greedy, request, run

PROMPTS = [[5, 17, 42, 8, 3], [11, 2, 60, 9, 33, 71, 4]]


class LyingDrafter:
    """Wraps the real drafter worker; the first `bad_calls` answers are mangled by `mangle`."""

    def __init__(self, inner: object, mangle: str, bad_calls: int = 3) -> None:
        self.inner = inner
        self.mangle = mangle
        self.bad_calls = bad_calls

    def propose(self, batch: ProposeBatch) -> ProposeResult:
        result = self.inner.propose(batch)  # type: ignore[attr-defined]
        if self.bad_calls <= 0:
            return result
        self.bad_calls -= 1
        if self.mangle == "too_few":
            return ProposeResult([ProposeOutput(o.request_id, o.draft_ids[:-1], None) for o in result.outputs],
                                 result.seconds, result.worker_instance)
        return garbage_drafts(result, FAKE_VOCAB, self.mangle)


def lying_engine(mangle: str) -> SpecEngine:
    engine = fake_engine()
    engine.drafter = LyingDrafter(engine.drafter, mangle)
    engine.health._retry_seconds = 0.0  # retried at once: later rounds speculate again
    return engine


@pytest.mark.parametrize("mangle", ["out_of_range", "wrong_length", "too_few"])
def test_garbage_drafts_are_refused_and_output_stays_exact(mangle: str) -> None:
    engine = lying_engine(mangle)
    outputs = run(engine, [request(f"r{i}", p, max_tokens=30, k=3) for i, p in enumerate(PROMPTS)])
    assert outputs == {f"r{i}": fake_greedy(p, 30) for i, p in enumerate(PROMPTS)}
    events = [e for e in engine.fallback_events if e["event"] == "drafter unavailable"]
    assert events and all("InvalidDrafts" in e["error"] for e in events), engine.fallback_events
    assert engine.acceptance.accepted > 0  # the drafter was retried and its honest drafts were used again


def test_garbage_drafts_with_probabilities_are_refused() -> None:
    """Sampled requests carry draft probabilities: a wrong count of rows is refused as well."""
    engine = lying_engine("wrong_length")
    prompt = PROMPTS[0]
    outputs = run(engine, [request("s", prompt, max_tokens=20, k=3, contract="exact", temperature=0.8, seed=7)])
    assert len(outputs["s"]) == 20 and all(0 <= t < FAKE_VOCAB for t in outputs["s"])
    assert any("InvalidDrafts" in e.get("error", "") for e in engine.fallback_events), engine.fallback_events
