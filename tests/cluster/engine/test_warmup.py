"""Engine warm-up (cluster/engine/warmup.py): every k visited in passes, forward then backward, each row count's
estimate the median of samples taken across the whole warm-up; nothing of it left in the ledger or the stats."""

from __future__ import annotations

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.warmup import schedule, warm_up
from specserve_types.api import GenerationRequest
from tests.cluster.engine.engine_helpers import fake_engine


def test_schedule_visits_every_k_in_passes_forward_then_backward() -> None:
    assert schedule(2, passes=3) == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert schedule(0, passes=2) == [0, 0]
    assert schedule(3, passes=1) == [0, 1, 2, 3]


def test_warm_up_samples_every_row_count_in_every_pass_and_leaves_nothing() -> None:
    engine = fake_engine(k_max=2)
    submitted: list[int] = []
    submit = engine.submit

    def spy(request: GenerationRequest) -> None:
        submitted.append(request.spec.k or 0)
        submit(request)

    engine.submit = spy  # type: ignore[method-assign]
    costs = warm_up(engine, rounds_per_visit=2, passes=3)
    assert submitted == [0, 1, 2, 2, 1, 0, 0, 1, 2, 1]  # the last on a prompt of its own: the draft's catch-up
    # each request scores k + 1 rows per round after its prompt's round: at least 2 rounds a visit, 3 visits
    for rows in (1, 2, 3):
        assert engine.cost.verify_samples[rows] >= 6, engine.cost.verify_samples
    assert engine.cost.warm_up_samples is None  # live traffic blends by moving averages again
    assert costs["draft_token_seconds"] is not None and set(costs["verify_seconds_by_tokens"]) >= {1, 2, 3}
    assert costs["draft_catch_up_row_seconds"] is not None  # timed after a draft step was
    engine.kv.audit().assert_no_leaks()
    assert engine.kv.request_ids(TARGET_NAMESPACE) == [] and engine.kv.request_ids(DRAFT_NAMESPACE) == []
    stats = engine.stats()  # the warm-up's rounds are not the users'
    assert stats["rounds"] == 0 and stats["acceptance"] == engine.acceptance.__class__().to_dict()
