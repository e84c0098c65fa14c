"""Each client's share of the scheduler (cluster/serving/client_shares.py) and who a client is
(cluster/serving/auth.py `client_id`): the limits refuse past a client's share and never a client holding nothing,
the counters return to zero, the scheduler refuses with a capacity error (429 / RESOURCE_EXHAUSTED) before the
engine sees the request and gives everything back, and the metrics never carry a key."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from cluster.serving.auth import ApiKeys, client_id, grpc_peer, http_peer
from cluster.serving.client_shares import ClientLimits, ClientShares, Share
from cluster.serving.metrics import MAX_CLIENT_LABELS, OTHER_CLIENTS, SpecMetrics
from specserve_types.protocol import IndexedChunk, StreamError
from tests.cluster.serving.test_scheduler_loop import ScriptedEngine, args, drain, make_scheduler, wait_until

KEY = "sk-test-0123456789abcdef"


def test_a_client_is_refused_past_its_share_and_never_when_it_holds_nothing() -> None:
    changes: list[tuple[str, Share]] = []
    refusals: list[tuple[str, str]] = []
    shares = ClientShares(ClientLimits(completions=4, tokens=100), lambda c, s: changes.append((c, s)),
                          lambda c, limit: refusals.append((c, limit)))
    assert shares.take_completions("a", 16) is None  # holds nothing: within its share whatever it asks
    assert shares.take_tokens("a", 5000) is None
    assert shares.take_completions("b", 4) is None  # others are unaffected
    refused = shares.take_completions("a", 1)
    assert refused is not None and "max_client_completions=4" in refused and "retry later" in refused
    shares.give_back("a", 16, 5000)
    assert shares.of("a") == Share() and "a" not in shares.clients()
    assert shares.take_completions("a", 3) is None and shares.take_tokens("a", 60) is None
    assert shares.take_completions("a", 1) is None
    refused = shares.take_tokens("a", 41)
    assert refused is not None and "60 tokens in flight" in refused and "max_client_tokens=100" in refused
    assert shares.take_tokens("a", 40) is None
    assert refusals == [("a", "completions"), ("a", "tokens")]
    assert changes[-1] == ("a", Share(4, 100))
    shares.give_back("a", 4, 100)
    shares.give_back("b", 4, 0)
    assert shares.clients() == {} and changes[-1] == ("b", Share())


def test_default_limits_leave_half_to_the_others() -> None:
    assert ClientLimits.defaults(queue_capacity=256, max_batch=16, max_context=2048) == ClientLimits(128, 16384)
    assert ClientLimits.defaults(queue_capacity=1, max_batch=1, max_context=1) == ClientLimits(1, 1)


def test_a_client_is_its_key_or_its_connection_never_the_key_itself() -> None:
    key_id = client_id(KEY, "127.0.0.1:5000")
    assert key_id.startswith("key-") and len(key_id) == 16 and KEY not in key_id
    assert key_id == client_id(KEY, "10.0.0.9:6000")  # one key from anywhere is one client
    assert client_id("sk-other-0123456789abcdef", None) != key_id
    one, other = client_id(None, "127.0.0.1:5000"), client_id(None, "127.0.0.1:5001")
    assert one.startswith("peer-") and one != other  # without keys, a connection is a client
    assert http_peer(("::ffff:127.0.0.1", 5000)) == "127.0.0.1:5000" and http_peer(None) is None
    assert grpc_peer("ipv4:127.0.0.1:5000") == "127.0.0.1:5000"
    assert grpc_peer("ipv6:%5B::ffff:127.0.0.1%5D:5000") == "127.0.0.1:5000"
    assert grpc_peer("ipv6:[::1]:5000") == "::1:5000"
    assert grpc_peer("unix:/tmp/sock") == "unix:/tmp/sock" and grpc_peer("") is None
    assert ApiKeys.of(KEY).client(KEY, "127.0.0.1:1") == key_id
    assert ApiKeys.of().client(None, "127.0.0.1:5000") == one  # no keys configured: the connection


def test_the_scheduler_refuses_past_a_share_before_the_engine_and_gives_it_back() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine, queue_capacity=8)
    assert scheduler._shares.limits == ClientLimits(4, 1 * 2048 // 2)  # the defaults: half of 8, of 1 x 2048
    scheduler._shares.limits = ClientLimits(completions=4, tokens=40)
    hog = dataclasses.replace(args("hog", max_tokens=30, n=3), client="key-hog")

    async def scenario() -> tuple[Any, list[Any], list[Any], list[Any]]:
        first = scheduler.generate(hog)
        head = await first.__anext__()  # 3 completions of 3 + 30 tokens: within (it held nothing)
        by_count = await drain(scheduler, dataclasses.replace(args("more", max_tokens=2, n=2), client="key-hog"))
        by_tokens = await drain(scheduler, dataclasses.replace(args("long", max_tokens=2), client="key-hog"))
        other = await drain(scheduler, dataclasses.replace(args("other", max_tokens=2), client="key-other"))
        await first.aclose()
        return head, by_count, by_tokens, other

    head, by_count, by_tokens, other = asyncio.run(scenario())
    assert isinstance(head, IndexedChunk)
    for refused, limit in ((by_count, "max_client_completions=4"), (by_tokens, "max_client_tokens=40")):
        assert len(refused) == 1 and isinstance(refused[0], StreamError), refused
        assert refused[0].code == "capacity" and limit in refused[0].message
    assert other[-1].chunk.finish_reason == "length"  # another client is served meanwhile
    assert "more#0" not in engine.requests and "long" not in engine.requests  # refused before the engine
    assert all(request.tenant == "key-hog" for rid, request in engine.requests.items() if rid.startswith("hog"))
    assert scheduler._counters["rejected_client_share"] == 2
    assert wait_until(lambda: scheduler._shares.clients() == {} and scheduler._live == 0)


def test_a_prompt_too_long_for_the_context_is_refused_before_it_counts() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)  # the config's max_context: 2048
    (refused,) = asyncio.run(drain(scheduler, dataclasses.replace(args("long", prompt="x" * 2045, max_tokens=8),
                                                                  client="key-a")))
    assert refused.code == "invalid" and refused.field == "prompt" and "exceeds the context" in refused.message
    assert "2045 tokens" in refused.message and not engine.requests
    assert scheduler._shares.clients() == {} and scheduler._counters["rejected_invalid"] == 1


def test_client_metrics_carry_ids_and_stay_bounded() -> None:
    metrics = SpecMetrics(ray_metrics=False)
    metrics.client_share("key-aaaaaaaaaaaa", 2, 300)
    text = metrics.text().decode()
    assert 'specserve_client_completions{client="key-aaaaaaaaaaaa"} 2.0' in text
    assert 'specserve_client_tokens{client="key-aaaaaaaaaaaa"} 300.0' in text
    metrics.client_share("key-aaaaaaaaaaaa", 0, 0)  # holds nothing: its series go
    assert "key-aaaaaaaaaaaa" not in metrics.text().decode()
    for index in range(MAX_CLIENT_LABELS + 5):
        metrics.client_refused(f"peer-{index:012x}", "completions")
    text = metrics.text().decode()
    assert text.count("specserve_client_refusals_total{") == MAX_CLIENT_LABELS + 1
    assert f'specserve_client_refusals_total{{client="{OTHER_CLIENTS}",limit="completions"}} 5.0' in text
