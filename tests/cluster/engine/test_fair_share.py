"""Fair shares of the batch between tenants (cluster/engine/fair_share.py), on the model-free engine
(engine_helpers.fake_engine): tenants take free slots in turn, a full batch yields a slot to a tenant short of its
share (a preemption that loses nothing: every output equals plain greedy decoding), one tenant keeps the FIFO order
it always had, and the ledger ends empty."""

from __future__ import annotations

from collections import defaultdict

import pytest

from cluster.engine.engine import SpecEngine
from cluster.engine.fair_share import FairOrder
from cluster.engine.request_state import new_request_state
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams, TokenChunk
from tests.cluster.engine.engine_helpers import FAKE_VOCAB, fake_engine, fake_greedy
from tests.cluster.engine.test_overlap import drive, tokens_of


def tenant_request(rid: str, tenant: str, max_tokens: int = 40, prompt: tuple[int, ...] | None = None,
                   ) -> GenerationRequest:
    prompt = prompt or tuple((hash(rid) + i) % FAKE_VOCAB for i in range(5))
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), SpecParams(k=3, draft="model"),
                             tenant=tenant)


def fair_share_preemptions(engine: SpecEngine) -> list[str]:
    return [e["request_id"] for e in engine.stats()["fallback_events"]
            if e["event"] == "preempted" and e.get("reason", "").startswith("fair share")]


def running_by_tenant(engine: SpecEngine) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for state in engine.running:
        counts[state.request.tenant] += 1
    return dict(counts)


def finish(engine: SpecEngine, requests: list[GenerationRequest], out: dict[str, list[TokenChunk]]) -> None:
    """Run to the end: every output is plain greedy decoding's, nothing left in the ledger."""
    drive(engine, out)
    for request in requests:
        assert tokens_of(out[request.request_id]) == fake_greedy(list(request.prompt_token_ids),
                                                               request.sampling.max_tokens), request.request_id
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_late_tenant_gets_a_slot_from_a_full_batch_and_nothing_is_lost(overlap: bool) -> None:
    engine = fake_engine(max_batch=4, overlap=overlap)
    out: dict[str, list[TokenChunk]] = defaultdict(list)
    flood = [tenant_request(f"a{i}", "key-a") for i in range(10)]
    for request in flood:
        engine.submit(request)
    for _ in range(3):
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
    assert running_by_tenant(engine) == {"key-a": 4}
    victim = tenant_request("b0", "key-b")
    engine.submit(victim)
    for _ in range(3):  # with overlap, a request whose drafts are in flight waits for them to land
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
        if running_by_tenant(engine).get("key-b"):
            break
    assert running_by_tenant(engine).get("key-b") == 1, running_by_tenant(engine)
    assert len(fair_share_preemptions(engine)) == 1
    finish(engine, [*flood, victim], out)


def test_waiting_tenants_take_free_slots_in_turn() -> None:
    """Four of tenant a's queued before two of b's and one of c's: a batch of 3 takes one of each, then tenants
    keep the batch shared (never two of one tenant while another waits with none)."""
    engine = fake_engine(max_batch=3)
    requests = ([tenant_request(f"a{i}", "key-a", max_tokens=12) for i in range(4)]
                + [tenant_request(f"b{i}", "key-b", max_tokens=12) for i in range(2)]
                + [tenant_request("c0", "key-c", max_tokens=12)])
    for request in requests:
        engine.submit(request)
    out: dict[str, list[TokenChunk]] = defaultdict(list)
    for chunk in engine.step():
        out[chunk.request_id].append(chunk)
    assert sorted(state.request_id for state in engine.running) == ["a0", "b0", "c0"]
    while engine.has_unfinished():
        waiting = {state.request.tenant for state in engine.waiting}
        counts = running_by_tenant(engine)
        if waiting and counts:
            assert max(counts.values()) - min(counts.get(t, 0) for t in waiting) <= 1, (counts, waiting)
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
    assert not fair_share_preemptions(engine)  # free slots sufficed: same-length requests finish together
    finish(engine, requests, out)


def test_one_tenant_keeps_first_come_first_served() -> None:
    engine = fake_engine(max_batch=2)
    requests = [tenant_request(f"r{i}", "", max_tokens=6 + 6 * (i % 2)) for i in range(6)]
    for request in requests:
        engine.submit(request)
    admitted: list[str] = []
    out: dict[str, list[TokenChunk]] = defaultdict(list)
    while engine.has_unfinished():
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
        admitted += [s.request_id for s in engine.running if s.request_id not in admitted]
    assert admitted == [r.request_id for r in requests]
    assert not fair_share_preemptions(engine)
    finish(engine, requests, out)


def test_shares_within_one_are_left_alone() -> None:
    """Tenant a holds 2 of a batch of 3, b holds 1 and queues more: no preemption (the gap would only flip)."""
    engine = fake_engine(max_batch=3)
    requests = [tenant_request("a0", "key-a"), tenant_request("a1", "key-a"), tenant_request("b0", "key-b")]
    for request in requests:
        engine.submit(request)
    out: dict[str, list[TokenChunk]] = defaultdict(list)
    for chunk in engine.step():
        out[chunk.request_id].append(chunk)
    more = [tenant_request(f"b{i}", "key-b") for i in range(1, 4)]
    for request in more:
        engine.submit(request)
    for _ in range(3):
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
    assert running_by_tenant(engine) == {"key-a": 2, "key-b": 1}
    assert not fair_share_preemptions(engine)
    finish(engine, requests + more, out)


def test_the_order_of_a_step() -> None:
    """FairOrder on its own: the tenant with the fewest running first (ties: the oldest waiting), a tenant passed
    over waits this step, and the one to yield is the richest tenant's most recently admitted request."""
    engine = fake_engine()

    def state(rid: str, tenant: str):  # noqa: ANN202 - a RequestState
        return new_request_state(tenant_request(rid, tenant), None, frozenset(), FAKE_VOCAB, 1024, has_drafter=True,
                                 constraints=engine.constraints)

    running = [state("a0", "a"), state("a1", "a"), state("a2", "a"), state("b0", "b")]
    waiting = [state("a3", "a"), state("b1", "b"), state("c0", "c"), state("c1", "c")]
    order = FairOrder(waiting, running)
    assert order.next() is waiting[2]  # c runs none
    victim = order.to_yield(running, in_flight=set())
    assert victim is running[2]  # a's latest (c: 0 + 1 < 3)
    assert order.to_yield(running, in_flight={"a2"}) is running[1]  # drafts in flight: not chosen
    order.yielded(victim)
    assert order.next() is waiting[2]
    order.admitted(waiting[2])
    assert order.next() is waiting[1]  # b and c run 1 each, a runs 2: b's b1 waited longer than c1
    order.pass_over(waiting[1])
    assert order.next() is waiting[3]
    order.admitted(waiting[3])
    assert order.next() is victim  # a's requeued request heads a's queue, before a3
    assert order.to_yield(running, in_flight=set()) is None  # a 2, b 1, c 2: fair enough
